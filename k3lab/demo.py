"""`k3lab demo`: the main job, end to end, on the built-in tiny synthetic model."""

from __future__ import annotations

import time
from pathlib import Path

from .synth import synthesize
from .synth.report import describe


def run_demo(workdir: str | Path, seed: int = 0, jobs: int = 2) -> int:
    workdir = Path(workdir)
    t0 = time.perf_counter()
    src = workdir / "src"
    result = synthesize("tiny", src, seed=seed)
    print(describe(result))
    print(f"demo finished in {time.perf_counter() - t0:.1f} s")
    return 0
