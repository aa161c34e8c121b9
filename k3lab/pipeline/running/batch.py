"""Batch runs: a notebook executed once per output file with papermill, fanned out on Dask distributed.

``run_batch`` starts a LocalCluster (or joins a scheduler) and runs ``notebook`` for each output
file with parameters ``meta``, ``src``, ``out_dir`` and ``file``; each executed notebook is kept as
``papermill_runs/<run-id>/file-NN.ipynb``. A failed file does not stop the others: it is reported
in the summary and converted by running the same command again (finished files are found complete
and kept). Concurrent kernel starts can race for ports (a known papermill and
jupyter_client problem), so a kernel that fails to start is retried after a random pause.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from k3lab.errors import K3LabError
from k3lab.pipeline.state import OutputFolder

CELL_TIMEOUT = 4 * 3600  # seconds one cell may take (a real shard converts in under a minute): never hang
KERNEL_START_ERRORS = (
    "Kernel died before replying",
    "Address already in use",
    "kernel_info",
    "ZMQError",
    "Kernel didn't respond",
    "TimeoutError",
)


@dataclass
class ShardRun:
    file: int  # the output file the notebook ran for
    status: str  # ok | failed
    seconds: float
    notebook: str
    error: str = ""


def execute_shard(notebook: str, output: str, parameters: dict[str, Any], attempts: int = 4) -> ShardRun:
    """Run one notebook with papermill (on a Dask worker); never raises, reports instead."""
    import papermill

    t0 = time.perf_counter()
    shard = int(parameters["file"])
    for attempt in range(attempts):
        try:
            papermill.execute_notebook(
                notebook,
                output,
                parameters=parameters,
                kernel_name="python3",
                progress_bar=False,
                log_output=False,
                start_timeout=120,
                execution_timeout=CELL_TIMEOUT,
            )
            return ShardRun(shard, "ok", time.perf_counter() - t0, output)
        except Exception as e:  # papermill raises its own and jupyter_client's errors
            text = f"{type(e).__name__}: {e}"
            if attempt + 1 < attempts and any(k in text for k in KERNEL_START_ERRORS):
                time.sleep(random.uniform(0.5, 2.0) * (attempt + 1))  # a port race: try again
                continue
            last = text.strip().splitlines()
            return ShardRun(shard, "failed", time.perf_counter() - t0, output, last[-1] if last else text)
    raise AssertionError("unreachable")  # pragma: no cover


def dask_map(
    fn: Callable[..., Any],
    calls: Iterable[tuple],
    scheduler: str | None = None,
    workers: int = 2,
    desc: str = "files",
    quiet: bool = False,
) -> list[Any]:
    """fn(*args) for each args on Dask: a LocalCluster of ``workers`` processes, or ``scheduler``.
    A call that raised k3lab's own error (bad input) is returned as that exception, so one bad
    shard does not hide the others' results; anything else is raised."""
    from dask.distributed import Client, LocalCluster, as_completed

    calls = list(calls)
    cluster = None
    if scheduler:
        client = Client(scheduler)
    else:
        cluster = LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
        )
        client = Client(cluster)
    try:
        futures = [client.submit(fn, *args, pure=False) for args in calls]
        results = []
        with tqdm(
            total=len(futures), desc=desc, unit="file", disable=True if quiet else None, dynamic_ncols=True
        ) as bar:
            for fut in as_completed(futures):
                try:
                    results.append(fut.result())
                except K3LabError as e:
                    results.append(e)
                bar.update(1)
        return results
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def run_batch(
    notebook: str | Path,
    meta: str | Path,
    src: str | Path,
    out_dir: str | Path,
    shards: list[int],
    scheduler: str | None = None,
    workers: int = 2,
    run_id: str | None = None,
    runs_dir: str | Path = "papermill_runs",
    run_token: str | None = None,
) -> tuple[Path, list[ShardRun]]:
    """Run ``notebook`` once per output file (``shards``). ``run_token`` is the token of the run holding ``out_dir``'s
    lock (the notebooks convert into it as part of that run)."""
    if not Path(notebook).is_file():
        raise K3LabError(f"{notebook}: notebook not found (the repository's are in notebooks/)")
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    run_dir = Path(runs_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    calls = [
        (
            str(Path(notebook).resolve()),
            str((run_dir / f"file-{k:02d}.ipynb").resolve()),
            {
                "meta": str(Path(meta).resolve()),
                "src": str(Path(src).resolve()),
                "out_dir": str(Path(out_dir).resolve()),
                "file": k,
                **({"run_token": run_token} if run_token else {}),
            },
        )
        for k in shards
    ]
    results = dask_map(execute_shard, calls, scheduler, workers)
    if Path(out_dir).exists():
        OutputFolder(out_dir).records.merge()
    return run_dir, sorted(results, key=lambda r: r.file)


def summary(run_dir: Path, results: list[ShardRun]) -> str:
    lines = [f"run {run_dir}", f"{'file':>5}  {'status':<7} {'seconds':>8}  notebook / error"]
    for r in results:
        lines.append(
            f"{r.file:>5}  {r.status:<7} {r.seconds:>8.1f}  {Path(r.notebook).name}"
            + (f"  {r.error}" if r.error else "")
        )
    failed = [r.file for r in results if r.status != "ok"]
    lines.append(
        f"{len(results) - len(failed)} ok, {len(failed)} failed"
        + (f" (files {','.join(map(str, failed))}: run the same command again)" if failed else "")
    )
    return "\n".join(lines)
