"""Proof by logits: the NumPy reference on the source agrees with llama.cpp on the GGUF, and a
single wrong transform in a copy of the converted set is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import convert
from llama_support import needs_llama

from k3lab.cli import main
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.reference import Reference, round_q8_0
from k3lab.kimi_k3.synth import synthesize
from k3lab.pipeline.sources.local import LocalSource

pytestmark = needs_llama


@pytest.fixture(scope="module")
def seed1(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("seed1")
    assert main(["synth", "--preset", "tiny", "--seed", "1", "--out", str(root / "src")]) == 0
    assert convert(root / "src", root / "out") == 0
    return root / "src", root / "out"


def _first(out: Path) -> Path:
    return sorted(out.glob("*-00001-of-*.gguf"))[0]


def _check(src: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["check-logits", "--meta", str(src), "--gguf", str(_first(out)), *extra])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("which", ["seed0", "seed1"])
def test_reference_and_llama_cpp_agree(
    which: str, tiny_src: Path, tiny_out: Path, seed1: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = (tiny_src, tiny_out) if which == "seed0" else seed1
    code, text = _check(src, out, capsys, "--blocks")
    lines = text.splitlines()
    end = next(i for i, ln in enumerate(lines) if ln.startswith("max NMSE"))
    rows = [line.split() for line in lines[1:end]]
    assert len(rows) >= 32  # a 32-token prompt or longer
    nmse = np.array([float(r[2]) for r in rows])
    assert code == 0, text
    # on the trained-like draw the whole model agrees too (information, not the verdict)
    assert nmse.max() <= 1e-4 and all(r[4] == r[5] for r in rows), text


def _patch(path: Path, name: str, edit) -> None:
    """Rewrite tensor `name` in place with edit(values as stored) -> new values of the same shape."""
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    start, n = int(t.data_offset), int(t.n_bytes)
    old = np.array(t.data)
    new = np.ascontiguousarray(edit(old)).view(np.uint8).reshape(-1)
    assert new.size == n
    del r
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(new.tobytes())


# checkpoints drawn four ways (synth --draw), each converted once: the verdict must not depend on it
DRAWS = {"trained": 0, "normal": 1, "fan-in": 2, "near-ties": 3}  # draw -> seed


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    out = {}
    for draw, seed in DRAWS.items():
        root = tmp_path_factory.mktemp(draw)
        synthesize("tiny", root / "src", seed=seed, draw=draw)
        assert convert(root / "src", root / "out") == 0
        out[draw] = (root / "src", root / "out")
    return out


def _tensor(path: Path, name: str) -> np.ndarray:
    r = gguf.GGUFReader(path)
    return np.array(next(t for t in r.tensors if t.name == name).data)


def _swap(path: Path, a: str, b: str) -> None:
    ta, tb = _tensor(path, a), _tensor(path, b)
    _patch(path, a, lambda _: tb)
    _patch(path, b, lambda _: ta)


def _experts_0_and_1_swapped(path: Path) -> None:
    """Stacking put expert 1 where expert 0 goes and back, in all three stacks alike."""
    for name in ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
        _patch(path, name, lambda a: a[[1, 0, *range(2, a.shape[0])]])


# name -> (output file, what is done to it, the first stage that must fail)
CORRUPTIONS = {
    "ssm_a without the minus": ("00002", lambda p: _patch(p, "blk.1.ssm_a", lambda a: -a), "kda_out-1"),
    # the bytes of [head, nope, kv_lora] under the declared [head, kv_lora, nope]
    "k_b not transposed": (
        "00004",
        lambda p: _patch(
            p,
            "blk.3.attn_k_b.weight",
            lambda a: a.view(np.uint16).reshape(4, 64, 32).transpose(0, 2, 1).copy(),
        ),
        "mla_out-3",
    ),
    "experts' gate and up swapped": (
        "00002",
        lambda p: _swap(p, "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"),
        "ffn_out-1",
    ),
    "two experts' order swapped in the stacks": ("00002", _experts_0_and_1_swapped, "ffn_out-1"),
    "res_score fused with a wrong factor": (
        "00003",
        lambda p: _patch(p, "blk.2.attn_res_score.weight", lambda a: 2 * a),
        "res_probs-2 (attention)",
    ),
    "conv1d kernel reversed": (
        "00002",
        lambda p: _patch(p, "blk.1.ssm_conv1d_q.weight", lambda a: a[..., ::-1].copy()),
        "kda_out-1",
    ),
}


def _verdict(src: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["check-logits", "--meta", str(src), "--gguf", str(_first(out))])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("draw", list(DRAWS))
def test_a_correct_conversion_passes_however_the_weights_were_drawn(
    draw: str, drawn: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _verdict(*drawn[draw], capsys)
    assert code == 0, text
    assert "58/58 stages agree" in text and text.rstrip().endswith(
        "check-logits OK: the verdict is the stage check"
    )


@pytest.mark.parametrize("draw", list(DRAWS))
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_every_wrong_transform_fails_and_is_named_on_every_draw(
    case: str,
    draw: str,
    drawn: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, good = drawn[draw]
    out = tmp_path / "set"
    shutil.copytree(good, out)
    number, corrupt, stage = CORRUPTIONS[case]
    corrupt(next(out.glob(f"*-{number}-of-*.gguf")))
    code, text = _verdict(src, out, capsys)
    assert code == 1, text
    assert f"first wrong: {stage}" in text, text
    assert text.rstrip().endswith("check-logits FAILED: the verdict is the stage check")


def test_the_default_prompt_fits_any_vocabulary(
    tiny_src: Path, tiny_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt that the vocabulary makes longer than the old fixed context (64) is sized after tokenizing."""
    prompt = " ".join(f"{i}x{i * 7919 % 1000}" for i in range(60))
    code = main(
        ["check-logits", "--meta", str(tiny_src), "--gguf", str(_first(tiny_out)), "--prompt", prompt]
    )
    text = capsys.readouterr().out
    n = int(text.split("whole model, for information: ")[1].split(" positions")[0])
    assert n > 64 and code == 0, text


