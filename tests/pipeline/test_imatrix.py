"""The importance matrix computed a layer at a time (``k3lab imatrix``), judged by llama.cpp's own
``llama-imatrix`` (the vendored tree's tool, on the same libraries) run on the same set, text and
options: every entry's sums and counts bit for bit (each layer's outputs are llama.cpp's, every input
row added in the order llama-imatrix adds it), the legacy ``.dat`` byte for byte; at the sizes llama.cpp cuts a batch into (slices of a chunk, a ubatch of fewer than 16 rows),
with ``--process-output``, ``--in-file`` and the legacy ``.dat``; variants made with it as good as
with llama-imatrix's; resumed after a kill to the same file; bad input one line, nothing written."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import ROOT, convert
from llama_support import needs_llama

from k3lab.cli import main
from k3lab.kimi_k3.synth import synthesize

pytestmark = needs_llama
TEXT = ROOT / "tests" / "data" / "imatrix-calibration.txt"


def _entries(path: Path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    r = gguf.GGUFReader(path)
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return {t.name: np.asarray(t.data).astype(np.float64) for t in r.tensors}, keys


def _judge(first: Path, tmp: Path, *flags: str, name: str = "ref.gguf") -> Path:
    """llama-imatrix on the set whose first file is ``first`` (run beside the text, as ``-f calib.txt``)."""
    from llama_tree import llama_imatrix

    shutil.copy(TEXT, tmp / "calib.txt")
    cmd = [str(llama_imatrix()), "-m", str(first), "-f", "calib.txt", "-o", name, "-t", "2", *flags]
    done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, errors="replace", timeout=900)
    assert done.returncode == 0, (flags, done.stderr[-2000:])
    return tmp / name


def _ours(set_dir: Path, tmp: Path, *flags: str, name: str = "ours.gguf") -> Path:
    shutil.copy(TEXT, tmp / "calib.txt")
    out = tmp / name
    assert (
        main(
            [
                "imatrix",
                str(set_dir),
                "--calibration",
                str(tmp / "calib.txt"),
                "--out",
                str(out),
                "--quiet",
                *flags,
            ]
        )
        == 0
    )
    return out


def _same(ours: Path, theirs: Path) -> None:
    """Every entry of llama-imatrix's, bit for bit (its sums and counts: the same additions in the same
    order), and its chunk keys."""
    mine, _ = _entries(ours)
    ref, ref_keys = _entries(theirs)
    assert sorted(mine) == sorted(ref)
    for name in ref:
        assert mine[name].tobytes() == ref[name].tobytes(), (
            name, float(np.abs(mine[name] - ref[name]).max() / max(np.abs(ref[name]).max(), 1e-30)),
        )  # fmt: skip
    _, keys = _entries(ours)
    for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
        assert keys[key] == ref_keys[key], key


def _first(set_dir: Path) -> Path:
    return sorted(set_dir.glob("*.gguf"))[0]


@pytest.fixture(scope="module")
def widths_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("widths-src")
    synthesize("widths", src, seed=0)
    out = tmp_path_factory.mktemp("widths-set")
    assert convert(src, out, per_layer=False) == 0
    return out


@pytest.mark.parametrize("which", ["split set", "one file"])
def test_the_imatrix_of_tiny_is_llama_imatrixs(
    which: str, tiny_out: Path, tiny_one: Path, tmp_path: Path
) -> None:
    set_dir = tmp_path / "set"
    shutil.copytree(tiny_out if which == "split set" else tiny_one, set_dir)
    flags = ("-c", "64", "--chunks", "8")
    _same(_ours(set_dir, tmp_path, *flags), _judge(_first(set_dir), tmp_path, *flags))
    _, keys = _entries(tmp_path / "ours.gguf")
    text_sha = __import__("hashlib").sha256(TEXT.read_bytes()).hexdigest()
    assert (
        keys["imatrix.datasets"] == [str(tmp_path / "calib.txt")]
        and keys["k3lab.calibration.sha256"] == text_sha
    )
    assert not list((set_dir / ".k3lab" / "imatrix").glob("*.f32"))  # (the state between steps is gone)


def test_without_calibration_it_is_llama_imatrix_on_k3labs_text_its_special_tokens_parsed(
    tiny_one: Path, tmp_path: Path
) -> None:
    """No --calibration: Kimi-K3's own text (its chats in the chat format, whose markers are special
    tokens: read as such, as llama-imatrix reads them with --parse-special); the text's SHA-256 kept."""
    from k3lab.kimi_k3.calibration_text import FILE

    set_dir = tmp_path / "set"
    shutil.copytree(tiny_one, set_dir)
    flags = (
        "-c",
        "128",
    )  # (all of it: its first chat comes after some 2,000 tokens)
    ours = tmp_path / "ours.gguf"
    assert main(["imatrix", str(set_dir), "--out", str(ours), "--quiet", *flags]) == 0
    shutil.copy(FILE, tmp_path / "calib.txt")
    cmd = [str(__import__("llama_tree").llama_imatrix()), "-m", str(_first(set_dir)), "-f", "calib.txt",
           "-o", "ref.gguf", "-t", "2", "--parse-special", *flags]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, errors="replace", timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    _same(ours, tmp_path / "ref.gguf")
    _, keys = _entries(ours)
    assert keys["k3lab.calibration.sha256"] == __import__("hashlib").sha256(FILE.read_bytes()).hexdigest()
    cmd = [c for c in cmd if c != "--parse-special"]
    cmd[cmd.index("ref.gguf")] = "plain.gguf"
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, errors="replace", timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(AssertionError):  # (the markers read as text give other sums)
        _same(ours, tmp_path / "plain.gguf")


