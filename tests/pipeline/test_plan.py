"""The plan: made once per output folder, loaded by every task, and redone for exactly what changed."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import pytest
from conftest import convert, saved_plan, state_json

from k3lab.cli import main
from k3lab.formats import safetensors
from k3lab.kimi_k3.model import MODEL
from k3lab.pipeline.planning import forecast, planner
from k3lab.pipeline.planning import plan as plan_mod
from k3lab.pipeline.running.task import Task, run_task
from k3lab.pipeline.sources.base import SourceSpec


def _copy(src: Path, tmp: Path) -> Path:
    dst = tmp / "src"
    shutil.copytree(src, dst)
    return dst


def _stamps(out: Path) -> dict[str, int]:
    """Each finished file's inode: a rewrite (written as .partial, renamed) gives a new one."""
    return {p.name: p.stat().st_ino for p in sorted(out.glob("*.gguf"))}


def _kv(path: Path, key: str) -> object:
    return gguf.GGUFReader(path).fields[key].contents()


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def test_the_plan_is_saved_and_reused_until_an_input_changes(tiny_src: Path, tmp_path: Path) -> None:
    first = saved_plan(tiny_src, tmp_path)
    saved = state_json(tmp_path / ".k3lab" / "plan.json")
    assert saved["format"] == plan_mod.PLAN_FORMAT and saved["inputs_digest"] == first.inputs_digest
    assert set(saved["inputs"]["meta"]) >= {"config.json", "model.safetensors.index.json", "tiktoken.model"}
    calls = []
    real = planner.build_plan
    planner.build_plan = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        again = saved_plan(tiny_src, tmp_path)
    finally:
        planner.build_plan = real
    assert not calls  # loaded, not made again
    assert [f.digest for f in again.files] == [f.digest for f in first.files]


def test_a_task_reads_only_its_own_shard_header(tiny_src: Path, tmp_path: Path, monkeypatch) -> None:
    spec = SourceSpec.local(tiny_src)
    plan = saved_plan(tiny_src, tmp_path)
    read: list[str] = []
    real = safetensors.read_raw_header
    monkeypatch.setattr(
        "k3lab.pipeline.sources.base.read_raw_header", lambda p: read.append(Path(p).name) or real(p)
    )
    monkeypatch.setattr(
        "k3lab.pipeline.sources.base.read_index", lambda *a: pytest.fail("a task parsed the index")
    )
    from k3lab.pipeline import sources
    from k3lab.pipeline.running import task

    sources._open.cache_clear()
    task.task_plan.cache_clear()
    result = run_task(Task(MODEL, str(tmp_path), spec, plan.inputs_digest), 3)
    assert not result.skipped
    assert read == [plan.file(3).source_names[0]]


