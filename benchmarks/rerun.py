"""The `rerun` row: rerun"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.common import _full_checkpoint, _median, _run_timed, best_of, row


@row
def bench_rerun() -> list[tuple[str, str, str]]:
    """What a run with nothing to do costs at the real scale (`synth --preset full`; K3LAB_FULL=DIR
    reuses one), against its floor in the same run: starting k3lab at all (`k3lab --version`); and a
    plan of the real headers (the tokenizer's merges derived in it, as every plan derives them)."""
    import shutil
    import tempfile

    from k3lab.formats.bpe_merges import bpe_merge_ranks
    from k3lab.kimi_k3.tokenizer import read_tiktoken

    with tempfile.TemporaryDirectory(dir=".") as tmp:
        src = _full_checkpoint(Path(tmp))
        out = Path(tmp) / "out"
        k3 = [sys.executable, "-m", "k3lab"]

        def plan() -> tuple[float, int, str]:  # (a new folder each time: a folder's plan is made once)
            planned = Path(tmp) / "planned"
            shutil.rmtree(planned, ignore_errors=True)
            return _run_timed([*k3, "plan", "--meta", str(src), "--out-dir", str(planned)])

        plans = [plan() for _ in range(3)]
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
        t_plan = _median([p[0] for p in plans])
        t_rerun, t_floor = _median([r[0] for r in reruns]), _median([f[0] for f in floors])
        return [
            ("rerun: plan of the full headers", f"{t_plan:.1f} s",
             f"peak RSS {max(p[1] for p in plans) / 2**20:.0f} MiB; `plan --out-dir`; the merges derived "
             f"({merges:.2f} s of it, warm); median of 3 (goal: 10 s)"),
            ("rerun: convert --files 1, file 1 complete", f"{t_rerun:.2f} s",
             f"peak RSS {max(r[1] for r in reruns) / 2**20:.0f} MiB; floor `k3lab --version` {t_floor:.2f} s "
             f"({t_rerun / t_floor:.1f}x); medians of 5 paired (goal: 1 s, 200 MB)"),
        ]  # fmt: skip
