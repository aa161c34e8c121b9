"""A run's output files as Dask tasks on a running cluster, with one progress bar and a stop that stops.

Each output file is one task (``task.run_task``) submitted to the scheduler. The run has a
*channel*, a name made from its lock token:

- **Progress.** Tasks send their ``TaskReport`` messages as Dask events on the channel's topic
  (``Worker.log_event``; bytes are batched to a few messages a second); the client subscribes
  (``Client.subscribe_topic``) and folds them into the run's one byte bar.
- **Stopping.** Ctrl-C or SIGTERM of the client sets the channel's ``distributed.Event`` and cancels
  every task on the scheduler (pending ones never start). A running task asks the Event between
  pieces and before it renames a finished file (and checks the run still holds the folder's lock), so
  it unwinds, removing its ``.partial``; the client waits for every started task to say it ended
  (up to ``STOP_GRACE`` seconds) before it lets go of the folder, so a rerun never meets a task of
  the old run still writing.
"""

from __future__ import annotations

import queue as queue_mod
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from k3lab.errors import K3LabError, MachineError
from k3lab.pipeline.progress import Cancelled, RunProgress
from k3lab.pipeline.running.events import channel_name

STOP_GRACE = 60.0  # seconds the client waits for running tasks to stop after Ctrl-C


def run_on_dask(
    work: Callable[..., Any],
    task: Any,
    todo: list[int],
    scheduler: str,
    progress: RunProgress,
    halt: threading.Event,
    plan_bytes: Callable[[int], int],
    plan_state: dict[str, bytes] | None = None,
) -> Iterator[tuple[int, Any]]:
    """``work(task, k)`` for each k on the cluster at ``scheduler``, yielding ``(k, result or
    error)`` as they end (``plan_bytes(k)``: file k's source bytes, its share of the bar). Once
    ``halt`` is set, tasks not begun are cancelled. ``plan_state``: the saved plan's files, sent once
    to each worker that writes a folder of its own."""
    import dataclasses
    from concurrent.futures import CancelledError

    from distributed import Client, Event, wait

    channel = channel_name(task.run_token)
    task = dataclasses.replace(task, channel=channel)
    try:
        client = Client(scheduler, timeout=60)
    except OSError as e:
        raise MachineError(f"--scheduler {scheduler}: cannot reach it ({e})") from None
    inbox: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    client.subscribe_topic(channel, lambda event: inbox.put(event[1]))
    stop = Event(channel, client=client)
    shared = client.scatter(plan_state, hash=False) if plan_state is not None else None
    futures = {
        client.submit(work, task, k, None, shared, key=f"k3lab-{task.run_token[:12]}-{k}", pure=False): k
        for k in todo
    }

    def drain() -> None:
        while True:
            try:
                progress.take(tuple(inbox.get_nowait()))
            except queue_mod.Empty:
                return

    try:
        pending = set(futures)
        while pending:
            try:
                done, pending = wait(pending, timeout=0.25, return_when="FIRST_COMPLETED")
            except TimeoutError:
                done = set()
            drain()
            if halt.is_set():  # tasks not begun yet are left for the rerun
                waiting = [f for f in pending if futures[f] not in progress.running]
                if waiting:
                    client.cancel(waiting)
                    pending -= set(waiting)
            for fut in done:
                k = futures[fut]
                try:
                    result = fut.result()
                except K3LabError as e:
                    yield k, e
                except (Cancelled, CancelledError):
                    continue  # stopped with its run, or cancelled after a failure: the rerun does it
                except Exception as e:  # KilledWorker and the like: the machine's, not the input's
                    said = " ".join(str(e).split())  # (one line: Dask's messages run over several)
                    yield k, MachineError(f"on the cluster: {type(e).__name__}: {said}".strip())
                else:
                    progress.finished(k, plan_bytes(k))
                    yield k, result
    except BaseException:  # Ctrl-C, SIGTERM: every task stops, and the client waits until they have
        stop.set()
        client.cancel(list(futures), force=True)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline:
            drain()
            if not progress.running:
                time.sleep(0.5)  # a last task's "end" may be in flight
                drain()
                if not progress.running:
                    break
            time.sleep(0.1)
        raise
    finally:
        try:
            client.unsubscribe_topic(channel)
        finally:
            client.close()
