"""The `dense` row: one real-size MoE shard with real bytes (a `full` checkpoint's shard 2, its data filled
with random bytes: 16 GB), each run from an empty page cache (as root: drop_caches; said when not):
convert it, against a `dd iflag=direct oflag=direct` copy of the same file, in paired rounds"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.common import ROUNDS, _fresh, _full_checkpoint, _median, _timed, fill_dense, row


@row
def bench_dense() -> list[tuple[str, str, str]]:
    import subprocess
    import tempfile

    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="k3lab-bench-", dir=".") as tmp_name:
        tmp = Path(tmp_name)
        full = _full_checkpoint(tmp)
        shard = min(p.name for p in full.glob("model-00002-of-*.safetensors"))  # (layer 1's, Moonshot's name)
        dense = fill_dense(full, shard, Path(os.environ.get("K3LAB_DENSE") or tmp / "dense"))
        out = tmp / "out"
        k3 = [sys.executable, "-m", "k3lab.cli"]
        subprocess.run(
            [*k3, "plan", "--meta", str(dense), "--out-dir", str(out)], check=True, capture_output=True
        )
        convert = [*k3, "convert", "--meta", str(dense), "--out-dir", str(out), "--shards", "2", "--quiet"]
        copy = [
            "dd",
            f"if={dense / shard}",
            f"of={out / 'dd.out'}",
            "bs=64M",
            "iflag=direct",
            "oflag=direct",
            "conv=fsync",
            "status=none",
        ]
        root = os.geteuid() == 0
        k3lab_s, dd_s = [], []
        for _ in range(ROUNDS):
            _fresh(out)
            k3lab_s.append(_timed(convert))
            _fresh(out)
            dd_s.append(_timed(copy))
            (out / "dd.out").unlink()
        ratio = _median([a / b for a, b in zip(k3lab_s, dd_s)])
        size = (dense / shard).stat().st_size
        rows.append(
            (
                f"dense: one MoE shard of real bytes ({size / 1e9:.1f} GB), cold cache",
                f"{_median(k3lab_s):.1f} s = {ratio:.2f}x dd direct",
                f"dd iflag=direct oflag=direct {_median(dd_s):.1f} s ({size / _median(dd_s) / 1e9:.2f} GB/s); "
                + (
                    "page cache dropped before each run"
                    if root
                    else "NOT root: the page cache was not dropped"
                ),
            )
        )
    return rows
