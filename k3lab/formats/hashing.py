"""SHA-256 on the other core: a background thread hashes in FIFO order while the caller reads, repacks
and writes. hashlib releases the GIL on large buffers, so the work really overlaps. Other background
work on the same buffers (the GGUF writer's I/O thread) joins the same queue with `track`, so one
`wait` says when a buffer may be reused.

The hashing thread is shared by the process; the queue of updates to wait for is the calling
thread's own, so conversions running in several threads of one process (a Dask worker with
nthreads > 1) each wait for their own updates only."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

_lane: list[ThreadPoolExecutor] = []
_lane_lock = threading.Lock()
_inputs: list[ThreadPoolExecutor] = []  # the lane of hashes of what is read (nothing waits on them in order)


class _Queue(threading.local):
    def __init__(self) -> None:
        self.pending: deque[tuple[int, Future]] = deque()  # (sequence number, update), in order
        self.submitted = 0


_queue = _Queue()


def as_bytes(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")


def update(h: Any, data: Any) -> None:
    """h.update(data) in the background; the caller must not change `data` until a `wait` covers it."""
    with _lane_lock:
        if not _lane:
            _lane.append(ThreadPoolExecutor(1, thread_name_prefix="k3lab-sha256"))
    q = _queue
    q.pending.append((q.submitted, _lane[0].submit(h.update, as_bytes(data))))
    q.submitted += 1


def track(work: Future) -> None:
    """Queue other background work that reads a caller's buffer (the writer's I/O thread), so that
    `mark` and `wait` cover it in order with the hashes."""
    q = _queue
    q.pending.append((q.submitted, work))
    q.submitted += 1


def mark() -> int:
    """A point in this thread's queue: `wait(upto=mark())` later waits for everything queued before now."""
    return _queue.submitted


def wait(upto: int | None = None) -> None:
    """Block until this thread's updates queued before mark `upto` (all, by default) are done, so
    that the buffers they read may be reused, or digests read."""
    pending = _queue.pending
    error: BaseException | None = None
    while pending and (upto is None or pending[0][0] < upto):
        try:
            pending.popleft()[1].result()
        except BaseException as e:  # the rest is still waited for: their buffers are in use too,
            error = error or e  # and a later run in this thread must not meet this failure again
    if error is not None:
        raise error


def on_read_lane(fn: Any, *args: Any) -> Future:
    """``fn(*args)`` on a hashing thread of its own, for bytes that were read (a source's): the
    writer's queue never waits for these; what is given runs in the order given."""
    with _lane_lock:
        if not _inputs:
            _inputs.append(ThreadPoolExecutor(1, thread_name_prefix="k3lab-sha256-read"))
        return _inputs[0].submit(fn, *args)


def stop() -> None:
    """End the hashing threads once what they were given is done (a process about to exit: an idle
    pool thread still counts as running, and an exit that waits for it tears the interpreter down)."""
    with _lane_lock:
        lanes = [*_lane, *_inputs]
        _lane.clear()
        _inputs.clear()
    for lane in lanes:
        lane.shutdown(wait=True)


def sha256() -> Any:
    return hashlib.sha256()


def git_blob_hash(size: int) -> Any:
    """The hasher of git's (and the Hub's) id of a ``size``-byte blob: SHA-1 over ``blob SIZE\\0``
    and then the bytes (feed it the bytes)."""
    return hashlib.sha1(b"blob %d\0" % size)
