"""The `fitproof` row: is `--fit` worth it where llama.cpp runs the model? On the published 0.40B's shape
(`synth --preset testmodel`: F32, one file; its imatrix by `k3lab imatrix` on tests/data's text), at the
size of llama.cpp's Q2_K and of k3lab's MoE-Q2_K recipe: each variant's and the fitted mix's KL from the
lossless set in llama.cpp (as `llama-perplexity --kl-divergence` defines it) over the positions of 3,000
characters of that text, and how often the top token stays the same."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import row  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def measured(tmp: Path) -> list[tuple[str, str, str]]:
    from k3lab.cli import main
    from k3lab.explore.variants import kl_divergence
    from k3lab.kimi_k3.synth import synthesize

    src, out = tmp / "src", tmp / "set"
    synthesize("testmodel", src, seed=0)
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]) == 0
    text = ROOT / "tests" / "data" / "imatrix-calibration.txt"
    assert (
        main(["imatrix", str(out), "--calibration", str(text), "-c", "128", "--chunks", "8", "--quiet"]) == 0
    )
    prompt = text.read_text()[:3000]
    base = next(out.glob("*.gguf"))
    rows = []
    for kind in ("Q2_K", "MoE-Q2_K"):
        assert main(["quantize", str(out), "--type", kind, "--quiet"]) == 0
        made = next((out / kind).glob("*.gguf"))
        label = f"fit-{kind}"
        assert (
            main(["quantize", str(out), "--fit", str(made.stat().st_size), "--label", label, "--quiet"]) == 0
        )
        fitted = next((out / label).glob("*.gguf"))
        for name, path in ((kind, made), (label, fitted)):
            d = kl_divergence(base, path, name, prompt=prompt)
            rows.append((f"0.40B {name}", f"{path.stat().st_size / 1e6:.1f} MB",
                         f"KL mean {d.mean:.4g}, median {d.median:.3g}, max {d.max:.4g} over {d.tokens} positions; "
                         f"same top token {100 * d.same_top:.1f}%"))  # fmt: skip
    return rows


@row
def bench_fitproof() -> list[tuple[str, str, str]]:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        return measured(Path(tmp))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for r in measured(Path(tmp)):
            print(*r, sep="  ")