def test_slices_of_a_chunk_and_the_output_matrix_are_llama_imatrixs(widths_set: Path, tmp_path: Path) -> None:
    """Chunks of 48 tokens, 12 in a batch: llama.cpp's ubatches take 42 tokens of each, then 6 (its
    attention kernel sees that many queries); --process-output sums output.weight's input too."""
    flags = ("-c", "48", "--chunks", "12", "--process-output")
    _same(_ours(widths_set, tmp_path, *flags), _judge(_first(widths_set), tmp_path, *flags))
    mine, _ = _entries(tmp_path / "ours.gguf")
    assert "output.weight.in_sum2" in mine


def test_a_ubatch_of_fewer_than_16_rows_is_not_summed_as_llama_imatrix_skips_it(
    tiny_one: Path, tmp_path: Path
) -> None:
    """A chunk of 1030 tokens alone in its batch: ubatches of 512, 512 and 6 tokens; llama-imatrix sums
    no dense product of the last (6 rows), the experts' it does."""
    flags = ("-c", "1030", "--chunks", "2")
    _same(_ours(tiny_one, tmp_path, *flags), _judge(_first(tiny_one), tmp_path, *flags))
    mine, _ = _entries(tmp_path / "ours.gguf")
    assert mine["blk.0.attn_q.weight.counts"][0] == 2 * (1030 - 6)


def test_in_file_and_the_legacy_format_are_llama_imatrixs(
    tiny_one: Path, tmp_path: Path, monkeypatch
) -> None:
    earlier = ROOT / "tests" / "data" / "imatrix-tiny.gguf"
    flags = ("-c", "64", "--chunks", "4")
    ours = _ours(tiny_one, tmp_path, *flags, "--in-file", str(earlier))
    theirs = _judge(_first(tiny_one), tmp_path, *flags, "--in-file", str(earlier))
    _same(ours, theirs)
    _, keys = _entries(ours)
    assert (
        keys["imatrix.chunk_count"] == 12 and len(keys["imatrix.datasets"]) == 2
    )  # (8 + 4 chunks; both texts)
    # the legacy file, the text named as llama-imatrix names it (as given: relative): byte for byte
    monkeypatch.chdir(tmp_path)
    dat = tmp_path / "ours.dat"
    args = ["imatrix", str(tiny_one), "--calibration", "calib.txt", "--out", str(dat), "--quiet"]
    assert main([*args, *flags, "--output-format", "dat"]) == 0
    ref_dat = _judge(_first(tiny_one), tmp_path, *flags, "--output-format", "dat", name="ref.dat")
    assert dat.read_bytes() == ref_dat.read_bytes() and dat.read_bytes().endswith(b"calib.txt")


