"""SHA-256 on a second core: one background thread hashes in FIFO order while the caller reads,
repacks and writes. hashlib releases the GIL on large buffers, so the two really overlap."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

_pool: ThreadPoolExecutor | None = None
_pending: list[Future] = []


def as_bytes(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")


def update(h: Any, data: Any) -> None:
    """h.update(data) in the background; the caller must not change `data` before `wait()`."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="k3lab-sha256")
    _pending.append(_pool.submit(h.update, as_bytes(data)))


def wait() -> None:
    """Block until every queued update is done (before a buffer is reused or a digest is read)."""
    while _pending:
        _pending.pop(0).result()


def sha256() -> Any:
    return hashlib.sha256()
