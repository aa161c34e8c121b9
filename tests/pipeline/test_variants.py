"""Quantised variants, judged by llama.cpp's own ``llama-quantize`` (the vendored tree's tool, built
against the libllama and libggml llama-cpp-python installed): k3lab's variant of a set, made file by
file, is the file set ``llama-quantize --keep-split --allow-requantize`` writes from the whole set,
byte for byte, for every ftype it offers, with an imatrix llama-imatrix made, on tiny (small widths:
many tensors fall back to another type) and on ``widths`` (Kimi-K3's row widths: the real mix)."""

from __future__ import annotations

import dataclasses
import filecmp
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, convert
from llama_support import needs_llama
from llama_tree import quantize_like_llama

from k3lab.cli import main
from k3lab.kimi_k3.synth import synthesize
from k3lab.pipeline.quantizing.llama_types import FTYPES

pytestmark = needs_llama
DATA = ROOT / "tests" / "data"
IMATRIX = {"tiny": DATA / "imatrix-tiny.gguf", "widths": DATA / "imatrix-widths.gguf"}
# the ftypes of a real-widths run in the default suite: every family once (all of them: slow)
FAMILIES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q6_K", "IQ2_XXS", "IQ1_M", "IQ3_XXS", "IQ4_XS", "MXFP4_MOE", "Q8_0")


@pytest.fixture(scope="module")
def widths_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``synth --preset widths`` converted a layer per file (read-only)."""
    src = tmp_path_factory.mktemp("widths") / "src"
    synthesize("widths", src, seed=0)
    out = tmp_path_factory.mktemp("widths-gguf")
    assert convert(src, out) == 0
    return out


def _copy(set_dir: Path, tmp: Path) -> Path:
    """A writable copy of a finished set (variants go into it)."""
    dst = tmp / "set"
    shutil.copytree(set_dir, dst)
    return dst


def _first(set_dir: Path) -> Path:
    files = sorted(set_dir.glob("*.gguf"))
    return files[0]


def _same(ours: Path, theirs: Path) -> list[str]:
    """The files that differ, by name (or what is missing on either side)."""
    mine, ref = sorted(p.name for p in ours.glob("*.gguf")), sorted(p.name for p in theirs.glob("*.gguf"))
    if mine != ref:
        return [f"names: {mine[:3]} vs {ref[:3]}"]
    return [n for n in mine if not filecmp.cmp(ours / n, theirs / n, shallow=False)]


def _judge(set_dir: Path, label: str, tmp: Path) -> Path:
    """llama-quantize over the whole set, run as the variant's plan writes its command out (flags,
    imatrix, type: a recipe's too), into a folder of its own."""
    from k3lab.pipeline.state import OutputFolder

    plan = OutputFolder(set_dir).variant(label).variant_plan.load()
    argv = shlex.split(plan.command(str(set_dir)))
    assert argv[0] == "llama-quantize" and argv[-3] == str(_first(set_dir)), argv
    ref = tmp / f"ref-{label}"
    ref.mkdir()
    keep = "--keep-split" in argv
    flags = [a for a in argv[1:-3] if a not in ("--keep-split", "--allow-requantize")]
    quantize_like_llama(Path(argv[-3]), ref / Path(argv[-2]).name, argv[-1], *flags, keep_split=keep)
    return ref


def _sweep(set_dir: Path, ftypes: tuple[str, ...], tmp: Path, imatrix: Path | None) -> None:
    """Every ftype made by k3lab in one run, then by llama-quantize one by one: the same files."""
    im = ["--imatrix", str(imatrix)] if imatrix else []
    assert main(["quantize", str(set_dir), "--type", ",".join(ftypes), *im, "--quiet"]) == 0
    differ = {f: d for f in ftypes if (d := _same(set_dir / f, _judge(set_dir, f, tmp)))}
    assert not differ, differ


def test_every_ftype_on_tiny_equals_llama_quantize(tiny_out: Path, tmp_path: Path) -> None:
    """All of llama-quantize's ftypes (the IQ types with tiny's imatrix), a split set of 9 files; but
    Q1_0, whose 128-value blocks fit none of tiny's 32-wide rows: both refuse it, naming the tensor."""
    set_dir = _copy(tiny_out, tmp_path)
    _sweep(set_dir, tuple(f for f in FTYPES if f != "Q1_0"), tmp_path, IMATRIX["tiny"])
    import subprocess

    from llama_tree import llama_quantize

    theirs = subprocess.run([str(llama_quantize()), "--keep-split", "--allow-requantize", str(_first(set_dir)),
                             str(tmp_path / "q1.gguf"), "Q1_0"], capture_output=True, text=True, errors="replace", timeout=300)  # fmt: skip
    assert (
        theirs.returncode
        and "no tensor type fallback is defined for type q1_0" in theirs.stderr + theirs.stdout
    )
    assert main(["quantize", str(set_dir), "--type", "Q1_0"]) == 2
    assert not (set_dir / "Q1_0").exists()


