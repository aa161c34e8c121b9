"""The `rerun` row: rerun"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.common import _full_checkpoint, _median, _run_timed, best_of, row


@row
def bench_rerun() -> list[tuple[str, str, str]]:
    """What a run with nothing to do costs at the real scale (`synth --preset full`; K3LAB_FULL=DIR
    reuses one), against its floor in the same run: starting k3lab at all (`k3lab --version`); and a
    plan of the real headers, with the tokenizer's merges in k3lab's cache and with an empty cache
    (a user's first plan)."""
    import os
    import shutil
    import tempfile

    from k3lab.formats.bpe_merges import bpe_merge_ranks
    from k3lab.kimi_k3.tokenizer import read_tiktoken

    with tempfile.TemporaryDirectory(dir=".") as tmp:
        src = _full_checkpoint(Path(tmp))
        out, cache = Path(tmp) / "out", Path(tmp) / "cache"
        k3 = [sys.executable, "-m", "k3lab.cli"]

        def plan() -> tuple[float, int, str]:  # (a new folder each time: a folder's plan is made once)
            planned = Path(tmp) / "planned"
            shutil.rmtree(planned, ignore_errors=True)
            cmd = [*k3, "plan", "--meta", str(src), "--out-dir", str(planned)]
            return _run_timed(cmd, env={**os.environ, "K3LAB_CACHE": str(cache)})

        cold = []
        for _ in range(3):  # an empty cache each time: the merges derived, then kept
            shutil.rmtree(cache, ignore_errors=True)
            cold.append(plan())
        warm = [plan() for _ in range(3)]
        ranked = read_tiktoken(src / "tiktoken.model")
        merges = best_of(lambda: bpe_merge_ranks(ranked), 3)
        _run_timed([*k3, "convert", "--meta", str(src), "--out-dir", str(out), "--files", "1", "--quiet"])
        reruns, floors = [], []
        for _ in range(5):  # paired: the rerun, then the floor
            reruns.append(
                _run_timed(
                    [*k3, "convert", "--meta", str(src), "--out-dir", str(out), "--files", "1", "--quiet"]
                )
            )
            floors.append(_run_timed([*k3, "--version"]))
        t_warm, t_cold = _median([p[0] for p in warm]), _median([p[0] for p in cold])
        t_rerun, t_floor = _median([r[0] for r in reruns]), _median([f[0] for f in floors])
        return [
            ("rerun: plan of the full headers, merges cached", f"{t_warm:.1f} s",
             f"peak RSS {max(p[1] for p in warm) / 2**20:.0f} MiB; `plan --out-dir`; median of 3 (goal: 10 s)"),
            ("rerun: plan of the full headers, empty cache", f"{t_cold:.1f} s",
             f"the merges derived ({merges:.1f} s of it, warm) and kept; median of 3 (goal: 45 s)"),
            ("rerun: convert --files 1, file 1 complete", f"{t_rerun:.2f} s",
             f"peak RSS {max(r[1] for r in reruns) / 2**20:.0f} MiB; floor `k3lab --version` {t_floor:.2f} s "
             f"({t_rerun / t_floor:.1f}x); medians of 5 paired (goal: 1 s, 200 MB)"),
        ]  # fmt: skip
