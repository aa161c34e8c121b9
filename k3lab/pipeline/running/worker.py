"""What a process that runs tasks needs, in one place: where its tasks' reports go, how they hear
that the run stopped, and (a ``--jobs`` worker process) how it is stopped cleanly: SIGTERM unwinds a
conversion (removing its ``.partial``), and the process dies with its parent, however the parent
dies (kill -9 included)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from k3lab.pipeline.progress import Stopped, TaskReport

_queue: Any = None  # where this process's tasks report (the run's queue), when it has one
_stopping = threading.Event()  # this process's run stopped: a background upload hears it and stops
_converting = 0  # conversions running in this process (a SIGTERM then has cleaning up to do)
_lock = threading.Lock()


def report(number: int) -> TaskReport:
    """A task's report in this process: to the run's queue (when there is one), stopping with it."""
    q = _queue
    return TaskReport(number, q.put if q is not None else None, _stopping.is_set)


@contextlib.contextmanager
def reporting_to(queue: Any) -> Iterator[None]:
    """This process's tasks report to ``queue`` for the block (a run in this very process)."""
    global _queue
    _queue = queue
    _stopping.clear()
    try:
        yield
    finally:
        _queue = None


def stop() -> None:
    """The run in this process stopped (Ctrl-C): background work stops at its next piece."""
    _stopping.set()


@contextlib.contextmanager
def converting() -> Iterator[None]:
    """A conversion runs for the block: a SIGTERM meanwhile unwinds it instead of exiting at once."""
    global _converting
    with _lock:
        _converting += 1
    try:
        yield
    finally:
        with _lock:
            _converting -= 1


def init_worker(queue: Any, parent: int) -> None:
    """In each ``--jobs`` worker process: report to the parent's queue, and die with it (SIGINT is
    ignored from birth: see processes.run_pool)."""
    global _queue
    _queue = queue
    signal.signal(signal.SIGTERM, _sigterm)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="k3lab-parent-watch").start()


def _sigterm(signum: int, frame: Any) -> None:
    """Mid-conversion: unwind, removing the .partial. Idle (waiting for a task, as the workers the
    pool stops once one of them dies): nothing to clean up and nothing to say, so leave at once."""
    if _converting:
        raise Stopped(signal.Signals(signum).name)
    os._exit(0)


def _watch_parent(parent: int) -> None:
    """The run that started this worker is gone (even by kill -9): stop as SIGTERM would, cleaning
    up; if that takes too long, exit anyway."""
    while os.getppid() == parent:
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    os._exit(70)
