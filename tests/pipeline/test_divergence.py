"""A variant's KL from the lossless set as publishers report it: k3lab's figures (explore/divergence.py)
against llama.cpp's own `llama-perplexity --kl-divergence-base` then `--kl-divergence`, on the same text
and context: mean, median, 99th and 99.9th percentile KL, the top token's agreement."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from llama_support import needs_llama

from k3lab.cli import main

TEXT = ROOT / "tests" / "data" / "imatrix-calibration.txt"


def _perplexity(*args: str) -> str:
    from llama_tree import llama_perplexity

    done = subprocess.run([str(llama_perplexity()), "-t", "2", *args], capture_output=True, text=True,
                          errors="replace", timeout=900)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


@needs_llama
def test_k3labs_kl_is_llama_perplexitys_on_the_same_tokens(tiny_one: Path, tmp_path: Path) -> None:
    from k3lab.explore.divergence import kl_stats

    set_dir = tmp_path / "set"
    shutil.copytree(tiny_one, set_dir)
    assert main(["quantize", str(set_dir), "--type", "Q2_K", "--quiet"]) == 0
    base = next(set_dir.glob("*.gguf"))
    variant = next((set_dir / "Q2_K").glob("*.gguf"))
    n_ctx = 128
    kld = tmp_path / "base.kld"
    # (-b n_ctx: one sequence a batch, as k3lab evaluates a chunk; llama-perplexity would run 16 side by side)
    _perplexity(
        "-m", str(base), "-f", str(TEXT), "-c", str(n_ctx), "-b", str(n_ctx), "--kl-divergence-base", str(kld)
    )
    said = _perplexity("-m", str(variant), "-f", str(TEXT), "-c", str(n_ctx), "-b", str(n_ctx), "--kl-divergence-base", str(kld),
                       "--kl-divergence")  # fmt: skip

    def figure(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}:\s+([-0-9.]+)", said, re.M)
        assert m, (name, said[-3000:])
        return float(m[1])

    theirs = {"mean": figure("Mean    KLD"), "median": figure("Median  KLD"), "p99": figure("99.0%   KLD"),
              "p999": figure("99.9%   KLD"), "maximum": figure("Maximum KLD"),
              "same_top": figure("Same top p") / 100}  # fmt: skip
    ours = kl_stats(base, variant, "Q2_K", TEXT.read_text(), n_ctx)
    print(ours.line(), theirs, sep="\n")
    assert theirs["mean"] > 1e-3  # (a variant that moves something: the comparison means something)
    for key, value in theirs.items():
        assert getattr(ours, key) == pytest.approx(value, rel=2e-3, abs=2e-6), (
            key,
            getattr(ours, key),
            value,
        )

    # the same figures, measured by `quantize --kl-text` and kept in the variant's manifest (its card row)
    import json

    from k3lab.pipeline.quantizing.quality import measured_of

    assert main(["quantize", str(set_dir), "--type", "Q2_K", "--label", "q2-kl", "--kl-text", str(TEXT),
                 "--kl-context", str(n_ctx), "--quiet"]) == 0  # fmt: skip
    made_as = json.loads((set_dir / "q2-kl" / "MANIFEST.json").read_text())["made_as"]
    assert f"mean {theirs['mean']:.6f}" in made_as and f"same-top {100 * theirs['same_top']:.3f}%" in made_as
    assert measured_of(made_as) == f"{theirs['p999']:.6f} / {100 * theirs['same_top']:.3f}%"
    assert main(["verify", str(set_dir / "q2-kl"), "--quiet"]) == 0
    (tmp_path / "short.txt").write_text("Hello.")
    for text in (
        tmp_path / "none.txt",
        tmp_path / "short.txt",
    ):  # (no file; less than a chunk: before any work)
        assert main(["quantize", str(set_dir), "--type", "Q2_K", "--label", "bad", "--kl-text", str(text),
                     "--quiet"]) == 2 and not (set_dir / "bad").exists()  # fmt: skip