def test_every_family_at_real_widths_equals_llama_quantize(widths_out: Path, tmp_path: Path) -> None:
    """At Kimi-K3's row widths no K-quant falls back: the mix itself is judged (each family once)."""
    _sweep(_copy(widths_out, tmp_path), FAMILIES, tmp_path, IMATRIX["widths"])


@pytest.mark.slow
def test_every_ftype_at_real_widths_equals_llama_quantize(widths_out: Path, tmp_path: Path) -> None:
    _sweep(_copy(widths_out, tmp_path), tuple(FTYPES), tmp_path, IMATRIX["widths"])


def test_without_an_imatrix_the_mix_is_llama_quantizes(widths_out: Path, tmp_path: Path) -> None:
    """llama.cpp's mix differs with and without an imatrix (IQ3_XXS, IQ4_NL/XS, Q4_0): both judged."""
    _sweep(_copy(widths_out, tmp_path), ("IQ3_M", "IQ4_NL", "Q4_0", "Q3_K_S", "TQ1_0"), tmp_path, None)


def test_a_set_of_one_file_is_llama_quantize_without_keep_split(tiny_one: Path, tmp_path: Path) -> None:
    """One file: llama-quantize's by-layer order (its loader's), the set's name with the variant's label."""
    set_dir = _copy(tiny_one, tmp_path)
    _sweep(set_dir, ("Q2_K", "IQ2_XXS", "Q4_K_M"), tmp_path, IMATRIX["tiny"])
    assert (set_dir / "Q2_K" / "Kimi-K3-8x1.9M-Q2_K.gguf").is_file()


def test_recipes_and_overrides_are_the_command_they_print(widths_out: Path, tmp_path: Path) -> None:
    """A recipe (and a user's --tensor-type before it) is llama-quantize's flags: the command the
    variant's plan writes out, run as it is, makes the same bytes."""

    set_dir = _copy(widths_out, tmp_path)
    extra = ["--tensor-type", "BLK\\.3\\.ATTN_Q=q8_0", "--output-tensor-type", "q5_k"]
    assert main(["quantize", str(set_dir), "--type", "MoE-IQ2_XXS", "--imatrix", str(IMATRIX["widths"]),
                 *extra, "--quiet"]) == 0  # fmt: skip
    assert main(["quantize", str(set_dir), "--type", "MoE-Q2_K", "--quiet"]) == 0
    for label in ("MoE-IQ2_XXS", "MoE-Q2_K"):
        assert not _same(set_dir / label, _judge(set_dir, label, tmp_path)), label
    man = (set_dir / "MoE-IQ2_XXS" / "MANIFEST.json").read_text()
    assert "--tensor-type blk\\\\.3\\\\.attn_q=q8_0" in man  # (the reason each tensor has its type)


