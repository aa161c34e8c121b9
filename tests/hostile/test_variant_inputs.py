"""Variants from bad input: an unknown type, a pattern that is not a regex, an imatrix of another model,
cut short, huge, special, not finite, or missing where a type needs one: one line, exit 2, nothing
written (no variant folder made, the set untouched); a run killed part way resumes; a lossless file
changed under its record is never quantised."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from llama_support import needs_llama

from k3lab.cli import main

pytestmark = needs_llama
IMATRIX = ROOT / "tests" / "data" / "imatrix-tiny.gguf"
WIDTHS_IMATRIX = ROOT / "tests" / "data" / "imatrix-widths.gguf"


def _tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture()
def set_dir(tiny_out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(tiny_out, dst)
    return dst


def _imatrix_nan(tmp: Path) -> Path:
    """tiny's imatrix with one sum made NaN (the header intact)."""
    from k3lab.formats.imatrix import read_index

    raw = bytearray(IMATRIX.read_bytes())
    index = read_index(lambda a, n: bytes(raw[a : a + n]), len(raw), "x")
    offset = index.entries["blk.0.attn_q.weight"].sums[0]  # (a dense entry: its count is not 0)
    raw[offset : offset + 4] = struct.pack("<f", float("nan"))
    (tmp / "nan.gguf").write_bytes(bytes(raw))
    return tmp / "nan.gguf"


def _legacy_lying(tmp: Path) -> Path:
    """A legacy .dat whose one entry says it holds 2**30 values."""
    name = b"blk.0.attn_q.weight"
    data = (
        struct.pack("<i", 1)
        + struct.pack("<i", len(name))
        + name
        + struct.pack("<ii", 1, 1 << 30)
        + b"\0" * 64
    )
    (tmp / "lying.dat").write_bytes(data)
    return tmp / "lying.dat"


