"""The `notebooks` row: on `synth --preset full`: notebook 01's shard picker (slowest change), notebook 02
run headless by papermill (wall time, peak RSS)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.common import NOTEBOOK_01_PICKER, _run_timed, row


@row
def bench_notebooks() -> list[tuple[str, str, str]]:
    """The notebooks at the real model's scale (`synth --preset full`; K3LAB_FULL=DIR reuses one)."""
    import subprocess
    import tempfile

    from k3lab.kimi_k3.synth import synthesize

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        src = Path(os.environ.get("K3LAB_FULL") or Path(tmp) / "full")
        if not (src / "config.json").exists():
            synthesize("full", src)
        r = subprocess.run(
            [sys.executable, "-c", NOTEBOOK_01_PICKER, str(src), str(Path(tmp) / "out")],
            check=True,
            capture_output=True,
            text=True,
        )
        setup, pick = map(float, r.stdout.split())
        t, rss, _ = _run_timed(
            [
                sys.executable,
                "-m",
                "papermill",
                str(root / "notebooks" / "02-mxfp4-scales.ipynb"),
                str(Path(tmp) / "02.ipynb"),
                "-p",
                "src",
                str(src),
                "--no-progress-bar",
            ]
        )
    return [
        (
            "notebook 01 on the full model: shard picker, slowest change",
            f"{pick:.2f} s",
            f"after {setup:.1f} s once (plan, index); target <= 1 s",
        ),
        (
            "notebook 02 on the full model, headless (papermill)",
            f"{t:.0f} s",
            f"peak RSS {rss / 2**20:.0f} MiB (kernel included); target <= 2 min, 1 GB",
        ),
    ]
