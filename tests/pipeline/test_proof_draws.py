"""Proof that holds on any checkpoint: ``check-logits --judge moonshot`` on checkpoints built by
Moonshot's own classes, drawn three ways (transformers' own init scale, where the KDA q/k and the MLA
latents are small and llama.cpp's epsilons show; the fan-in scale; and large q/k norms, where they
vanish), in the 0.40B's shape (float32) and Kimi-K3's (BF16, MXFP4 experts). A correct conversion
passes on every draw and the runtime's own differences are named with their figures; a broken one
(``ssm_a`` negated, rows of a projection swapped) fails at its stage on every draw. Generation is
decoded token by token and judged per position. And the judge is set up by one command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llama_support import needs_llama

from k3lab.cli import main
from k3lab.kimi_k3.generation import DECODE_THRESHOLD
from k3lab.kimi_k3.synth.presets import tiny_config, tiny_f32_config

pytestmark = needs_llama
DRAWS = [
    pytest.param(
        (shape, init), id=f"{shape}-{init}", marks=[pytest.mark.slow] if init != "transformers" else []
    )
    for shape in ("0.40b-f32", "k3-mxfp4")
    for init in ("transformers", "fan-in", "large")
]


@pytest.fixture(scope="module", params=DRAWS)
def drawn(request, tmp_path_factory: pytest.TempPathFactory, tiny_src: Path) -> tuple[Path, Path, str]:
    """(checkpoint, its converted set's file, init) for one draw."""
    moonshot = pytest.importorskip("moonshot")
    moonshot_text = pytest.importorskip("moonshot_text")
    shape, init = request.param
    raw = tiny_config() if shape == "k3-mxfp4" else tiny_f32_config()
    net = moonshot.build(raw, seed=11, dtype="bfloat16" if shape == "k3-mxfp4" else "float32", init=init)
    src = tmp_path_factory.mktemp(f"{shape}-{init}") / "src"
    if shape == "k3-mxfp4":
        moonshot_text.save_mxfp4(
            net, src, moonshot_text.mxfp4_experts(net, raw["text_config"]["quantization_config"])
        )
    else:
        moonshot.save(net, src, "one-file")
    for name in ("tiktoken.model", "tokenizer_config.json"):  # (the classes make no tokenizer)
        shutil.copy(tiny_src / name, src / name)
    out = src.parent / "out"
    extra = ["--outtype", "f32"] if shape == "0.40b-f32" else []
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet", *extra]) == 0
    (first,) = sorted(out.glob("*.gguf"))
    return src, first, init


def _check(src: Path, gguf: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(
        ["check-logits", "--meta", str(src), "--gguf", str(gguf), "--judge", "moonshot", "--generate", "8"]
    )
    return code, capsys.readouterr().out


def test_a_correct_conversion_passes_on_every_draw(drawn, capsys) -> None:
    src, gguf, init = drawn
    code, text = _check(src, gguf, capsys)
    assert code == 0, text[-4000:]
    judge = next(line for line in text.splitlines() if line.startswith("Moonshot's own forward"))
    assert float(re.search(r"worst ([0-9.e+-]+)", judge)[1]) < 1e-6, judge  # k3lab reads it as Moonshot does
    eps = next(line for line in text.splitlines() if line.startswith("  runtime: KDA q/k L2-norm epsilon"))
    assert "src/models/kimi-k3.cpp:455-457" in eps and "1e-6" in eps
    if init == "transformers":  # small q/k norms: the epsilon shows, named where it acts first
        moved = re.search(r"first moves (\S+) \(([0-9.e+-]+)\)", eps)
        assert moved and moved[1] in ("kda_out-0", "prefix_sum_attn-0") and float(moved[2]) > 1e-6, eps
    generation = next(line for line in text.splitlines() if line.startswith("generation:"))
    assert (
        "8 generated positions" in generation
        and float(re.search(r"median ([0-9.e+-]+)", generation)[1]) < DECODE_THRESHOLD
    )
    print(f"\n{init}: {judge}\n{eps}\n{generation}")


def _tensor(path: Path, name: str) -> tuple[int, tuple[int, ...], str]:
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return int(t.data_offset), tuple(int(x) for x in t.shape), t.tensor_type.name


def _broken(gguf: Path, tmp: Path, how: str) -> Path:
    """A copy of the set's file with ``blk.0.ssm_a`` negated, or two row blocks of ``blk.0.attn_q`` swapped."""
    bad = tmp / gguf.name
    shutil.copy(gguf, bad)
    raw = bytearray(bad.read_bytes())
    if how == "ssm_a":
        offset, shape, kind = _tensor(bad, "blk.0.ssm_a")
        n = int(np.prod(shape)) * 4
        raw[offset : offset + n] = (-np.frombuffer(bytes(raw[offset : offset + n]), np.float32)).tobytes()
    else:
        offset, shape, kind = _tensor(bad, "blk.0.attn_q.weight")
        row = shape[0] * {"F32": 4, "BF16": 2, "F16": 2}[kind]
        a, b = bytes(raw[offset : offset + 4 * row]), bytes(raw[offset + 4 * row : offset + 8 * row])
        raw[offset : offset + 4 * row], raw[offset + 4 * row : offset + 8 * row] = b, a
    bad.write_bytes(bytes(raw))
    return bad


@pytest.mark.parametrize("how", ["ssm_a", "rows"])
def test_a_broken_conversion_fails_at_its_stage_on_every_draw(
    drawn, how: str, tmp_path: Path, capsys
) -> None:
    src, gguf, _ = drawn
    code, text = _check(src, _broken(gguf, tmp_path, how), capsys)
    assert code == 1, text[-3000:]
    verdict = next(line for line in text.splitlines() if "stages agree" in line)
    assert re.search(r"first wrong: (kda_out-0|prefix_sum_attn-0)\b", verdict), verdict


def test_the_judge_is_set_up_by_one_command(tiny_src: Path, tiny_one: Path, tmp_path: Path) -> None:
    """From a judge cache of its own (nothing of Moonshot's there): check-logits --judge moonshot says
    the one command; that command, run as the message gives it, makes the judge work."""
    env = {**os.environ, "K3LAB_JUDGE_CACHE": str(tmp_path / "cache")}
    gguf = next(tiny_one.glob("*.gguf"))
    cmd = [sys.executable, "-m", "k3lab.cli", "check-logits", "--meta", str(tiny_src), "--gguf", str(gguf),
           "--judge", "moonshot", "--generate", "0"]  # fmt: skip
    before = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    said = before.stderr.strip().splitlines()
    assert before.returncode == 2 and len(said) == 1 and "run `k3lab setup-judge`" in said[0], said
    command = re.search(r"run `([^`]+)`", said[0])[1]
    setup = subprocess.run([sys.executable, "-m", "k3lab.cli", *command.split()[1:]], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    if setup.returncode and "pip download" in setup.stderr:
        pytest.skip(f"PyPI cannot be reached here: {setup.stderr.strip()[-200:]}")
    assert setup.returncode == 0, setup.stderr
    after = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert after.returncode == 0 and "Moonshot's own forward" in after.stdout, (
        after.stdout[-2000:] + after.stderr[-2000:]
    )
