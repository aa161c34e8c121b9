"""verify: every flipped byte is found and named; damaged sets are reported one line per problem."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from conftest import (
    ROOT,  # noqa: E402  (the repository)
    convert,
)

from k3lab.cli import main
from k3lab.kimi_k3.model import MODEL
from k3lab.pipeline.publishing.tensor_map import tensor_map_markdown


def _verify(out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, list[str]]:
    code = main(["verify", str(out), "--quiet", *extra])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, lines


def _copy(tiny_out: Path, tmp_path: Path) -> Path:
    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    return out


def _where(out: Path, file: str, pos: int) -> str:
    """What the manifest says lives at byte `pos` of `file`: a tensor name, 'header' or 'padding'."""
    rec = next(r for r in json.loads((out / "MANIFEST.json").read_text())["files"] if r["file"] == file)
    if pos < rec["data_start"]:
        return "header"
    for t in rec["tensors"]:
        if t["offset"] <= pos < t["offset"] + t["nbytes"]:
            return t["name"]
    return "padding"


def test_intact_set_passes(tiny_out: Path, tiny_src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _verify(tiny_out, capsys, "--src", str(tiny_src))
    assert code == 0 and lines[-1].startswith("verify OK: 9 files, 218 tensors")


def test_every_flipped_byte_is_named(
    tiny_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(1234)
    files = sorted(p.name for p in tiny_out.glob("*.gguf"))
    cases = [(files[0], 40), (files[4], 200)]  # in the metadata / tensor infos
    cases += [(f, (tiny_out / f).stat().st_size - 1) for f in (files[1], files[-1])]  # the last byte
    for _ in range(8):  # inside random tensors
        f = rng.choice(files)
        rec = next(r for r in json.loads((tiny_out / "MANIFEST.json").read_text())["files"] if r["file"] == f)
        t = rng.choice(rec["tensors"])
        cases.append((f, t["offset"] + rng.randrange(t["nbytes"])))
    for i, (f, pos) in enumerate(cases):
        out = tmp_path / f"case{i}"
        shutil.copytree(tiny_out, out)
        data = bytearray((out / f).read_bytes())
        data[pos] ^= 0x5A
        (out / f).write_bytes(bytes(data))
        code, lines = _verify(out, capsys)
        assert code == 1, (f, pos)
        what = _where(out, f, pos)
        problems = lines[:-1]
        assert problems and all(line.startswith(f) for line in problems), lines
        assert any(
            (f"tensor {what}:" if what not in ("header", "padding") else what) in line for line in problems
        ), (what, lines)
        shutil.rmtree(out)


def test_truncated_missing_and_foreign_files_are_one_line_each(
    tiny_out: Path, tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other_src = tmp_path / "other-src"
    assert main(["synth", "--preset", "tiny", "--seed", "7", "--out", str(other_src)]) == 0
    other = tmp_path / "other"
    assert convert(other_src, other, "--shards", "3") == 0
    out = _copy(tiny_out, tmp_path)
    files = sorted(p.name for p in out.glob("*.gguf"))
    (out / files[1]).write_bytes((out / files[1]).read_bytes()[:-100])
    (out / files[5]).unlink()
    shutil.copy(other / files[2], out / files[2])
    capsys.readouterr()
    code, lines = _verify(out, capsys)
    assert code == 1
    problems = lines[:-1]
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"{files[1]}: truncated:")
    assert problems[1].startswith(f"{files[2]}: not from this conversion")
    assert problems[2] == f"{files[5]}: missing"


def test_changed_source_is_found_with_src(
    tiny_out: Path, tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    name = "model-00004-of-000011.safetensors"
    data = bytearray((src / name).read_bytes())
    data[-3] ^= 0x01  # a bit of the last tensor of layer 3
    (src / name).write_bytes(bytes(data))
    code, lines = _verify(tiny_out, capsys, "--src", str(src))
    assert code == 1
    bad = [line for line in lines if "re-derived from the source, SHA-256 differs" in line]
    assert len(bad) == 1 and name in bad[0] and "blk.3." in bad[0], lines


def test_tensor_map_md_is_current() -> None:
    assert (ROOT / "TENSOR_MAP.md").read_text() == tensor_map_markdown(MODEL), (
        "run: k3lab tensor-map > TENSOR_MAP.md"
    )
