"""The `layouts` row: layouts"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import ROUNDS, _fresh, _median, _run_timed, row


@row
def bench_layouts() -> list[tuple[str, str, str]]:
    """Kimi-K3 as transformers' save_pretrained would write it (size shards of 5 GB: about 300 files, a
    layer across two to four of them) against Moonshot's layer per shard, both at the real headers
    (data as holes): the plan, one output file's task, and the disk a streaming worker needs."""
    import tempfile

    from k3lab.kimi_k3.synth import synthesize

    rows: list[tuple[str, str, str]] = []
    k3 = [sys.executable, "-m", "k3lab"]
    with tempfile.TemporaryDirectory(dir=".") as tmp_name:
        tmp = Path(tmp_name)
        layouts = {"moonshot": None, "by-size:5000000000": None}
        for lay in layouts:
            src = tmp / lay.replace(":", "-")
            made = synthesize("full", src, layout=lay)
            out = tmp / f"out-{lay.replace(':', '-')}"
            t_plan, rss_plan, _ = _run_timed([*k3, "plan", "--meta", str(src), "--out-dir", str(out)])
            _, _, table = _run_timed([*k3, "plan", "--meta", str(src)])
            disk = next(line for line in table.splitlines() if line.startswith("disk:"))
            plan = json.loads(_run_timed([*k3, "plan", "--meta", str(src), "--json"])[2])
            per_file = max(len(f["sources"]) for f in plan["files"])
            layouts[lay] = (src, out, made.n_shards)
            rows += [
                (
                    f"{lay}: {made.n_shards} source files -> {plan['n_files']} output files, plan",
                    f"{t_plan:.1f} s",
                    f"peak RSS {rss_plan / 2**20:.0f} MiB; up to {per_file} source files per output file",
                ),
                (
                    "  streaming from the Hub, per worker",
                    disk.split("streaming from the Hub adds up to ")[1].split(" of")[0],
                    "the files one tensor reads + one prefetched + one kept",
                ),
            ]
        # one MoE layer's output file (file 4: MLA, 896 experts), the same bytes from either layout
        times: dict[str, list[float]] = {lay: [] for lay in layouts}
        peaks: dict[str, int] = {}
        for _ in range(ROUNDS):
            for lay, (src, out, _) in layouts.items():
                _fresh(out)
                t, rss, _ = _run_timed(
                    [
                        *k3,
                        "convert",
                        "--meta",
                        str(src),
                        "--out-dir",
                        str(out),
                        "--quiet",
                        "--files",
                        "4",
                        "--force",
                    ]
                )
                times[lay].append(t)
                peaks[lay] = max(peaks.get(lay, 0), rss)
        a, b = times["by-size:5000000000"], times["moonshot"]
        rows += [
            (
                "  output file 4 (MoE + MLA, 16.6 GB): by-size vs moonshot (paired, medians)",
                f"{_median([x / y for x, y in zip(a, b)]):.2f}x",
                f"by-size {', '.join(f'{t:.1f}' for t in a)} s, moonshot {', '.join(f'{t:.1f}' for t in b)} s; goal: within 1.1x",
            ),
            (
                "  peak RSS of that task (whole command)",
                f"{peaks['by-size:5000000000'] / 2**20:.0f} MiB",
                f"moonshot {peaks['moonshot'] / 2**20:.0f} MiB; target <= 600 MiB",
            ),
        ]
        for _, out, _ in layouts.values():
            _fresh(out)
    return rows