@pytest.mark.parametrize(
    "change",
    ["rms_norm_eps", "chat_template_in_tokenizer_config", "chat_template_flag", "tiktoken_special_name"],
)
def test_a_metadata_change_rewrites_file_1_and_only_file_1(
    tiny_src: Path, tmp_path: Path, change: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _copy(tiny_src, tmp_path)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    before = _stamps(out)
    extra: list[str] = []
    first = next(out.glob("*-00001-of-*.gguf"))
    if change == "rms_norm_eps":
        _edit_json(src / "config.json", lambda c: c["text_config"].__setitem__("rms_norm_eps", 3e-6))
        key, want = "kimi-k3.attention.layer_norm_rms_epsilon", pytest.approx(3e-6)
    elif change == "chat_template_in_tokenizer_config":
        _edit_json(src / "tokenizer_config.json", lambda c: c.__setitem__("chat_template", "{{ messages }}"))
        key, want = "tokenizer.chat_template", "{{ messages }}"
    elif change == "chat_template_flag":
        template = tmp_path / "t.jinja"
        template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
        extra = ["--chat-template", str(template)]
        key, want = "tokenizer.chat_template", template.read_text()
    else:
        _edit_json(
            src / "tokenizer_config.json",
            lambda c: (
                c["added_tokens_decoder"]["163587"].__setitem__("content", "<|opened|>")
                if "163587" in c["added_tokens_decoder"]
                else next(iter(c["added_tokens_decoder"].values())).__setitem__("content", "<|opened|>")
            ),
        )
        key, want = None, None
    capsys.readouterr()
    assert convert(src, out, *extra) == 0
    assert "1 written, 8 already complete" in capsys.readouterr().out
    after = _stamps(out)
    assert after.pop(first.name) != before.pop(first.name)
    assert after == before
    if key:
        assert _kv(first, key) == want
    else:
        assert "<|opened|>" in _kv(first, "tokenizer.ggml.tokens")
    assert main(["verify", str(out), "--src", str(src), "--quiet"] + []) == 0


def test_verify_src_says_file_1_is_stale_when_the_config_changed_since(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _copy(tiny_src, tmp_path)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    _edit_json(src / "config.json", lambda c: c["text_config"].__setitem__("rms_norm_eps", 3e-6))
    capsys.readouterr()
    assert main(["verify", str(out), "--src", str(src), "--quiet"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "stale" in ln]
    assert len(lines) == 1 and "-00001-of-" in lines[0] and "metadata" in lines[0]


def _only_file_3_is_redone(src: Path, out: Path, before: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """A rerun after the shard holding layer 2 changed: output file 3 written again, the rest kept."""
    capsys.readouterr()
    assert convert(src, out) == 0
    assert "1 written, 8 already complete" in capsys.readouterr().out
    after = _stamps(out)
    third = next(p for p in after if "-00003-of-" in p)
    assert after.pop(third) != before.pop(third)
    assert after == before


def test_a_changed_shard_header_redoes_its_own_file_only(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _copy(tiny_src, tmp_path)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    before = _stamps(out)
    shard = sorted(src.glob("model-*.safetensors"))[2]  # holds layer 2: output file 3
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = {**header.get("__metadata__", {}), "saved_by": "another tool"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    _only_file_3_is_redone(src, out, before, capsys)


@pytest.mark.parametrize("how", ["same size, one byte, mtime put back", "replaced by a copy"])
def test_a_header_changed_under_a_finished_folder_redoes_exactly_its_readers(
    tiny_src: Path, tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun trusts a source file's recorded header while its identity (size, mtime, ctime, inode,
    device) is unchanged; a header that changed is read again however it changed: one byte in the
    same size with the mtime set back (ctime cannot be), or a new file in its place."""
    import os

    src = _copy(tiny_src, tmp_path)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    before = _stamps(out)
    shard = sorted(src.glob("model-*.safetensors"))[2]  # holds layer 2: output file 3
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    assert data[8 + n - 1 : 8 + n] == b" "  # the header's padding: JSON whitespace
    data[8 + n - 1] = ord("\t")
    if how.startswith("same size"):
        st = shard.stat()
        with open(shard, "r+b") as fh:
            fh.write(data)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    else:
        copy = shard.with_name("copy.tmp")
        copy.write_bytes(data)
        os.replace(copy, shard)
    _only_file_3_is_redone(src, out, before, capsys)


def test_a_rerun_with_nothing_to_do_reads_no_header(tiny_src: Path, tmp_path: Path, monkeypatch) -> None:
    """The saved plan's inputs are proven by the files' identities: no header or metadata file is read
    or hashed again while they stay as they are; one that changed is (the tests above)."""
    from k3lab.pipeline.sources import base, spec

    out = tmp_path / "out"
    assert convert(tiny_src, out) == 0
    proven = state_json(out / ".k3lab" / "plan.json")["proven"]
    assert len(proven["files"]) == 9 and {"config.json", "tiktoken.model"} <= set(proven["meta"])
    reads: list[str] = []
    monkeypatch.setattr(base, "read_raw_header", lambda path, *a: reads.append(str(path)))
    monkeypatch.setattr(spec, "sha256_file", lambda path, *a: reads.append(str(path)))
    assert convert(tiny_src, out) == 0
    assert reads == []


def test_a_task_refuses_a_shard_that_changed_after_planning(tiny_src: Path, tmp_path: Path) -> None:
    src = _copy(tiny_src, tmp_path)
    spec = SourceSpec.local(src)
    plan = saved_plan(src, tmp_path / "out")
    shard = src / plan.file(2).source_names[0]
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    shard.write_bytes(data[: 8 + n - 1] + b"\n" + data[8 + n :])  # same length, other header bytes
    from k3lab.pipeline import sources
    from k3lab.pipeline.running import task

    sources._open.cache_clear()
    task.task_plan.cache_clear()
    with pytest.raises(plan_mod.PlanError, match="header differs from the one the plan was made from"):
        run_task(Task(MODEL, str(tmp_path / "out"), spec, plan.inputs_digest), 2)
    assert not list((tmp_path / "out").glob("*.gguf*"))


def test_plan_forecasts_memory_per_file(tiny_src: Path, tmp_path: Path) -> None:
    from k3lab.pipeline.streams import STREAMS

    plan = saved_plan(tiny_src, tmp_path)
    assert all(f.memory >= forecast.BASE_RSS for f in plan.files)
    moe = [f for f in plan.files if any(t.transform == "mxfp4_stack" for t in f.tensors)]
    assert moe and all(f.memory >= forecast.BASE_RSS + STREAMS["mxfp4"].fixed for f in moe)
    dense = plan.file(len(plan.files))  # embeddings and lm_head: copies only
    assert dense.memory < moe[0].memory


@pytest.mark.parametrize("make", ["real_config", "tiny_config", "tiny_f32_config", "testmodel_config"])
def test_a_units_layout_made_lazily_is_the_layout_made_whole(make: str) -> None:
    """``unit_layout`` makes a MoE layer's expert specs when asked: every layer's mapping holds the
    same names in the same order, each the same spec, as the one made whole; nothing else is in it."""
    from k3lab.kimi_k3 import layout
    from k3lab.kimi_k3.config import K3Config
    from k3lab.kimi_k3.synth import presets

    cfg = K3Config.from_dict(getattr(presets, make)())
    f, declared = layout.source_dtype(cfg), layout.declared_dtype(cfg)
    for bid in sorted({0, cfg.n_dense_lead, cfg.n_layer - 1}):
        whole = layout._accepting(
            layout._text_layer(cfg, bid, f, "both" if cfg.is_mxfp4 else "plain"), declared
        )
        lazy = layout.unit_layout(cfg, bid)
        assert list(lazy) == list(whole) and len(lazy) == len(whole)
        assert all(lazy.get(n) == s and lazy[n] == s for n, s in whole.items())
        p = f"language_model.model.layers.{bid}.block_sparse_moe.experts."
        strangers = (f"{p}{cfg.n_expert}.w1.weight", f"{p}01.w1.weight", f"{p}0.w4.weight", f"{p}0.w1.bias")
        for stranger in (*strangers, f"{p}\u00b2.w1.weight", f"{p}0.w1", f"{p}-1.w1.weight"):
            assert lazy.get(stranger) is None and stranger not in lazy


def test_a_rules_source_names_are_its_templates_formatted() -> None:
    """``Rule.source_names`` (made by cutting each template once around its expert number) is every
    template formatted with the layer and each expert number, expert-major, for every rule."""
    from k3lab.kimi_k3.config import K3Config
    from k3lab.kimi_k3.model import MODEL
    from k3lab.kimi_k3.synth import presets

    for cfg in (K3Config.from_dict(presets.real_config()), K3Config.from_dict(presets.tiny_config())):
        for rule in MODEL.rules:
            for bid in (None, 0, cfg.n_layer - 1):
                experts = range(cfg.n_expert) if rule.per_expert else [None]
                want = tuple(rule.prefix + s.format(bid=bid, e=e) for e in experts for s in rule.sources)
                assert rule.source_names(cfg, bid) == want, rule