def test_a_variant_made_with_it_is_the_one_made_with_llama_imatrixs(widths_set: Path, tmp_path: Path) -> None:
    """IQ2_XXS at Kimi-K3's row widths needs an imatrix: made with each, every tensor the same bytes;
    the KL divergence from the lossless set (llama.cpp's logits, as llama-perplexity --kl-divergence
    defines it) printed."""
    from k3lab.explore.variants import kl_divergence

    set_dir = tmp_path / "set"
    shutil.copytree(widths_set, set_dir)
    flags = ("-c", "64", "--chunks", "8")
    ours, theirs = _ours(set_dir, tmp_path, *flags), _judge(_first(set_dir), tmp_path, *flags)
    for label, im in (("ours", ours), ("theirs", theirs)):
        assert (
            main(
                [
                    "quantize",
                    str(set_dir),
                    "--type",
                    "IQ2_XXS",
                    "--label",
                    label,
                    "--imatrix",
                    str(im),
                    "--quiet",
                ]
            )
            == 0
        )
    kl = {
        label: kl_divergence(_first(set_dir), _first(set_dir / label), label) for label in ("ours", "theirs")
    }
    for k in kl.values():
        print(k.line())
    for mine, ref in zip(
        sorted((set_dir / "ours").glob("*.gguf")), sorted((set_dir / "theirs").glob("*.gguf"))
    ):
        a, b = gguf.GGUFReader(mine), gguf.GGUFReader(ref)
        assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
        for x, y in zip(a.tensors, b.tensors):
            assert x.tensor_type == y.tensor_type and bytes(x.data) == bytes(y.data), (mine.name, x.name)
    assert kl["ours"].mean == kl["theirs"].mean


def test_a_killed_imatrix_run_resumes_to_the_same_file(widths_set: Path, tmp_path: Path) -> None:
    """SIGKILL once a few steps are recorded (each step slowed, so that the kill lands between them);
    the same command again computes only the steps left and writes the file one run writes."""
    set_dir = tmp_path / "set"
    shutil.copytree(widths_set, set_dir)
    shutil.copy(TEXT, tmp_path / "calib.txt")
    args = [
        "imatrix",
        str(set_dir),
        "--calibration",
        str(tmp_path / "calib.txt"),
        "-c",
        "64",
        "--chunks",
        "8",
        "--quiet",
    ]
    code = (
        "import sys, time\n"
        "from k3lab.pipeline.calibrating import step\n"
        "real = step.StepRun.__init__\n"
        "step.StepRun.__init__ = lambda *a, **k: (time.sleep(0.4), real(*a, **k))[1]\n"
        "from k3lab.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)
    state = set_dir / ".k3lab" / "imatrix"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (state / "step-003.json").exists():
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (state / "step-003.json").exists() and not (set_dir / "imatrix.gguf").exists()
    done = subprocess.run(
        [sys.executable, "-m", "k3lab.cli", *args[:-1]], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "already done" in done.stdout and "0 already done" not in done.stdout, done.stdout
    clean = tmp_path / "clean"
    shutil.copytree(widths_set, clean)
    assert main(["imatrix", str(clean), *args[2:]]) == 0
    assert (set_dir / "imatrix.gguf").read_bytes() == (clean / "imatrix.gguf").read_bytes()
    assert not list(state.glob("*.partial")) and not list(state.glob("*.f32"))


def _tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))}