def test_a_tensor_type_file_is_llama_quantizes(widths_out: Path, tmp_path: Path, capsys) -> None:
    """--tensor-type-file: its entries (white space apart) taken where the flag stands among the
    --tensor-type ones, as llama-quantize takes them: the same bytes as llama-quantize given the
    same flags in the same order; an entry that is not PATTERN=TYPE is one line naming the file."""
    set_dir = _copy(widths_out, tmp_path)
    types = tmp_path / "types.txt"
    types.write_text("blk\\.2\\.ffn_up_exps=q8_0\n  ffn_down_exps=q4_k\tblk\\.1\\..*=q6_k\n")
    flags = [
        "--tensor-type",
        "blk\\.2\\..*=q5_k",
        "--tensor-type-file",
        str(types),
        "--tensor-type",
        "attn=q3_k",
    ]
    assert main(["quantize", str(set_dir), "--type", "Q2_K", *flags, "--quiet"]) == 0
    ref = tmp_path / "ref"
    ref.mkdir()
    quantize_like_llama(_first(set_dir), ref / "Kimi-K3-Q2_K.gguf", "Q2_K", *flags)
    assert not _same(set_dir / "Q2_K", ref)
    types.write_text("ffn_up_exps=q8_0 not-an-entry\n")
    capsys.readouterr()
    assert (
        main(["quantize", str(set_dir), "--type", "Q3_K_M", "--tensor-type-file", str(types), "--quiet"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--tensor-type-file {types}: entry 2" in err[0], err
    assert not (set_dir / "Q3_K_M").exists()


@pytest.mark.parametrize("flag", ["--include-weights", "--exclude-weights"])
def test_include_and_exclude_weights_are_llama_quantizes(
    flag: str, widths_out: Path, tmp_path: Path, capsys
) -> None:
    """--include-weights/--exclude-weights (repeatable: the imatrix's entries whose names hold NAME):
    llama-quantize's bytes and metadata (its entry count); both together refused in one line, as
    llama-quantize refuses them."""
    set_dir = _copy(widths_out, tmp_path)
    flags = ["--imatrix", str(IMATRIX["widths"]), flag, "ffn_", flag, "attn_q"]
    assert main(["quantize", str(set_dir), "--type", "Q2_K", *flags, "--quiet"]) == 0
    ref = tmp_path / "ref"
    ref.mkdir()
    quantize_like_llama(_first(set_dir), ref / "Kimi-K3-Q2_K.gguf", "Q2_K", *flags)
    assert not _same(set_dir / "Q2_K", ref)
    assert not _same(
        set_dir / "Q2_K", _judge(set_dir, "Q2_K", tmp_path)
    )  # (the command its manifest records)
    capsys.readouterr()
    both = ["--include-weights", "ffn_", "--exclude-weights", "attn"]
    assert (
        main(["quantize", str(set_dir), "--type", "Q3_K_M", "--imatrix", str(IMATRIX["widths"]), *both]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot go together" in err[0], err


def test_override_kv_is_llama_quantizes(widths_out: Path, tmp_path: Path, capsys) -> None:
    """--override-kv KEY=TYPE:VALUE (int written as its absolute value's u32, float as f32, bool, str;
    an existing key moved last, as ggml sets it): llama-quantize's bytes; a malformed one one line."""
    set_dir = _copy(widths_out, tmp_path)
    flags = ["--override-kv", "general.name=str:Custom K3", "--override-kv", "k3lab.note=int:-12abc",
             "--override-kv", "k3lab.scale=float:2.5e-1x", "--override-kv", "k3lab.flag=bool:true"]  # fmt: skip
    assert main(["quantize", str(set_dir), "--type", "Q3_K_M", *flags, "--quiet"]) == 0
    ref = tmp_path / "ref"
    ref.mkdir()
    quantize_like_llama(_first(set_dir), ref / "Kimi-K3-Q3_K_M.gguf", "Q3_K_M", *flags)
    assert not _same(set_dir / "Q3_K_M", ref)
    capsys.readouterr()
    for bad, said in (("k3lab.x=bool:yes", "true or false"), ("k3lab.x=list:1", "int, float, bool or str"),
                      ("=int:1", "a key of 1 to 127 bytes")):  # fmt: skip
        assert main(["quantize", str(set_dir), "--type", "Q2_K", "--override-kv", bad, "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def test_convert_with_variants_makes_the_same_files_on_two_processes(tiny_src: Path, tmp_path: Path) -> None:
    """``convert --variants`` makes file k's variants right after file k, on the worker that made it:
    the same bytes as quantising the finished set (``quantize``)."""
    out = tmp_path / "out"
    im = ["--imatrix", str(IMATRIX["tiny"])]
    assert convert(tiny_src, out, "--jobs", "2", "--variants", "IQ2_XXS,MoE-Q2_K", *im) == 0
    again = _copy(out, tmp_path)
    for label in ("IQ2_XXS", "MoE-Q2_K"):
        shutil.rmtree(again / label)
    assert main(["quantize", str(again), "--type", "IQ2_XXS,MoE-Q2_K", *im, "--quiet"]) == 0
    for label in ("IQ2_XXS", "MoE-Q2_K"):
        assert not _same(out / label, again / label)
        assert main(["verify", str(out / label), "--quiet"]) == 0


def test_llama_cpp_runs_every_variant_and_the_kl_divergence_is_printed(
    tiny_out: Path, tmp_path: Path
) -> None:
    """llama.cpp loads each variant's split set, generates, and its next-token distribution is close
    to the lossless set's (KL as llama-perplexity --kl-divergence defines it: printed); each quantised
    tensor's error, against gguf-py's dequantisation of both, grows as the bits shrink."""
    import llama_cpp

    from k3lab.explore.variants import kl_divergence, tensor_errors

    set_dir = _copy(tiny_out, tmp_path)
    labels = ("Q8_0", "Q4_K_M", "Q2_K", "IQ2_XXS", "MXFP4_MOE", "MoE-Q2_K")
    assert (
        main(
            [
                "quantize",
                str(set_dir),
                "--type",
                ",".join(labels),
                "--imatrix",
                str(IMATRIX["tiny"]),
                "--quiet",
            ]
        )
        == 0
    )
    base = _first(set_dir)
    kl = {}
    for label in labels:
        first = _first(set_dir / label)
        llm = llama_cpp.Llama(str(first), n_ctx=64, n_threads=2, verbose=False)
        llm.eval(llm.tokenize(b"The quick brown fox", add_bos=False))
        assert 0 <= llm.sample(top_k=1, temp=0.0) < llm.n_vocab()
        del llm
        kl[label] = kl_divergence(base, first, label)
        print(kl[label].line())
    assert kl["Q8_0"].mean < kl["Q4_K_M"].mean < kl["Q2_K"].mean
    assert 0 <= kl["Q8_0"].median < 1e-3 and kl["Q8_0"].same_top > 0.9
    errors = {label: tensor_errors(set_dir, label, r"ffn_down_exps") for label in ("Q8_0", "Q4_K_M", "Q2_K")}
    worst = {label: max(e.rel_rmse for e in es) for label, es in errors.items()}
    assert 0 < worst["Q8_0"] < worst["Q4_K_M"] < worst["Q2_K"] < 1, worst
    assert all(len(e.per_expert) == 8 for e in errors["Q2_K"])  # (tiny's 8 experts, each its own)


def test_verify_rederives_a_variant_from_its_set(tiny_out: Path, tmp_path: Path, capsys) -> None:
    """``verify OUT/LABEL --src OUT``: every quantised tensor quantised again by ggml from the lossless
    file. A variant edited consistently (its bytes and its record agree, so the byte check passes) is
    caught there, naming the tensor."""
    import hashlib

    from k3lab.pipeline.state import OutputFolder

    set_dir = _copy(tiny_out, tmp_path)
    assert main(["quantize", str(set_dir), "--type", "Q4_K_M", "--quiet"]) == 0
    assert main(["verify", str(set_dir / "Q4_K_M"), "--src", str(set_dir), "--quiet"]) == 0
    variant = OutputFolder(set_dir).variant("Q4_K_M")
    rec = variant.records.text(3)
    t = next(t for t in rec.tensors if t.transform == "quantize")
    path = variant.output(rec.file)
    raw = bytearray(path.read_bytes())
    raw[t.offset + 7] ^= 0x01
    path.write_bytes(bytes(raw))
    tensors = [dataclasses.replace(x, sha256=hashlib.sha256(raw[x.offset : x.end]).hexdigest()) if x is t else x
               for x in rec.tensors]  # fmt: skip
    rec.tensors, rec.identity = tensors, {}
    variant.records.write(rec)
    variant.records.merge()
    capsys.readouterr()
    assert main(["verify", str(set_dir / "Q4_K_M"), "--quiet"]) == 0  # (its bytes are its record's)
    assert main(["verify", str(set_dir / "Q4_K_M"), "--src", str(set_dir), "--quiet"]) == 1
    out = capsys.readouterr()
    assert f"tensor {t.name}: re-derived from Kimi-K3-MXFP4-00003-of-00009.gguf by ggml" in out.out + out.err


def test_a_checkpoint_of_moonshots_classes_saved_as_transformers_saves_it(tmp_path: Path) -> None:
    """Kimi-K3's row widths built by Moonshot's own classes (BF16, experts plain), saved as
    ``save_pretrained`` saves it (one model.safetensors, no index), converted to one file: its variants
    are llama-quantize's (without --keep-split: its loader's order), with widths' imatrix."""
    import moonshot

    from k3lab.kimi_k3.synth.presets import widths_config

    src = moonshot.save(moonshot.build(widths_config(), seed=3), tmp_path / "src", "one-file",
                        tokenizer_from=_widths_tokenizer(tmp_path))  # fmt: skip
    assert not (src / "model.safetensors.index.json").exists()
    assert convert(src, tmp_path / "set", per_layer=False) == 0
    _sweep(tmp_path / "set", ("Q2_K", "IQ2_XXS", "Q4_K_M", "MoE-IQ2_XXS"), tmp_path, IMATRIX["widths"])


def _widths_tokenizer(tmp: Path) -> Path:
    """A folder with the tokenizer files synth writes for ``widths`` (the classes make none)."""
    out = tmp / "tok"
    synthesize("widths", out, seed=0)
    return out


@pytest.mark.slow
def test_the_imatrix_fixtures_are_what_llama_imatrix_makes(
    tiny_out: Path, widths_out: Path, tmp_path: Path
) -> None:
    """tests/data's imatrix files are llama-imatrix's (the vendored tree's tool) on the tiny and widths
    sets with the calibration text beside them: made again, byte for byte."""
    import subprocess

    from llama_tree import llama_imatrix

    shutil.copy(DATA / "imatrix-calibration.txt", tmp_path / "calib.txt")
    for name, set_dir in (("tiny", tiny_out), ("widths", widths_out)):
        cmd = [str(llama_imatrix()), "-m", str(_first(set_dir)), "-f", "calib.txt", "-o", f"{name}.gguf", "-c", "64",
               "--chunks", "8", "-t", "2"]  # fmt: skip
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, timeout=600)
        assert (tmp_path / f"{name}.gguf").read_bytes() == IMATRIX[name].read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["testmodel", "layer"])
def test_the_0_40b_and_a_real_size_layer_equal_llama_quantize(preset: str, tmp_path: Path) -> None:
    """The published 0.40B's shape (float32, plain experts, one file) and a MoE layer at the real dims
    (16 experts, MXFP4): an imatrix made on each by llama-imatrix, then K-quants and IQ types, as
    llama-quantize makes them."""
    import subprocess

    from llama_tree import llama_imatrix

    synthesize(preset, tmp_path / "src", seed=0)
    set_dir = tmp_path / "set"
    assert convert(tmp_path / "src", set_dir, per_layer=preset == "layer") == 0
    shutil.copy(DATA / "imatrix-calibration.txt", tmp_path / "calib.txt")
    subprocess.run([str(llama_imatrix()), "-m", str(_first(set_dir)), "-f", "calib.txt", "-o", "im.gguf", "-c", "64",
                    "--chunks", "4", "-t", "2"], cwd=tmp_path, check=True, capture_output=True, timeout=1800)  # fmt: skip
    _sweep(set_dir, ("Q2_K", "IQ2_XXS", "Q4_K_M", "MoE-Q2_K"), tmp_path, tmp_path / "im.gguf")


def test_tensors_of_many_slabs_are_the_same_bytes(widths_out: Path, tmp_path: Path, monkeypatch) -> None:
    """Slabs of a few rows (every tensor in many: queued two at a time, each into a buffer of the ring
    while the writer still holds the pieces before it): the bytes are still llama-quantize's."""
    from k3lab.pipeline.quantizing import quantize

    monkeypatch.setattr(quantize, "SLAB_VALUES", 256 * 8)  # (8 rows of 256 a slab)
    set_dir = _copy(widths_out, tmp_path)
    _sweep(set_dir, ("Q2_K", "Q8_0"), tmp_path, None)


def test_a_label_holding_another_request_is_the_users_work(tiny_one: Path, tmp_path: Path, capsys) -> None:
    """quantize under a label that holds a variant made as another request (here: with an imatrix,
    then without): one line naming what differs, nothing replaced; --force replaces it."""
    import shutil

    from k3lab.cli import main

    out = tmp_path / "set"
    shutil.copytree(tiny_one, out)
    imatrix = str(Path(__file__).resolve().parents[1] / "data" / "imatrix-tiny.gguf")
    assert main(["quantize", str(out), "--type", "Q2_K", "--imatrix", imatrix, "--quiet"]) == 0
    made = {p.name: p.read_bytes() for p in (out / "Q2_K").glob("*.gguf")}
    capsys.readouterr()
    assert main(["quantize", str(out), "--type", "Q2_K", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "made as another request (imatrix: " in err[0] and "--force" in err[0], err
    assert {p.name: p.read_bytes() for p in (out / "Q2_K").glob("*.gguf")} == made
    assert main(["quantize", str(out), "--type", "Q2_K", "--quiet", "--force"]) == 0
    assert {p.name: p.read_bytes() for p in (out / "Q2_K").glob("*.gguf")} != made
