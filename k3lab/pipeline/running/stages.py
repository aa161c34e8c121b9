"""How far a Dask worker's tasks run ahead of one another: the worker as a pipeline, in bounds.

A task on a Dask worker goes through three stages, each bounded per worker thread (``n`` threads):

1. It takes a **source** slot (``2n``) as it starts, still holding its worker thread, and downloads
   its shard.
2. Once the shard is here it leaves the worker's thread pool (``distributed.secede``), so the
   worker's next task starts its download while this one converts. It takes an **output** slot
   (``2n``; publishing only), then a **converting** slot (``n``), converts, and gives back the
   converting and source slots (its shard is deleted then).
3. It takes an **uploading** slot (``n``), uploads, and gives back its output slot (its file is
   deleted then).

So a worker holds at most two source shards and two output files per thread on disk, converts at
most one file per thread at a time (the memory ``k3lab plan`` forecasts per conversion), and its
download does not wait for a conversion or an upload to end. Slots are always taken in this order
(no task waits for one it would have to give back first), and every wait hears the run's stop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from k3lab.pipeline.progress import TaskReport


class Stages:
    """The slots of one worker process."""

    def __init__(self, threads: int):
        self.sources = threading.Semaphore(2 * threads)
        self.outputs = threading.Semaphore(2 * threads)
        self.converting = threading.Semaphore(threads)
        self.uploading = threading.Semaphore(threads)


_stages: Stages | None = None
_lock = threading.Lock()


def worker_stages() -> Stages:
    """This Dask worker's slots, sized by its thread count (made on its first task)."""
    global _stages
    from distributed import get_worker

    with _lock:
        if _stages is None:
            _stages = Stages(max(1, get_worker().state.nthreads))
        return _stages


@contextlib.contextmanager
def held(slot: threading.Semaphore, report: TaskReport) -> Iterator[None]:
    """``slot`` taken for the block; waiting for it stops when the run stops."""
    while not slot.acquire(timeout=0.5):
        report.check(now=True)
    try:
        yield
    finally:
        slot.release()


def leave_pool() -> None:
    """This task goes on outside its worker's thread pool: the worker starts its next task."""
    from distributed import secede

    secede()
