"""A real Dask cluster for tests: `dask scheduler` and `dask worker` processes started from the command
line, as a user starts them, each worker with a local directory of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

DASK = str(Path(sys.executable).parent / "dask")  # the `dask` command of this environment


@contextlib.contextmanager
def dask_cluster(tmp: Path, workers: int = 2) -> Iterator[tuple[str, list[Path]]]:
    """Yields the scheduler's address and each worker's local directory (its private disk)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DASK_"))}
    env["HF_HUB_DISABLE_XET"] = "1"  # the loopback Hub speaks LFS for uploads, not Xet
    sched_file = tmp / "scheduler.json"
    dirs = [tmp / f"w{i}" for i in range(workers)]
    procs = [
        subprocess.Popen(
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard"]
            + ["--scheduler-file", str(sched_file)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]
    try:
        for _ in range(300):
            if sched_file.exists() and sched_file.stat().st_size:
                break
            time.sleep(0.1)
        address = json.loads(sched_file.read_text())["address"]
        for i, d in enumerate(dirs):
            procs.append(
                subprocess.Popen(
                    [DASK, "worker", address, "--nworkers", "1", "--nthreads", "1", "--no-dashboard"]
                    + ["--host", "127.0.0.1", "--name", f"w{i}", "--local-directory", str(d)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        wait_workers(address, workers)
        yield address, dirs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def wait_workers(address: str, n: int) -> None:
    from distributed import Client

    with Client(address, timeout=60) as client:
        client.wait_for_workers(n, timeout=90)
