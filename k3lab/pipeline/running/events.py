"""A task's reports as Dask events, and its run's stop as a Dask ``Event``: the channel between a task
on a Dask worker and the client that runs it (``cluster``). The channel is named from the run's lock
token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from k3lab.pipeline.progress import Message

FLUSH_EVERY = 0.25  # seconds between two progress events of a task


def channel_name(run_token: str) -> str:
    return f"k3lab-run-{run_token}"


class _WorkerEmitter:
    """A task's messages as Dask events: byte counts batched, the rest at once."""

    def __init__(self, topic: str):
        from distributed import get_worker

        self.worker, self.topic = get_worker(), topic
        self.pending: dict[tuple[str, int], int] = {}
        self.last = 0.0
        self.lock = threading.Lock()

    def __call__(self, msg: Message) -> None:
        kind, number, value = msg
        with self.lock:
            if kind in ("read", "down", "up"):
                self.pending[(kind, number)] = self.pending.get((kind, number), 0) + int(value)
                if time.monotonic() - self.last < FLUSH_EVERY:
                    return
                out = []
            else:
                out = [list(msg)]
            batch = [[k, n, v] for (k, n), v in self.pending.items()] + out
            self.pending.clear()
            self.last = time.monotonic()
        for m in batch:
            self.worker.log_event(self.topic, m)


_stop_events: dict[str, Any] = {}


def worker_channel(channel: str) -> tuple[Callable[[Message], None], Callable[[], bool]]:
    """In a task on a Dask worker: where its messages go and whether its run has stopped."""
    from distributed import Event

    event = _stop_events.get(channel)
    if event is None:
        event = _stop_events[channel] = Event(channel)
    return _WorkerEmitter(channel), event.is_set
