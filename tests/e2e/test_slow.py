"""Slow: real-size checks (run with `make test-slow`, i.e. `pytest -m slow`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3lab.formats.bpe_merges import bpe_merges, merges_reference
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.model import MODEL
from k3lab.kimi_k3.synth import synthesize
from k3lab.kimi_k3.synth.generate import write_tokenizer_files
from k3lab.kimi_k3.synth.presets import real_config
from k3lab.kimi_k3.tokenizer import read_tiktoken
from k3lab.pipeline.planning.planner import build_plan
from k3lab.pipeline.sources.local import LocalSource

pytestmark = pytest.mark.slow


def test_real_size_vocabulary_merges_equal_the_definition(tmp_path: Path) -> None:
    raw = real_config()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    write_tokenizer_files(tmp_path, K3Config.from_dict(raw), seed=0)
    ranked = read_tiktoken(tmp_path / "tiktoken.model")
    assert len(ranked) == 163_584
    assert bpe_merges(ranked) == merges_reference(ranked)


def test_plan_of_the_full_model(tmp_path: Path) -> None:
    synthesize("full", tmp_path)
    plan = build_plan(MODEL, K3Config.load(tmp_path), LocalSource(tmp_path))
    assert len(plan.files) == 94 and plan.label == "MXFP4"
    exps = [t for f in plan.files for t in f.tensors if t.name.endswith("_exps.weight")]
    assert len(exps) == 92 * 3
    down = next(t for t in exps if t.name == "blk.5.ffn_down_exps.weight")
    assert down.info.ne == (3072, 3584, 896) and down.info.type.name == "MXFP4"
    assert sum(f.nbytes for f in plan.files) > 1.4 * 2**40


def test_the_published_test_models_shape_converts_to_one_file_llama_cpp_runs(tmp_path: Path) -> None:
    """inference-optimization/Kimi-K3-0.40B's config, as it is published: one model.safetensors of
    F32 (about 1.6 GB), plain experts, no index; ``--outtype f16`` makes ONE file, named as upstream's
    converter named the seed's (``Kimi-K3-0.40B-F16.gguf``: the size label the checkpoint's name
    carries), that llama.cpp loads and runs."""
    import gguf
    from llama_support import HAVE_LLAMA

    from k3lab.cli import main

    src = tmp_path / "Kimi-K3-0.40B"  # (as `hf download ... --local-dir Kimi-K3-0.40B` names it)
    made = synthesize("testmodel", src)
    assert made.files == ("model.safetensors",) and not (src / "model.safetensors.index.json").exists()
    out = tmp_path / "out"
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--outtype", "f16", "--quiet"]) == 0
    (one,) = out.glob("*.gguf")
    assert one.name == "Kimi-K3-0.40B-F16.gguf", one.name
    reader = gguf.GGUFReader(one)
    assert not [k for k in reader.fields if k.startswith("split.")]
    assert reader.fields["kimi-k3.vocab_size"].contents() == 163840
    if HAVE_LLAMA:
        import llama_cpp

        llm = llama_cpp.Llama(str(one), n_ctx=64, n_threads=2, verbose=False)
        llm.eval([1, 100, 200])
        assert llm.sample(top_k=1, temp=0.0) >= 0
