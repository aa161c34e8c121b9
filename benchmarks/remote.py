"""The `remote` row: looking without downloading, at the real model's size (`synth --preset full` served by
the loopback Hub in another process, one link paced at K3LAB_LINK bytes/s, default 200e6): notebook 02's
view of one layer (bytes against the shard, time against bytes/rate), the same view again, notebook 01's
planning (every shard's header, nothing else), and `verify ORG/NAME` of a sparse full-size GGUF set
(headers, --sample 1, --all's memory)"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.common import _first8, _full_checkpoint, _rss, _served, row, sparse_set


@row
def bench_remote() -> list[tuple[str, str, str]]:
    import subprocess
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from hub_server import HubServer

    rate = float(os.environ.get("K3LAB_LINK", "200e6"))
    rows = []
    view = (
        "import json, sys, time\nfrom k3lab import explore\n"
        "cfg, source = explore.open_checkpoint(sys.argv[1], repo='moonshotai/Kimi-K3')\n"
        "t = time.perf_counter(); explore.scale_stats(source, int(sys.argv[2]), 'w2')\n"
        "print(json.dumps({'seconds': time.perf_counter() - t, 'fetched': source.counts.fetched}))\n"
    )
    with tempfile.TemporaryDirectory(prefix="k3lab-bench-") as tmp_name:
        tmp = Path(tmp_name)
        full = _full_checkpoint(tmp)
        index = json.loads((full / "model.safetensors.index.json").read_text())["weight_map"]
        layer = 5
        shard = index[f"language_model.model.layers.{layer}.input_layernorm.weight"]
        size = (full / shard).stat().st_size
        gguf_set = sparse_set(full, tmp / "set")
        with HubServer(full, large=1 << 20) as hub:
            hub.add_repo("k3lab-test/Kimi-K3-GGUF", gguf_set, large=1 << 20)
            env = hub.client_env(tmp)
            hub.link = rate
            for label in ("notebook 02, one layer's w2 scales (896 experts)", "the same view again"):
                before = hub.served_bytes(shard)
                r = subprocess.run(
                    [sys.executable, "-c", view, str(tmp / "meta"), str(layer)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                got = json.loads(r.stdout)
                served = hub.served_bytes(shard) - before
                bound = 1.2 * served / rate + 2
                rows.append(
                    (
                        f"remote: {label}",
                        f"{got['seconds']:.2f} s, {served / 2**20:,.1f} MiB",
                        f"{100 * served / size:.2f}% of the {size / 2**30:.1f} GiB shard; bound 1.2 x bytes/rate + 2 s = {bound:.2f} s",
                    )
                )
            # notebook 01: plan from every header (the plan's own cost aside: what crosses the link)
            before = {p: n for p, n in _served(hub).items()}
            t = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "k3lab.cli",
                    "plan",
                    "--repo",
                    "moonshotai/Kimi-K3",
                    "--meta",
                    str(tmp / "meta"),
                    "--json",
                ],
                env=env,
                capture_output=True,
                check=True,
            )
            took = time.perf_counter() - t
            after = _served(hub)
            shards = [f for f in after if f.endswith(".safetensors")]
            headers = sum(8 + int.from_bytes(_first8(full / f), "little") for f in shards)
            read = sum(after[f] - before.get(f, 0) for f in shards)
            rows.append(
                (
                    "remote: notebook 01's plan, all 96 shards",
                    f"{read / 2**20:,.1f} MiB in {took:.1f} s",
                    f"headers alone are {headers / 2**20:,.1f} MiB (+8 B each: the length first)",
                )
            )
            # verify ORG/NAME of the full-size set
            for args, label in (
                (["--sample", "1", "--seed", "1"], "verify ORG/NAME --sample 1"),
                ([], "verify ORG/NAME (headers)"),
            ):
                before_all = hub.served_bytes()
                t = time.perf_counter()
                r = subprocess.run(
                    [
                        "/usr/bin/time",
                        "-f",
                        "%M",
                        sys.executable,
                        "-m",
                        "k3lab.cli",
                        "verify",
                        "k3lab-test/Kimi-K3-GGUF",
                        *args,
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                rows.append(
                    (
                        f"remote: {label}",
                        f"{(hub.served_bytes() - before_all) / 2**20:,.1f} MiB read in {time.perf_counter() - t:.1f} s",
                        f"peak RSS {int(r.stderr.strip().splitlines()[-1]) / 1024:.0f} MiB; {r.stdout.strip().splitlines()[-1][:90]}",
                    )
                )
            # --all: memory while streaming (stopped after a minute: it would read 1.42 TiB)
            proc = subprocess.Popen(
                [sys.executable, "-m", "k3lab", "verify", "k3lab-test/Kimi-K3-GGUF", "--all", "--quiet"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            before_all, peak, t = hub.served_bytes(), 0, time.perf_counter()
            while time.perf_counter() - t < 60 and proc.poll() is None:
                peak = max(peak, _rss(proc.pid))
                time.sleep(0.2)
            proc.kill()
            proc.wait()
            streamed = hub.served_bytes() - before_all
            rows.append(
                (
                    "remote: verify ORG/NAME --all, its first minute",
                    f"peak RSS {peak / 2**20:.0f} MiB",
                    f"{streamed / 2**30:.2f} GiB streamed and hashed, none stored",
                )
            )
    return rows
