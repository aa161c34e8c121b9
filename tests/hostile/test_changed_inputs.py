"""A changed input is never taken for an unchanged one: a source file whose tensor data changed in place
(same size, same header, its mtime put back) redoes exactly the output files that read it, and the
variants made from them; a source file that was only touched or copied is proven by its bytes and kept.
Each on the tiny checkpoint converted a layer per file, as one file, and from size shards."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from conftest import convert, state_json
from llama_support import needs_llama

from k3lab.cli import main
from k3lab.kimi_k3.synth import synthesize


def _stamps(out: Path) -> dict[str, int]:
    """Each finished file's inode (a file written again is renamed into place: a new inode)."""
    return {str(p.relative_to(out)): p.stat().st_ino for p in sorted(out.rglob("*.gguf"))}


def _flip_data_byte(shard: Path, at: int = 100) -> None:
    """One byte of the shard's tensor data changed in place: same size, same header, mtime put back."""
    st = shard.stat()
    with open(shard, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8 + n + at)
        old = fh.read(1)
        fh.seek(8 + n + at)
        fh.write(bytes([old[0] ^ 0x5A]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns


def _readers(out: Path, shard: Path, at: int = 100) -> set[str]:
    """The output files whose records say they read the tensor holding data byte ``at`` of ``shard``."""
    with open(shard, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    (name,) = [
        k
        for k, v in header.items()
        if k != "__metadata__" and v["data_offsets"][0] <= at < v["data_offsets"][1]
    ]
    found = set()
    for rec in (out / ".k3lab").glob("0*.json"):
        data = state_json(rec)
        if any(s == {"name": name, "file": shard.name} for t in data["tensors"] for s in t["sources"]):
            found.add(data["file"])
    return found


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny in Moonshot's layout and in size shards (a layer's tensors across files)."""
    root = tmp_path_factory.mktemp("changed")
    made = {}
    for layout in ("moonshot", "by-size:600000"):
        made[layout] = root / layout.replace(":", "-")
        synthesize("tiny", made[layout], seed=0, layout=layout)
    return made


@pytest.mark.parametrize(
    "layout, per_layer",
    [("moonshot", True), ("moonshot", False), ("by-size:600000", True)],
    ids=["split set", "one file", "size shards"],
)
def test_data_changed_in_place_redoes_exactly_the_files_that_read_it(
    sources: dict[str, Path], tmp_path: Path, layout: str, per_layer: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources[layout], src)
    out = tmp_path / "out"
    assert convert(src, out, per_layer=per_layer) == 0
    shard = sorted(src.glob("model-*.safetensors"))[2]
    readers = _readers(out, shard)
    assert readers
    before = _stamps(out)
    _flip_data_byte(shard)
    capsys.readouterr()
    assert convert(src, out, per_layer=per_layer) == 0
    said = capsys.readouterr().out
    assert f"{len(readers)} written, {len(before) - len(readers)} already complete" in said
    after = _stamps(out)
    assert {f for f in before if after[f] != before[f]} == readers
    assert main(["verify", str(out), "--src", str(src), "--quiet"]) == 0


def test_a_touched_or_copied_source_is_proven_by_its_bytes_once(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """A new identity with the same bytes: nothing redone; the records take the new identities, so the
    next run reads no source data at all."""
    from k3lab.pipeline.writing import convert as convert_mod

    src = tmp_path / "src"
    shutil.copytree(sources["moonshot"], src)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    before = _stamps(out)
    copied = tmp_path / "copied"
    shutil.copytree(src, copied)  # (new inodes, ctimes)
    shutil.rmtree(src)
    copied.rename(src)
    capsys.readouterr()
    assert convert(src, out) == 0
    assert "0 written, 9 already complete" in capsys.readouterr().out
    assert _stamps(out) == before
    hashed: list[str] = []
    real = convert_mod.hashed_again
    monkeypatch.setattr(convert_mod, "hashed_again", lambda *a: hashed.append(1) or real(*a))
    assert convert(src, out) == 0
    assert hashed == []


def test_a_record_that_proves_nothing_of_a_local_source_is_redone(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record of what it read without a digest (an earlier k3lab's, or a file that changed while it
    was read): its output is redone once the source's identity is not the recorded one."""
    from k3lab.pipeline.state import OutputFolder

    src = tmp_path / "src"
    shutil.copytree(sources["moonshot"], src)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    records = OutputFolder(out).records
    rec = records.text(3)
    assert rec is not None and all(v["sha256"] for v in rec.read.values())
    rec.read = {}
    records.write(rec)
    os.utime(src / rec.sources[0].file)
    capsys.readouterr()
    assert convert(src, out) == 0
    assert "1 written, 8 already complete" in capsys.readouterr().out


@needs_llama
def test_a_set_converted_again_makes_its_variants_stale(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The variant files made from a set file converted again (its source changed) are named stale
    by ``verify`` and made again by the next ``quantize``, exactly those."""
    src = tmp_path / "src"
    shutil.copytree(sources["moonshot"], src)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    assert main(["quantize", str(out), "--type", "Q8_0", "--quiet"]) == 0
    before = _stamps(out)
    _flip_data_byte(sorted(src.glob("model-*.safetensors"))[2])  # layer 2: output file 3
    assert convert(src, out) == 0
    capsys.readouterr()
    assert main(["verify", str(out / "Q8_0"), "--src", str(out), "--quiet"]) == 1
    said = capsys.readouterr().out
    assert "-00003-of-00009.gguf: stale: made from" in said
    assert main(["quantize", str(out), "--type", "Q8_0", "--quiet"]) == 0
    after = _stamps(out)
    changed = {f for f in before if after[f] != before[f]}
    assert changed == {f for f in before if "-00003-of-" in f}
    assert main(["verify", str(out / "Q8_0"), "--src", str(out), "--quiet"]) == 0
