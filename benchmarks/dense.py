"""The `dense` row: one real-size MoE shard with real bytes (a `full` checkpoint's shard 2, its data filled
with random bytes: 17 GB), each run from an empty page cache (as root: drop_caches; said when not):
convert it, against a `dd iflag=direct oflag=direct` copy of the same file (one request at a time:
a read, then a write) and against two `dd`s at once, one reading the shard and one writing as many
bytes (what a disk gives a converter that reads and writes together: the floor of any that moves
every byte), in rounds that take turns going first; the disk's busy share and the CPU of k3lab's run beside them"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.common import ROUNDS, _fresh, _full_checkpoint, _median, fill_dense, row, timed_on_disk


@row
def bench_dense() -> list[tuple[str, str, str]]:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="k3lab-bench-", dir=".") as tmp_name:
        tmp = Path(tmp_name)
        full = _full_checkpoint(tmp)
        shard = min(p.name for p in full.glob("model-00002-of-*.safetensors"))  # (layer 1's, Moonshot's name)
        dense = fill_dense(full, shard, Path(os.environ.get("K3LAB_DENSE") or tmp / "dense"))
        out = tmp / "out"
        k3 = [sys.executable, "-m", "k3lab"]
        subprocess.run(
            [*k3, "plan", "--meta", str(dense), "--out-dir", str(out)], check=True, capture_output=True
        )
        size = (dense / shard).stat().st_size
        direct = ["bs=64M", "status=none"]
        convert = [*k3, "convert", "--meta", str(dense), "--out-dir", str(out), "--shards", "2", "--quiet"]
        copy = [
            "dd",
            f"if={dense / shard}",
            f"of={out / 'dd.out'}",
            "iflag=direct",
            "oflag=direct",
            "conv=fsync",
            *direct,
        ]
        both = [
            ["dd", f"if={dense / shard}", "of=/dev/null", "iflag=direct", *direct],
            ["dd", "if=/dev/zero", f"of={out / 'dd.out'}", f"count={size >> 26}", "oflag=direct", "conv=fsync", *direct],
        ]  # fmt: skip
        runs: dict[str, list] = {"k3lab": [], "dd": [], "both": []}
        order = [("k3lab", [convert]), ("dd", [copy]), ("both", both)]
        for r in range(ROUNDS):
            # each round in another order: on this disk a run right after another heavy one can be
            # the slower (which one goes first must not decide a ratio)
            for key, cmds in order[r % 3 :] + order[: r % 3]:
                _fresh(out)
                runs[key].append(timed_on_disk(cmds, out))
                (out / "dd.out").unlink(missing_ok=True)
    seconds = {k: [r.seconds for r in v] for k, v in runs.items()}
    ratio = _median([a / b for a, b in zip(seconds["k3lab"], seconds["dd"])])
    floor = _median([a / b for a, b in zip(seconds["k3lab"], seconds["both"])])
    dd_s, both_s = _median(seconds["dd"]), _median(seconds["both"])
    k3 = runs["k3lab"]
    cpu = _median([r.cpu for r in k3])
    return [
        (
            f"dense: one MoE shard of real bytes ({size / 1e9:.1f} GB), cold cache",
            f"{_median(seconds['k3lab']):.1f} s = {ratio:.2f}x dd direct",
            f"dd iflag=direct oflag=direct {dd_s:.1f} s ({size / dd_s / 1e9:.2f} GB/s copied); "
            + (
                "page cache dropped before each run"
                if os.geteuid() == 0
                else "NOT root: the page cache was not dropped"
            ),
        ),
        (
            "  against reading and writing at once (two dd)",
            f"{floor:.2f}x",
            f"{both_s:.1f} s ({2 * size / both_s / 1e9:.2f} GB/s in all): the floor for a converter",
        ),
        (
            "  the disk and the CPU during k3lab's run",
            f"busy {100 * _median([r.busy for r in k3]):.0f}%",
            f"{_median([(r.read_gb + r.written_gb) / r.seconds for r in k3]):.2f} GB/s in all; "
            f"CPU {cpu:.1f} s ({cpu / _median(seconds['k3lab']) / (os.cpu_count() or 1):.2f} of the cores)",
        ),
        (
            "  each round: k3lab / dd direct / two dd",
            "",
            ", ".join(f"{a:.1f}/{b:.1f}/{c:.1f} s" for a, b, c in zip(*seconds.values())),
        ),
    ]
