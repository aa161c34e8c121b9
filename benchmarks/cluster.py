"""The `cluster` row: a real `dask scheduler` and one `dask worker` (then two) publishing 6 MoE layer
shards at the real expert dims (16 experts each) from the loopback Hub to the loopback Hub, each
worker's link paced both ways (K3LAB_LINK bytes/s down, K3LAB_UPLINK up; default 40e6 each) so that the
network sets the pace: wall time against the larger of a worker's download, upload and conversion times
plus one shard's fill, beside the same run by K3LAB_BASELINE's code (one step after another)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from benchmarks.common import _fresh, _six_layers, row


@row
def bench_cluster() -> list[tuple[str, str, str]]:
    import subprocess
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from dask_helpers import dask_cluster
    from hub_server import FileBlob, HubServer

    FileBlob.HASHED = 1 << 40  # (these shards are downloaded whole: the Hub must list their real SHA-256)
    down = float(os.environ.get("K3LAB_LINK", "40e6"))
    up = float(os.environ.get("K3LAB_UPLINK", "40e6"))
    root = Path(__file__).resolve().parent.parent
    base = os.environ.get("K3LAB_BASELINE", "3155acd")
    rows = []
    with tempfile.TemporaryDirectory(prefix="k3lab-bench-", dir=".") as tmp_name:
        tmp = Path(tmp_name).resolve()
        src = _six_layers(tmp / "src")
        k3 = [sys.executable, "-m", "k3lab"]
        # the conversion alone, from a local copy (what the disk and the CPU take)
        _fresh(tmp / "local")
        t = time.perf_counter()
        subprocess.run(
            [
                *k3,
                "convert",
                "--meta",
                str(src),
                "--out-dir",
                str(tmp / "local"),
                "--quiet",
                "--split-max-tensors",
                "1",
            ],
            check=True,
            capture_output=True,
        )
        convert_s = time.perf_counter() - t
        text = sorted(src.glob("model-*.safetensors"))[:-1]  # (the last shard is the vision tower's)
        shard_bytes = sum(p.stat().st_size for p in text)
        out_bytes = sum(p.stat().st_size for p in (tmp / "local").glob("*.gguf"))
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "-q", "--detach", str(tmp / "base"), base], check=True
        )
        runs = [
            ("now", root, 1, ["--text-only", "--split-max-tensors", "1"]),  # (a task per layer)
            ("base", tmp / "base", 1, []),
            ("now", root, 2, ["--text-only", "--split-max-tensors", "1"]),
        ]
        walls: dict[tuple[str, int], float] = {}
        try:
            for i, (label, tree, workers, extra) in enumerate(runs):
                # a fresh Hub per run (a second upload of the same bytes would be deduplicated), the
                # link paced so that each of ``workers`` machines has ``down`` and ``up`` of its own
                os.environ["PYTHONPATH"] = str(tree)  # (the workers run this tree's code)
                (tmp / f"cluster-{i}").mkdir()
                with (
                    HubServer(src, large=1 << 20) as hub,
                    dask_cluster(tmp / f"cluster-{i}", workers) as (addr, _),
                ):
                    env = {**hub.client_env(tmp / f"client-{i}"), "PYTHONPATH": str(tree)}
                    hub.check_cards = label == "now"  # (the baseline's card fails the Hub's validation)
                    args = ["--repo", "moonshotai/Kimi-K3", "--meta", str(tmp / f"meta-{i}")]
                    args += ["--out-dir", str(tmp / f"out-{i}"), "--scratch", str(tmp / f"scratch-{i}")]
                    # (run from the tree: `python -m` puts the working folder first on the path)
                    subprocess.run([*k3, "plan", *args], env=env, check=True, capture_output=True, cwd=tree)
                    hub.link, hub.uplink = down * workers, up * workers
                    t = time.perf_counter()
                    r = subprocess.run(
                        [
                            *k3,
                            "convert",
                            *args,
                            "--scheduler",
                            addr,
                            "--push-to",
                            f"bench/six-{i}",
                            "--quiet",
                            *extra,
                        ],
                        env=env,
                        capture_output=True,
                        text=True,
                        cwd=tree,
                    )
                    walls[label, workers] = time.perf_counter() - t
                    if r.returncode != 0:
                        raise SystemExit(r.stderr[-2000:])
        finally:
            os.environ.pop("PYTHONPATH", None)
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(tmp / "base")], check=False
            )
        fill = max(p.stat().st_size for p in text) / down
        for workers in (1, 2):
            share = 1 / workers  # (each worker's part of the shards, at its own link's pace)
            floor = max(share * shard_bytes / down, share * out_bytes / up, share * convert_s) + fill
            now = walls["now", workers]
            before = f"; one step after another ({base}): {walls['base', 1]:.1f} s" if workers == 1 else ""
            rows.append(
                (
                    f"cluster: {workers} worker{'s' * (workers > 1)}, 6 MoE shards Hub -> Hub (the network's pace)",
                    f"{now:.1f} s = {now / floor:.2f}x the floor",
                    f"floor per worker: max(download {share * shard_bytes / down:.1f} s, upload "
                    f"{share * out_bytes / up:.1f} s, convert {share * convert_s:.1f} s) + one shard's fill "
                    f"{fill:.1f} s = {floor:.1f} s{before}",
                )
            )
    return rows
