"""Run the conversion over a set of shards: in this process, or in parallel worker processes,
with a progress bar per shard and one overall; then merge the manifest.

Each output file is an independent unit: a worker rebuilds the plan from the paths it is given
(cheap: headers only), so the same task runs unchanged in a local process pool or on a Dask
worker (``batch.py``).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import queue as queue_mod
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .config import K3Config
from .convert import FileResult, convert_file
from .errors import K3LabError
from .manifest import merge
from .plan import Plan, build_plan
from .source import LocalSource


class ShardSpecError(K3LabError):
    """A --shards value that is not N, A-B or a comma mix of them within the set."""


def parse_shards(spec: str | None, n: int) -> list[int]:
    """``N``, ``A-B`` or a comma mix (1-based, inclusive); None or 'all' means every shard."""
    if spec is None or spec.strip().lower() == "all":
        return list(range(1, n + 1))
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if a > b:
                    raise ValueError
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ShardSpecError(f"--shards {spec!r}: {part!r} is not N or A-B") from None
    bad = sorted(k for k in out if not 1 <= k <= n)
    if bad:
        raise ShardSpecError(f"--shards {spec!r}: shard {bad[0]} is outside 1..{n}")
    return sorted(out)


@dataclass(frozen=True)
class Job:
    """Everything a worker needs to convert one output file, as plain paths and values."""

    meta_dir: str
    src_dir: str
    out_dir: str
    outtype: str = "auto"
    basename: str = "Kimi-K3"
    force: bool = False


@functools.lru_cache(maxsize=4)
def load_plan(meta_dir: str, src_dir: str, outtype: str, basename: str) -> tuple[Plan, LocalSource]:
    cfg = K3Config.load(meta_dir)
    source = LocalSource(src_dir, meta_dir)
    return build_plan(cfg, source, outtype, basename), source


def run_one(job: Job, number: int, progress_queue: Any = None) -> FileResult:
    plan, source = load_plan(job.meta_dir, job.src_dir, job.outtype, job.basename)

    def progress(n: int) -> None:
        if progress_queue is not None:
            progress_queue.put((number, n))

    return convert_file(plan, number, source, job.out_dir, job.meta_dir, force=job.force, progress=progress)


def _bars(plan: Plan, numbers: list[int], enabled: bool | None) -> tuple[Any, dict[int, Any]]:
    total = sum(plan.source_files[plan.file(k).source_file] for k in numbers)
    overall = tqdm(
        total=total, unit="B", unit_scale=True, desc=f"{len(numbers)} shards", disable=enabled, position=0
    )
    return overall, {}


def convert_shards(
    job: Job,
    numbers: list[int] | None = None,
    jobs: int = 1,
    quiet: bool = False,
    scheduler: str | None = None,
) -> list[FileResult]:
    """Convert the given output files (default: all), ``jobs`` at a time, or one task each on the Dask
    cluster at ``scheduler``; merge the manifest."""
    plan, _ = load_plan(job.meta_dir, job.src_dir, job.outtype, job.basename)
    numbers = numbers or list(range(1, len(plan.files) + 1))
    if scheduler:
        from .batch import dask_map

        try:
            return sorted(dask_map(run_one, [(job, k) for k in numbers], scheduler), key=lambda r: r.number)
        finally:
            merge(job.out_dir)
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    disable = True if quiet else None  # None: tqdm shows bars only on a terminal
    overall, bars = _bars(plan, numbers, disable)
    results: list[FileResult] = []
    errors: list[BaseException] = []

    def on_progress(number: int, n: int) -> None:
        if number not in bars:
            pf = plan.file(number)
            bars[number] = tqdm(
                total=plan.source_files[pf.source_file],
                unit="B",
                unit_scale=True,
                desc=f"shard {number:>3}",
                leave=False,
                disable=disable,
                position=1 + len(bars) % max(jobs, 1),
            )
        bars[number].update(n)
        overall.update(n)

    def finish(r: FileResult) -> None:
        results.append(r)
        bar = bars.pop(r.number, None)
        if bar is not None:
            bar.close()
        overall.set_postfix_str(f"{r.filename} {'kept' if r.skipped else 'written'}")

    try:
        if jobs <= 1:
            for k in numbers:
                try:
                    finish(
                        convert_file(
                            plan,
                            k,
                            load_plan(job.meta_dir, job.src_dir, job.outtype, job.basename)[1],
                            job.out_dir,
                            job.meta_dir,
                            job.force,
                            lambda n, k=k: on_progress(k, n),
                        )
                    )
                except Exception as e:  # a bad shard does not stop the others
                    errors.append(e)
        else:
            ctx = mp.get_context("spawn")
            with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                q = manager.Queue()
                futures = {pool.submit(run_one, job, k, q): k for k in numbers}
                pending = set(futures)
                while pending:
                    _drain(q, on_progress)
                    for f in [f for f in pending if f.done()]:
                        pending.discard(f)
                        try:
                            finish(f.result())
                        except Exception as e:
                            errors.append(e)
                    time.sleep(0.05)
                _drain(q, on_progress)
    finally:
        for bar in bars.values():
            bar.close()
        overall.close()
        merge(job.out_dir)
    if errors:
        raise errors[0]
    return sorted(results, key=lambda r: r.number)


def _drain(q: Any, on_progress: Any) -> None:
    while True:
        try:
            number, n = q.get_nowait()
        except queue_mod.Empty:
            return
        on_progress(number, n)