def test_q8_0_rounding_matches_ggml_reference() -> None:
    """The reference's Q8_0 activation rounding, `ref` kernel, is ggml's quantize_row_q8_0_ref
    (gguf-py implements it); the SIMD kernels agree with it away from rounding boundaries."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 96)) * rng.uniform(0.1, 10, (64, 1))).astype(np.float32)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(round_q8_0(x, "ref"), want)
    for kernel in ("x86", "arm"):
        assert (round_q8_0(x, kernel) != want).mean() < 1e-3


def test_q8_0_kernels_round_ties_as_ggml_builds_do() -> None:
    """amax = 127 makes d = 1 exactly, so x = 2.5 and -0.5 are ties: roundf goes away from zero,
    the SIMD builds to even."""
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [127.0, 2.5, -0.5]
    assert round_q8_0(x, "ref")[0, :3].tolist() == [127.0, 3.0, -1.0]
    for kernel in ("x86", "arm"):
        assert round_q8_0(x, kernel)[0, :3].tolist() == [127.0, 2.0, -0.0]
    # amax = 190.14227: 1/(amax/127) is one ulp above 127/amax, and x = 2.2457747 lands on 1.5 by
    # the first multiplier (rounds to 2) and just below it by the second (rounds to 1)
    x[0, :3] = [190.14227, 2.245774745941162, 0.0]
    d = float(np.float16(np.float32(190.14227) / np.float32(127)))
    assert round_q8_0(x, "arm")[0, 1] == 2 * d and round_q8_0(x, "x86")[0, 1] == 1 * d
    with pytest.raises(ValueError, match="unknown Q8_0 kernel 'avx'"):
        round_q8_0(x, "avx")


def test_f32_mode_is_the_model_as_written(tiny_src: Path) -> None:
    ref_f32 = Reference(K3Config.load(tiny_src), LocalSource(tiny_src), mode="f32")
    ref_ggml = Reference(K3Config.load(tiny_src), LocalSource(tiny_src), mode="ggml")
    tokens = [5, 300, 1200, 77]
    a, b = ref_f32.logits(tokens), ref_ggml.logits(tokens)
    nmse = ((a - b) ** 2).sum(-1) / (a**2).sum(-1)
    assert 0 < nmse.max() < 1e-2  # rounding the activations moves the logits a little, no more


def test_every_block_agrees_given_llama_cpps_own_inputs(
    tiny_src: Path, tiny_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _check(tiny_src, tiny_out, capsys, "--blocks")
    assert code == 0, text
    assert "58/58 stages agree" in text
    rows = [
        ln for ln in text.splitlines() if ln.startswith(("res_probs", "ffn_moe_topk", "inp_embd", "result_"))
    ]
    assert (
        len(rows) == 1 + 15 + 1 + 7 + 2
    )  # embeddings, the mixes, the output mix, the routers, norm and head
