"""SHA-256 on the other core: background threads hash in FIFO order while the caller reads, repacks
and writes. hashlib releases the GIL on large buffers, so the work really overlaps. Two lanes
(output bytes on one, source bytes on the other) so that both hashes of a piece run at once; a
given hasher always stays on one lane, which keeps its updates in order."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

OUTPUT, SOURCE = 0, 1
_lanes: list[ThreadPoolExecutor] = []
_pending: list[Future] = []


def as_bytes(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")


def update(h: Any, data: Any, lane: int = OUTPUT) -> None:
    """h.update(data) in the background; the caller must not change `data` before `wait()`."""
    if not _lanes:
        _lanes.extend(ThreadPoolExecutor(1, thread_name_prefix=f"k3lab-sha256-{i}") for i in range(2))
    _pending.append(_lanes[lane].submit(h.update, as_bytes(data)))


def wait() -> None:
    """Block until every queued update is done (before a buffer is reused or a digest is read)."""
    while _pending:
        _pending.pop(0).result()


def sha256() -> Any:
    return hashlib.sha256()
