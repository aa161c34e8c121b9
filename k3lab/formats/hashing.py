"""SHA-256 on the other core: background threads hash in FIFO order while the caller reads, repacks
and writes. hashlib releases the GIL on large buffers, so the work really overlaps. Two lanes
(output bytes on one, source bytes on the other) so that both hashes of a piece run at once; a
given hasher always stays on one lane, which keeps its updates in order.

The lanes are shared by the process; the queue of updates to wait for is the calling thread's own,
so conversions running in several threads of one process (a Dask worker with nthreads > 1) each
wait for their own updates only."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

OUTPUT, SOURCE = 0, 1
_lanes: list[ThreadPoolExecutor] = []
_lanes_lock = threading.Lock()


class _Queue(threading.local):
    def __init__(self) -> None:
        self.pending: deque[tuple[int, Future]] = deque()  # (sequence number, update), in order
        self.submitted = 0


_queue = _Queue()


def as_bytes(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")


def update(h: Any, data: Any, lane: int = OUTPUT) -> None:
    """h.update(data) in the background; the caller must not change `data` until a `wait` covers it."""
    with _lanes_lock:
        if not _lanes:
            _lanes.extend(ThreadPoolExecutor(1, thread_name_prefix=f"k3lab-sha256-{i}") for i in range(2))
    q = _queue
    q.pending.append((q.submitted, _lanes[lane].submit(h.update, as_bytes(data))))
    q.submitted += 1


def mark() -> int:
    """A point in this thread's queue: `wait(upto=mark())` later waits for everything queued before now."""
    return _queue.submitted


def wait(upto: int | None = None) -> None:
    """Block until this thread's updates queued before mark `upto` (all, by default) are done, so
    that the buffers they read may be reused, or digests read."""
    pending = _queue.pending
    while pending and (upto is None or pending[0][0] < upto):
        pending.popleft()[1].result()


def sha256() -> Any:
    return hashlib.sha256()
