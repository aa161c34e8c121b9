"""An imatrix is an input like a source file, and llama-quantize's rules are the rules: every imatrix
``llama-quantize`` refuses, k3lab refuses in one line before any work (both tried on the same bytes);
the strings it records of an imatrix (dataset names long, many, not UTF-8) recorded byte for byte;
an imatrix changed while a run goes on stops the run, nothing made from two different files."""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from imatrix_craft import from_imatrix
from llama_support import needs_llama

from k3lab.cli import main

pytestmark = needs_llama
IMATRIX = ROOT / "tests" / "data" / "imatrix-tiny.gguf"


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.fixture()
def set_dir(tiny_out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(tiny_out, dst)
    return dst


def _key_twice() -> bytes:
    made = from_imatrix(IMATRIX)
    made.kv_u32("imatrix.chunk_size", 64)
    return made.to_bytes()


def _tensor_twice() -> bytes:
    made = from_imatrix(IMATRIX)
    name, ne, data = made.tensors[0]
    made.tensors.append((name, ne, data))
    return made.to_bytes()


def _five_dims() -> bytes:
    made = from_imatrix(IMATRIX)
    name, ne, data = made.tensors[0]
    made.tensors[0] = (name, [*ne, 1, 1, 1, 1][:5], data)
    return made.to_bytes()


def _long_name() -> bytes:
    made = from_imatrix(IMATRIX)
    made.tensor("blk.0." + "x" * 60 + ".weight.in_sum2", np.ones(8))
    made.tensor("blk.0." + "x" * 60 + ".weight.counts", np.ones(1))
    return made.to_bytes()


def _cut_in_the_last_padding() -> bytes:
    made = from_imatrix(IMATRIX)
    made.tensor("blk.0.extra.weight.counts", np.ones(1))  # (4 bytes, then 28 of padding)
    made.tensor("blk.0.extra.weight.in_sum2", np.ones(32))
    made.tensors[-2], made.tensors[-1] = made.tensors[-1], made.tensors[-2]
    raw = made.to_bytes()
    return raw[:-8]  # every tensor's bytes still there: only the padding after the last is short


def _out_of_order() -> bytes:
    raw = bytearray(from_imatrix(IMATRIX).to_bytes())
    made = from_imatrix(IMATRIX)
    first, second = made.tensors[0][0], made.tensors[1][0]
    # the first two tensor infos' data offsets swapped: each still within the file, not in order
    at1 = raw.index(struct.pack("<Q", len(first)) + first)
    at2 = raw.index(struct.pack("<Q", len(second)) + second)
    off1 = at1 + 8 + len(first) + 4 + 8 * len(made.tensors[0][1]) + 4
    off2 = at2 + 8 + len(second) + 4 + 8 * len(made.tensors[1][1]) + 4
    o1, o2 = raw[off1 : off1 + 8], raw[off2 : off2 + 8]
    raw[off1 : off1 + 8], raw[off2 : off2 + 8] = o2, o1
    return bytes(raw)


BROKEN = {
    "a key twice": (_key_twice, "repeated"),
    "a tensor twice": (_tensor_twice, "repeated"),
    "five dimensions": (_five_dims, "5 dimensions"),
    "a name of 64 bytes or more": (_long_name, "of 64 bytes or more"),
    "cut short in its last padding": (_cut_in_the_last_padding, "before its data does"),
    "tensors out of order": (_out_of_order, "one after another"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_imatrix_llama_quantize_refuses_is_refused_in_one_line(
    case: str, set_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llama_tree import llama_quantize

    make, said = BROKEN[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make())
    first = sorted(set_dir.glob("*.gguf"))[0]
    theirs = subprocess.run([str(llama_quantize()), "--keep-split", "--allow-requantize", "--imatrix", str(bad),
                             str(first), str(tmp_path / "ref.gguf"), "Q8_0"],
                            capture_output=True, text=True, errors="replace", timeout=300)  # fmt: skip
    assert theirs.returncode != 0 and "failed to load imatrix" in theirs.stderr, theirs.stderr[-800:]
    before = _tree(set_dir)
    assert main(["quantize", str(set_dir), "--type", "Q8_0", "--imatrix", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and said in err[0], err
    assert _tree(set_dir) == before


DATASETS = {
    "not UTF-8": [b"calib\xff\xfe-\xc3(text).txt"],
    "long, cut inside a character": ["données-".encode() * 40],
    "many": [f"part-{i:04d}.txt".encode() for i in range(3000)],
    "with a NUL": [b"first\0second"],
}


@pytest.mark.parametrize("case", list(DATASETS))
def test_what_llama_quantize_records_of_an_imatrix_is_recorded_byte_for_byte(
    case: str, set_dir: Path, tmp_path: Path
) -> None:
    from llama_tree import quantize_like_llama

    im = tmp_path / "im.gguf"
    im.write_bytes(from_imatrix(IMATRIX, DATASETS[case]).to_bytes())
    assert main(["quantize", str(set_dir), "--type", "IQ2_XXS", "--imatrix", str(im), "--quiet"]) == 0
    ref = tmp_path / "ref"
    ref.mkdir()
    first = sorted(set_dir.glob("*.gguf"))[0]
    quantize_like_llama(first, ref / "Kimi-K3-IQ2_XXS.gguf", "IQ2_XXS", "--imatrix", str(im))
    ours = sorted((set_dir / "IQ2_XXS").glob("*.gguf"))
    assert [p.name for p in ours] == sorted(p.name for p in ref.glob("*.gguf"))
    assert ours[0].read_bytes() == (ref / ours[0].name).read_bytes()


def test_an_imatrix_changed_in_place_while_a_run_goes_on_stops_it(
    set_dir: Path, tmp_path: Path, capsys
) -> None:
    """The plan reads the imatrix whole once (each entry's SHA-256); a task that finds an entry's
    bytes other than those (the file rewritten in place under the run's open descriptor, identity
    and all) stops in one line, and no file of the variant is made from the new bytes."""
    from k3lab.formats.imatrix import read_index
    from k3lab.pipeline.quantizing import imatrix_files
    from k3lab.pipeline.quantizing import quantize as quantize_mod

    im = tmp_path / "im.gguf"
    shutil.copy(IMATRIX, im)
    raw = bytearray(im.read_bytes())
    index = read_index(lambda a, n: bytes(raw[a : a + n]), len(raw), "x")
    at = index.entries["blk.4.attn_q.weight"].sums[0]  # (file 5's)
    real = quantize_mod.imatrix_rows
    calls: list[str] = []

    def rewrite_then_read(plan, vt, token=None):  # the file changes between two tasks' reads
        if not calls:
            reader = imatrix_files.reader(plan.imatrix)  # (the run's descriptor, opened before the change)
            with open(im, "r+b") as fh:
                fh.seek(at)
                fh.write(struct.pack("<f", 123.0))
            assert reader is imatrix_files.reader(plan.imatrix)
        calls.append(vt.name)
        return real(plan, vt, token)

    quantize_mod.imatrix_rows = rewrite_then_read
    imatrix_files._READERS.clear()
    try:
        assert main(["quantize", str(set_dir), "--type", "Q4_K_M", "--imatrix", str(im), "--quiet"]) == 2
    finally:
        quantize_mod.imatrix_rows = real
        imatrix_files._READERS.clear()
    err = capsys.readouterr().err
    assert "entry blk.4.attn_q.weight: its bytes are not the ones read when the run began" in err
    assert not list((set_dir / "Q4_K_M").glob("*-00005-of-00009.gguf"))


def test_an_absolute_imatrix_path_is_said_before_it_goes_into_every_file(set_dir: Path, capsys) -> None:
    """llama-quantize records the path it was given (``quantize.imatrix.file``); k3lab records the
    same bytes, and says so before any work when that path is absolute (a home folder, published)."""
    assert main(["quantize", str(set_dir), "--type", "Q4_K_M", "--imatrix", str(IMATRIX)]) == 0
    err = capsys.readouterr().err
    assert f"quantize.imatrix.file records the path given, {str(IMATRIX)!r}, in every file" in err
    import gguf

    first = sorted((set_dir / "Q4_K_M").glob("*.gguf"))[0]
    assert gguf.GGUFReader(first).fields["quantize.imatrix.file"].contents() == str(IMATRIX)
