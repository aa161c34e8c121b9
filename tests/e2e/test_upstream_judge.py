"""Upstream llama.cpp's own converter as a judge (slow: builds a venv with CPU torch the first time).

The converter is the one vendored in the llama-cpp-python 0.3.36 sdist (``convert_hf_to_gguf.py`` +
``conversion/`` + ``gguf-py``), run as it is, in its own virtual environment, on the tiny synthetic
checkpoint: every tensor it writes (name, type, shape, bytes) and every key must be in k3lab's split
set with the same value. Nothing of it is copied into k3lab.

One step of upstream's is skipped: its vocabulary step identifies Kimi's pre-tokenizer by hashing the
*real* vocabulary's output and loads Moonshot's remote tokenizer code, so it cannot read a synthetic
vocabulary at all. k3lab's vocabulary is judged by llama.cpp's tokenizer against tiktoken instead
(tests/unit/test_tokenizer.py), so the tokenizer.* keys are left out here.

Run with: make test-slow (or pytest -m slow tests/e2e/test_upstream_judge.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import convert
from llama_tree import CACHE, vendor_tree

pytestmark = pytest.mark.slow

# upstream's converter, with its vocabulary step switched off (see the module docstring)
LAUNCHER = """
import runpy, sys
vendor = sys.argv.pop(1)
sys.path[:0] = [vendor, vendor + "/gguf-py"]
from conversion.kimi_k3 import KimiK3Model
KimiK3Model.set_vocab = lambda self: None
sys.argv[0] = vendor + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# what upstream writes that a k3lab file cannot match by design
NOT_COMPARED = {
    "general.name": "upstream names the file after the checkpoint's folder; k3lab after --name and the type",
    "general.basename": "upstream's guess from the folder name",
}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd[:4]}...: {r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="session")
def judge() -> tuple[Path, Path]:
    """(the judge venv's python, the vendored llama.cpp tree), made once and cached."""
    vendor = vendor_tree()
    python = CACHE / "venv" / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(CACHE / "venv")])
        # torch 2.13.0's CPU wheel is what this machine kind provides locally; transformers is only
        # imported (the config is read from config.json)
        _run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "torch==2.13.0",
                "transformers",
                "numpy",
                "sentencepiece",
                "safetensors",
                "pyyaml",
                "requests",
                "tqdm",
            ],
            timeout=3000,
        )
    return python, vendor


@pytest.mark.parametrize("variant", ["as synthesised", "with grouped routing"])
def test_every_tensor_and_key_upstream_writes_is_in_k3labs_set(
    judge: tuple[Path, Path], tiny_src: Path, tmp_path: Path, variant: str
) -> None:
    python, vendor = judge
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    if variant == "with grouped routing":  # upstream writes the group keys when the config has them
        cfg = json.loads((src / "config.json").read_text())
        cfg["text_config"].update(n_group=2, topk_group=1)
        (src / "config.json").write_text(json.dumps(cfg))
    assert convert(src, tmp_path / "out") == 0
    theirs = tmp_path / "upstream.gguf"
    cmd = [str(python), "-c", LAUNCHER, str(vendor), str(src), "--outfile", str(theirs), "--outtype", "bf16"]
    _run(cmd, timeout=1800, env={**os.environ, "PYTHONPATH": ""})
    up = gguf.GGUFReader(theirs)
    if variant == "with grouped routing":
        assert up.fields["kimi-k3.expert_group_used_count"].contents() == 1
    _agree(up, sorted((tmp_path / "out").glob("Kimi-K3-*-of-*.gguf")))


def _agree(up: gguf.GGUFReader, ours_paths: list[Path]) -> None:
    """Every tensor upstream wrote (name, type, shape, bytes) and every key is in k3lab's set."""
    ours_files = [gguf.GGUFReader(p) for p in ours_paths]
    ours = {t.name: t for r in ours_files for t in r.tensors}

    # every tensor: name, type, shape, bytes (exp may differ by an ulp between torch and numpy)
    assert {t.name for t in up.tensors} == set(ours)
    inexact = []
    for t in up.tensors:
        o = ours[t.name]
        assert (t.tensor_type, list(t.shape)) == (o.tensor_type, list(o.shape)), t.name
        a, b = np.asarray(t.data), np.asarray(o.data)
        if a.tobytes() != b.tobytes():
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=0, err_msg=t.name)
            inexact.append(t.name)
    assert all(".ssm_a" in n for n in inexact), inexact  # only -exp(A_log) may round differently

    # every key upstream writes, with the same value (tokenizer.* skipped: see the module docstring)
    first = ours_files[0]
    for key, field in up.fields.items():
        if key.startswith(("GGUF.", "tokenizer.", "split.")) or key in NOT_COMPARED:
            continue
        assert key in first.fields, f"k3lab's file 1 lacks {key}"
        want, got = field.contents(), first.fields[key].contents()
        if isinstance(want, float) or (isinstance(want, list) and want and isinstance(want[0], float)):
            np.testing.assert_allclose(got, want, rtol=1e-7, err_msg=key)
        else:
            assert got == want, (key, got, want)


@pytest.mark.parametrize("layout", ["one-file", "by-size:600000"])
def test_upstream_agrees_on_moonshots_checkpoints_as_transformers_saves_them(
    judge: tuple[Path, Path], tiny_src: Path, tmp_path: Path, layout: str
) -> None:
    """Moonshot's own classes, saved by save_pretrained as one file or in size shards (a layer across
    files): upstream's converter and k3lab's one file hold the same tensors and keys."""
    import moonshot

    from k3lab.kimi_k3.synth.presets import tiny_config

    python, vendor = judge
    # the classes make plain BF16 experts: saved so, the config says no quantization (upstream names
    # the file type from a quantization_config, k3lab from the tensors: with one left in, only
    # general.file_type would differ, 38 MXFP4_MOE there for a file without an MXFP4 tensor)
    raw = tiny_config()
    del raw["text_config"]["quantization_config"]
    src = moonshot.save(moonshot.build(raw, seed=7), tmp_path / "src", layout, tokenizer_from=tiny_src)
    assert convert(src, tmp_path / "out", per_layer=False) == 0
    theirs = tmp_path / "upstream.gguf"
    cmd = [str(python), "-c", LAUNCHER, str(vendor), str(src), "--outfile", str(theirs), "--outtype", "bf16"]
    _run(cmd, timeout=1800, env={**os.environ, "PYTHONPATH": ""})
    _agree(gguf.GGUFReader(theirs), sorted((tmp_path / "out").glob("*.gguf")))