CASES = {
    "unknown type": (["--type", "Q9_Z"], "not a type llama-quantize makes nor a recipe"),
    "pattern not a regex": (["--type", "Q2_K", "--tensor-type", "ffn_[=q4_k"], "never closed with ']' (std::regex refuses it)"),
    "pattern Python reads otherwise": (["--type", "Q2_K", "--tensor-type", "[[:alpha:]]_exps=q4_k"], "the POSIX class"),
    "pattern that backtracks without end": (["--type", "Q2_K", "--tensor-type", "(.|.)*[a-z][0-9]$=q4_k"], "took over 2 s"),
    "pattern type unknown": (["--type", "Q2_K", "--tensor-type", "ffn=q9_z"], "not a type ggml quantises to"),
    "no pattern": (["--type", "Q2_K", "--tensor-type", "q4_k"], "give PATTERN=TYPE"),
    "imatrix of another model": (
        ["--type", "IQ2_XXS", "--imatrix", str(WIDTHS_IMATRIX)],
        "entry blk.0.attn_q.weight holds 256 values, the tensor needs 128",
    ),
    "imatrix cut short": (["--type", "IQ2_XXS", "--imatrix", "{tmp}/cut.gguf"], "inside its header (cut short?)"),
    "imatrix is text": (["--type", "IQ2_XXS", "--imatrix", "{tmp}/text.dat"], "not an imatrix"),
    "imatrix huge": (["--type", "IQ2_XXS", "--imatrix", "{tmp}/huge.dat"], "larger than any imatrix k3lab reads"),
    "imatrix a FIFO": (["--type", "IQ2_XXS", "--imatrix", "{tmp}/fifo"], "is a FIFO"),
    "imatrix lies about its size": (["--type", "IQ2_XXS", "--imatrix", "{tmp}/lying.dat"], "do not fit the file"),
    "imatrix not finite": (["--type", "IQ2_XXS", "--imatrix", "{tmp}/nan.gguf"], "holds a value that is not finite"),
    "label is a path": (["--type", "Q2_K", "--label", "../x"], "a name of letters"),
    "a row the type cannot fill": (["--type", "Q2_K", "--token-embedding-type", "q4_k"], "needs rows of a multiple of 256"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_variant_input_is_one_line_and_writes_nothing(
    case: str, set_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cut.gguf").write_bytes(IMATRIX.read_bytes()[:5000])
    (tmp_path / "text.dat").write_text("hello, this is not an importance matrix\n")
    with open(tmp_path / "huge.dat", "wb") as fh:
        fh.truncate(1 << 41)  # (a hole: nothing is read of it)
    os.mkfifo(tmp_path / "fifo")
    _legacy_lying(tmp_path)
    _imatrix_nan(tmp_path)
    args, said = CASES[case]
    before = _tree(set_dir)
    assert main(["quantize", str(set_dir), *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert _tree(set_dir) == before  # no variant folder, nothing of the set changed


def test_a_type_that_needs_an_imatrix_without_one_is_refused(tmp_path: Path, capsys) -> None:
    """At real widths IQ2_XXS applies (tiny's rows send it to IQ4_NL): without an imatrix, one line."""
    from conftest import convert

    from k3lab.kimi_k3.synth import synthesize

    synthesize("widths", tmp_path / "src", seed=0)
    assert convert(tmp_path / "src", tmp_path / "out") == 0
    before = _tree(tmp_path / "out")
    assert main(["quantize", str(tmp_path / "out"), "--type", "IQ2_XXS"]) == 2
    assert "IQ2_XXS needs an importance matrix" in capsys.readouterr().err
    assert _tree(tmp_path / "out") == before


def test_an_unfinished_set_is_refused_before_any_work(set_dir: Path, capsys) -> None:
    (set_dir / "Kimi-K3-MXFP4-00004-of-00009.gguf").unlink()
    assert main(["quantize", str(set_dir), "--type", "Q2_K"]) == 2
    assert "not a finished file of the set" in capsys.readouterr().err
    assert not (set_dir / "Q2_K").exists()
    assert (
        main(["quantize", str(set_dir), "--type", "Q2_K", "--files", "1-3", "--quiet"]) == 0
    )  # (its own files)


def test_a_lossless_file_changed_under_its_record_is_not_quantised(set_dir: Path, capsys) -> None:
    """A byte flipped in a tensor of file 5 after it was recorded (same size, its identity kept as if
    nothing happened): its bytes are hashed as they are read, and the variant's file 5 is not made."""
    path = set_dir / "Kimi-K3-MXFP4-00005-of-00009.gguf"
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    from k3lab.pipeline.state import OutputFolder

    folder = OutputFolder(set_dir)
    rec = folder.records.text(5)
    rec.identity = {**rec.identity, "ino": path.stat().st_ino}  # (as if this were the file written)
    folder.records.write(rec)
    assert main(["quantize", str(set_dir), "--type", "Q8_0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Kimi-K3-MXFP4-00005-of-00009.gguf: tensor" in err and "not the ones its record hashed" in err
    assert not (set_dir / "Q8_0" / "Kimi-K3-Q8_0-00005-of-00009.gguf").exists()
    assert not list((set_dir / "Q8_0").glob("*.partial"))


def test_a_killed_variant_run_resumes_to_the_same_bytes(set_dir: Path, tmp_path: Path) -> None:
    """SIGKILL part way through a variant run (four variants, files in flight); the same command
    again finishes it, byte for byte what one uninterrupted run makes."""
    types = "IQ2_XXS,Q4_K_M,IQ3_XXS,Q6_K"
    cmd = [sys.executable, "-m", "k3lab.cli", "quantize", str(set_dir), "--type", types,
           "--imatrix", str(IMATRIX), "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(set_dir.glob("*/Kimi-K3-*-00003-of-00009.gguf")):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert subprocess.run(cmd, timeout=300).returncode == 0
    clean = tmp_path / "clean"
    shutil.copytree(set_dir, clean, ignore=shutil.ignore_patterns(*types.split(",")))
    assert main(["quantize", str(clean), "--type", types, "--imatrix", str(IMATRIX), "--quiet"]) == 0
    for label in types.split(","):
        ours = {p.name: p.read_bytes() for p in (set_dir / label).glob("*.gguf")}
        assert ours == {p.name: p.read_bytes() for p in (clean / label).glob("*.gguf")}, label
        assert not list((set_dir / label).glob("*.partial"))
        assert main(["verify", str(set_dir / label), "--quiet"]) == 0


@pytest.mark.slow
def test_sigterm_of_a_variant_run_on_two_processes_leaves_no_partial_and_no_process(tmp_path: Path) -> None:
    """SIGTERM while two worker processes quantise (a worker's threads may outlast the grace and be
    killed): exit 143, no .partial left in any variant's folder, no process left; the rerun finishes."""
    import psutil
    from conftest import convert

    from k3lab.kimi_k3.synth import synthesize

    synthesize("widths", tmp_path / "src", seed=0)
    set_dir = tmp_path / "set"
    assert convert(tmp_path / "src", set_dir) == 0
    types = "IQ1_S,IQ2_XXS,IQ3_XXS,IQ2_XS"
    cmd = [sys.executable, "-m", "k3lab.cli", "quantize", str(set_dir), "--type", types, "--imatrix",
           str(WIDTHS_IMATRIX), "--jobs", "2", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(set_dir.glob("*/*.gguf.partial")):
        time.sleep(0.01)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    psutil.wait_procs(children, timeout=10)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not list(set_dir.rglob("*.partial"))
    assert subprocess.run(cmd, timeout=600).returncode == 0
    for label in types.split(","):
        assert main(["verify", str(set_dir / label), "--quiet"]) == 0


def test_a_variant_folder_that_is_a_link_is_refused(set_dir: Path, tmp_path: Path, capsys) -> None:
    """``OUT/LABEL`` a symlink to a folder elsewhere: one line, nothing written there (nor here)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (set_dir / "Q8_0").symlink_to(elsewhere)
    before = _tree(set_dir)
    assert main(["quantize", str(set_dir), "--type", "Q8_0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Q8_0: is a symlink" in err[0], err
    assert list(elsewhere.iterdir()) == [] and _tree(set_dir) == before


def test_a_variant_plan_edited_while_a_run_goes_on_is_not_obeyed(set_dir: Path, capsys) -> None:
    """The plan is saved once by the run; a task finding another one there (edited, its digests made
    to hold) makes nothing from it: the run fails for the files after the edit, in one line each."""
    from k3lab.pipeline.quantizing import quantize as quantize_mod
    from k3lab.pipeline.quantizing.variant import file_digest
    from k3lab.pipeline.state import OutputFolder

    real = quantize_mod.quantize_file
    seen: list[int] = []

    def then_edit(plan, number, *a, **k):
        result = real(plan, number, *a, **k)
        if not seen:
            vp = OutputFolder(set_dir).variant("Q8_0").variant_plan.load()
            f = vp.file(3)
            f.tensors = [t if i else dataclasses.replace(t, type="Q4_0") for i, t in enumerate(f.tensors)]
            f.digest = file_digest(vp, f)
            OutputFolder(set_dir).variant("Q8_0").variant_plan.save(vp)
        seen.append(number)
        return result

    quantize_mod.quantize_file = then_edit
    try:
        assert main(["quantize", str(set_dir), "--type", "Q8_0", "--quiet"]) == 2
    finally:
        quantize_mod.quantize_file = real
    assert seen == [1]
    err = capsys.readouterr().err
    assert "the variant's plan changed under this run" in err
    assert sorted(p.name for p in (set_dir / "Q8_0").glob("*.gguf")) == ["Kimi-K3-Q8_0-00001-of-00009.gguf"]


def test_a_set_converted_again_into_other_files_leaves_no_old_variant_file(
    tiny_src: Path, tmp_path: Path
) -> None:
    """A one-file set and its variant, then the set converted a layer per file into the same folder:
    the next ``quantize`` removes the variant's file of the other split with its record; the manifest
    lists the new files only."""
    from conftest import convert

    out = tmp_path / "out"
    assert convert(tiny_src, out, per_layer=False) == 0
    assert main(["quantize", str(out), "--type", "Q8_0", "--quiet"]) == 0
    (old,) = [p.name for p in (out / "Q8_0").glob("*.gguf")]
    assert convert(tiny_src, out) == 0
    assert main(["quantize", str(out), "--type", "Q8_0", "--quiet"]) == 0
    names = sorted(p.name for p in (out / "Q8_0").glob("*.gguf"))
    assert old not in names and len(names) == 9
    import json

    listed = [f["file"] for f in json.loads((out / "Q8_0" / "MANIFEST.json").read_text())["files"]]
    assert sorted(listed) == names
    assert main(["verify", str(out / "Q8_0"), "--src", str(out), "--quiet"]) == 0


@pytest.mark.parametrize("value, said", [(0x7F80, "holds a value that is not finite"), (0x714A, "overflow Q8_0's scales")],
                         ids=["an infinity", "1e30 (finite; its Q8_0 scale is not)"])  # fmt: skip
def test_a_value_a_type_cannot_hold_is_one_line_naming_file_and_tensor(
    tiny_src: Path, tmp_path: Path, value: int, said: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A BF16 weight of the set that is, or quantises to, an infinity: llama-quantize refuses it in
    ggml's lines ("found 1 infinities", "found inf value at block 0"); k3lab in one line of its own,
    naming the file and the tensor."""
    import json

    from conftest import convert
    from llama_tree import llama_quantize

    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    shard = sorted(src.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        start = header["language_model.model.layers.1.self_attn.q_proj.weight"]["data_offsets"][0]
        fh.seek(8 + n + start + 10)
        fh.write(struct.pack("<H", value))
    out = tmp_path / "out"
    assert convert(src, out) == 0
    first = sorted(out.glob("*.gguf"))[0]
    theirs = subprocess.run([str(llama_quantize()), "--keep-split", "--allow-requantize", str(first),
                             str(tmp_path / "ref.gguf"), "Q8_0"], capture_output=True, text=True, errors="replace", timeout=300)  # fmt: skip
    assert theirs.returncode != 0 and "blk.1.attn_q.weight" in theirs.stderr.splitlines()[-3], theirs.stderr[
        -500:
    ]
    assert "failed to quantize: " in theirs.stderr
    capfd.readouterr()
    assert main(["quantize", str(out), "--type", "Q8_0", "--quiet"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Kimi-K3-MXFP4-00002-of-00009.gguf: tensor blk.1.attn_q.weight:" in err[0], err
    assert said in err[0]
    assert not list((out / "Q8_0").glob("*-00002-of-00009.gguf*"))