BAD = {
    "an empty text": (b"", [], "empty"),
    "a binary text": (b"\x00\x01\x02 some bytes", [], "NUL bytes: a binary file"),
    "text that is not UTF-8": (b"caf\xe9 \xff\xfe", [], "not UTF-8 text"),
    "a text shorter than two chunks": (b"one short sentence.\n", [], "fewer than two chunks of 512"),
    "chunks larger than the context": (None, ["-c", "5000"], "chunks of 1 to 4096 tokens"),
    # (llama-imatrix refuses it too: "n_seq_max must be <= 256")
    "chunks so small that llama.cpp refuses the batch": (None, ["-c", "7"], "llama.cpp takes at most 256"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_calibration_input_is_one_line_and_writes_nothing(
    case: str, tiny_one: Path, tmp_path: Path, capsys
) -> None:
    set_dir = tmp_path / "set"
    shutil.copytree(tiny_one, set_dir)
    data, flags, said = BAD[case]
    text = tmp_path / "text.txt"
    text.write_bytes(TEXT.read_bytes() if data is None else data)
    before = _tree(set_dir)
    assert main(["imatrix", str(set_dir), "--calibration", str(text), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert _tree(set_dir) == before  # no state, no imatrix


def test_a_set_not_finished_and_a_hub_text_that_does_not_exist_are_one_line(
    tiny_out: Path, tmp_path: Path, capsys
) -> None:
    set_dir = tmp_path / "set"
    shutil.copytree(tiny_out, set_dir)
    (set_dir / "Kimi-K3-MXFP4-00004-of-00009.gguf").unlink()
    before = _tree(set_dir)
    assert main(["imatrix", str(set_dir), "--calibration", str(TEXT)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a finished file of the set" in err[0], err
    assert _tree(set_dir) == before
    from hub_server import HubServer

    shutil.copytree(tiny_out, tmp_path / "whole")
    from conftest import run_cli

    with HubServer(tmp_path / "whole") as hub:  # (a process of its own: the Hub it is told of)
        done = run_cli(hub.client_env(tmp_path), "imatrix", str(tmp_path / "whole"), "--calibration",
                       "nobody/nothing:text.txt")  # fmt: skip
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "nobody/nothing" in err[0], err


def test_one_ggml_in_the_process_and_nothing_said_of_its_repacking(tiny_one: Path, tmp_path: Path) -> None:
    """llama-cpp-python's wheel holds each library under three names, as copies: k3lab loads the one
    llama.cpp's own libraries link (one ggml, one logger), and ggml's line per repacked weight is not
    printed (a run says only its steps)."""
    set_dir = tmp_path / "set"
    shutil.copytree(tiny_one, set_dir)
    shutil.copy(TEXT, tmp_path / "calib.txt")
    script = (
        "import os, sys, llama_cpp\n"
        "from k3lab.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "maps = {l.split()[-1] for l in open(f'/proc/{os.getpid()}/maps') if 'libggml-base' in l}\n"
        "print(__import__('json').dumps(sorted(maps)))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "imatrix", str(set_dir), "--calibration", str(tmp_path / "calib.txt"),
         "-c", "64", "--chunks", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(__import__("json").loads(done.stdout.strip().splitlines()[-1])) == 1, done.stdout
    assert "repack" not in done.stderr and all(
        line.startswith("k3lab: ") for line in done.stderr.splitlines()
    ), done.stderr


def test_convert_imatrix_from_goes_from_the_checkpoint_to_the_iq_variants(
    tiny_src: Path, tiny_one: Path, tmp_path: Path, capsys
) -> None:
    """One command from Moonshot's layout to IQ2_XXS: the set, its imatrix (recorded with it), the
    variant made with it, byte for byte what `imatrix` then `quantize --imatrix` make; its manifest
    names the calibration text's SHA-256. Flags that cannot go together: one line, nothing written."""
    import hashlib
    import json

    shutil.copy(TEXT, tmp_path / "calib.txt")
    out = tmp_path / "out"
    flags = ["--variants", "IQ2_XXS", "--imatrix-from", str(tmp_path / "calib.txt")]
    assert convert(tiny_src, out, *flags, per_layer=False) == 0
    kinds = [f["kind"] for f in json.loads((out / "MANIFEST.json").read_text())["files"]]
    assert kinds == ["text", "imatrix"]
    made_as = json.loads((out / "IQ2_XXS" / "MANIFEST.json").read_text())["made_as"]
    assert hashlib.sha256(TEXT.read_bytes()).hexdigest() in made_as.splitlines()[1]
    apart = tmp_path / "apart"
    shutil.copytree(tiny_one, apart)
    assert main(["imatrix", str(apart), "--calibration", str(tmp_path / "calib.txt"), "--quiet"]) == 0
    assert (apart / "imatrix.gguf").read_bytes() == (out / "imatrix.gguf").read_bytes()
    assert (
        main(
            ["quantize", str(apart), "--type", "IQ2_XXS", "--imatrix", str(apart / "imatrix.gguf"), "--quiet"]
        )
        == 0
    )
    for mine in (out / "IQ2_XXS").glob("*.gguf"):
        a, b = gguf.GGUFReader(mine), gguf.GGUFReader(apart / "IQ2_XXS" / mine.name)
        assert [bytes(t.data) for t in a.tensors] == [bytes(t.data) for t in b.tensors]
    capsys.readouterr()
    for extra, said in (
        (["--imatrix-from", "x.txt"], "name them (--variants"),
        (["--variants", "IQ2_XXS", "--imatrix-from", "x.txt", "--imatrix", "y.gguf"], "give one"),
        (["--variants", "IQ2_XXS", "--imatrix-from", "x.txt", "--push-to", "a/b"], "needs --keep-local"),
    ):
        bad = tmp_path / "bad"
        assert main(["convert", "--meta", str(tiny_src), "--out-dir", str(bad), "--quiet", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
        assert not bad.exists()


@pytest.mark.parametrize("name", ["imatrix-tiny.gguf", "imatrix-widths.gguf"])
def test_show_statistics_prints_llama_imatrixs_figures(name: str, tiny_one: Path, capsys) -> None:
    """Every row of `llama-imatrix --show-statistics` (per tensor and per layer), character for
    character; the experts never reached named, and what llama-quantize does with them."""
    import re

    from llama_tree import llama_imatrix

    path = ROOT / "tests" / "data" / name
    assert main(["imatrix", "--show-statistics", "--in-file", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = re.compile(r"^\s*(\d+|-)\t")
    ours = [line for line in out if rows.match(line)]
    for _ in range(
        10
    ):  # (llama.cpp's logger writes from a thread of its own and may drop its last lines at exit)
        done = subprocess.run(
            [str(llama_imatrix()), "-m", str(_first(tiny_one)), "--in-file", str(path), "--show-statistics"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        lines = (re.sub(r"^\d+\.\d+\.\d+\.\d+ [IWE] ", "", x) for x in done.stderr.splitlines())
        theirs = [line for line in lines if rows.match(line)]
        if len(theirs) >= len(ours):
            break
    assert ours == theirs
    from k3lab.imatrix import statistics

    cov = statistics(path).coverage
    got, total = cov.reached()
    assert f"{got} of {total} experts reached by the calibration text" in "\n".join(out) and got < total
    for stack, experts in list(cov.unreached.items())[:20]:  # (the first 20 stacks named, then a count)
        assert any(line.startswith(f"  {stack}: experts {experts[0]}") for line in out), stack
    assert "importance 1.0" in out[-1]


@pytest.fixture(scope="module")
def moonshot_set(tmp_path_factory: pytest.TempPathFactory, tiny_src: Path) -> Path:
    """A set converted from a checkpoint Moonshot's own classes made (llmcompressor's wheel), MXFP4
    experts, drawn as transformers initialises: its router spreads tokens over the experts, where
    synth's trained-looking router favours a few."""
    moonshot = pytest.importorskip("moonshot")
    moonshot_text = pytest.importorskip("moonshot_text")
    from k3lab.kimi_k3.synth.presets import tiny_config

    raw = tiny_config()
    net = moonshot.build(raw, seed=5, dtype="bfloat16", init="transformers")
    src = tmp_path_factory.mktemp("moonshot-drawn") / "src"
    moonshot_text.save_mxfp4(
        net, src, moonshot_text.mxfp4_experts(net, raw["text_config"]["quantization_config"])
    )
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(tiny_src / name, src / name)
    out = src.parent / "out"
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]) == 0
    return out


def test_a_checkpoint_drawn_by_moonshots_classes_and_until_covered(
    moonshot_set: Path, tmp_path: Path
) -> None:
    """On a set drawn another way, llama-imatrix's bits too; --until-covered doubles the chunks until
    every expert is reached, and gives llama-imatrix's file of that many chunks."""
    set_dir = tmp_path / "set"
    shutil.copytree(moonshot_set, set_dir)
    flags = ("-c", "64", "--chunks", "6")
    _same(_ours(set_dir, tmp_path, *flags), _judge(_first(set_dir), tmp_path, *flags))
    from k3lab.imatrix import statistics

    shutil.copy(TEXT, tmp_path / "calib.txt")
    few = ["imatrix", str(set_dir), "--calibration", str(tmp_path / "calib.txt"), "-c", "8", "--quiet"]
    assert main([*few, "--chunks", "1", "--out", str(tmp_path / "one.gguf")]) == 0
    got, total = statistics(tmp_path / "one.gguf").coverage.reached()
    assert got < total  # (one chunk of 8 tokens cannot reach them all)
    assert main([*few, "--chunks", "1", "--until-covered", "--out", str(tmp_path / "covered.gguf")]) == 0
    covered = statistics(tmp_path / "covered.gguf")
    assert covered.coverage.reached() == (total, total)
    _, keys = _entries(tmp_path / "covered.gguf")
    n = keys["imatrix.chunk_count"]
    assert n & (n - 1) == 0 and n > 1  # (a power of two: 1, 2, 4 ... chunks tried)
    _same(
        tmp_path / "covered.gguf",
        _judge(_first(set_dir), tmp_path, "-c", "8", "--chunks", str(n), name="c.gguf"),
    )


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["testmodel", "layer"])
def test_the_040b_shape_and_a_real_width_layer_set_are_llama_imatrixs(
    preset: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The published 0.40B's shape (F32, one file) and a MoE layer at Kimi-K3's expert widths (MXFP4,
    16 experts, top-8): every entry llama-imatrix's, bit for bit, chunks of 512 and --process-output."""
    src = tmp_path_factory.mktemp(f"{preset}-src")
    synthesize(preset, src)
    out = tmp_path_factory.mktemp(f"{preset}-set")
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]) == 0
    tmp = tmp_path_factory.mktemp(f"{preset}-run")
    flags = ("-c", "512", "--chunks", "4", "--process-output")
    _same(_ours(out, tmp, *flags), _judge(_first(out), tmp, *flags))


def test_a_state_file_edited_between_runs_is_not_taken(widths_set: Path, tmp_path: Path, monkeypatch) -> None:
    """A run stopped after a few steps; then an array of its state has bytes changed (its size kept)
    and a step's record is cut short: the next run proves neither, makes them again, and writes the
    file a clean run writes."""
    from k3lab.pipeline.calibrating import run

    set_dir = tmp_path / "set"
    shutil.copytree(widths_set, set_dir)
    shutil.copy(TEXT, tmp_path / "calib.txt")
    args = ["imatrix", str(set_dir), "--calibration", str(tmp_path / "calib.txt"), "-c", "64", "--chunks", "6",
            "--quiet"]  # fmt: skip
    real, calls = run._retire, []

    def stop_after_three(*a: object) -> None:
        real(*a)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(run, "_retire", stop_after_three)
    assert main(args) != 0
    monkeypatch.setattr(run, "_retire", real)
    state = set_dir / ".k3lab" / "imatrix"
    arrays = sorted(state.glob("x.*.f32"))
    assert arrays and (state / "step-002.json").exists()
    data = bytearray(arrays[-1].read_bytes())
    data[len(data) // 2] ^= 0x55
    arrays[-1].write_bytes(bytes(data))  # (same size, other bytes, a new identity)
    record = (state / "step-001.json").read_bytes()
    (state / "step-001.json").write_bytes(record[: len(record) // 2])
    assert main(args) == 0
    clean = tmp_path / "clean"
    shutil.copytree(widths_set, clean)
    assert main(["imatrix", str(clean), *args[2:]]) == 0
    assert (set_dir / "imatrix.gguf").read_bytes() == (clean / "imatrix.gguf").read_bytes()
