"""Running tasks on this machine: one after another in this process (the next file's sources
prefetched, the file before uploading meanwhile), or in ``jobs`` worker processes, with their
reports folded into the run's bar and a worker killed from outside named in one line. Each is a
generator of outcomes, ``(k, result or error)``, for the runner's one loop; once the run's ``halt``
is set (a failure every file would share) it starts nothing more but still yields what it began.
Ctrl-C and SIGTERM stop the workers (each removes its ``.partial``)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from k3lab.children import isolated_spawning
from k3lab.errors import K3LabError, MachineError
from k3lab.pipeline.progress import RunProgress
from k3lab.pipeline.running import worker
from k3lab.pipeline.running.task import Task, run_task, task_plan
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.writing.convert import FileResult

Outcome = tuple[int, "FileResult | K3LabError"]


def run_here(task: Task, todo: list[int], progress: RunProgress, halt: threading.Event) -> Iterator[Outcome]:
    """One file after another, as a pipeline: file k converts while the next one's first source
    downloads (the source's prefetch) and file k-1 uploads (one upload at a time, on a thread of its
    own), so that at most two output files are on disk at once."""
    q: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    uploads = ThreadPoolExecutor(1, thread_name_prefix="k3lab-upload")
    uploading: FileResult | None = None

    def settled(result: FileResult) -> Outcome:
        """The upload of ``result`` done: the result, or the upload's failure."""
        try:
            result.pending.result()
        except K3LabError as e:
            return result.number, e
        result.pending = None
        return result.number, result

    with worker.reporting_to(q):
        try:
            for i, k in enumerate(todo):
                if halt.is_set():
                    break
                try:
                    result = run_task(task, k, todo[i + 1] if i + 1 < len(todo) else None, uploads=uploads)
                except K3LabError as e:  # a bad file does not stop the others; the machine's trouble does
                    yield k, e
                    continue
                finally:
                    _drain(q, progress)
                if result.pending is None:
                    yield k, result
                    continue
                before, uploading = uploading, result  # (the one before: one upload in flight at a time)
                if before is not None:
                    yield settled(before)
            if uploading is not None:
                last, uploading = uploading, None
                yield settled(last)
        except BaseException:  # Ctrl-C, SIGTERM: the upload in flight stops at its next piece
            worker.stop()
            raise
        finally:
            if uploading is not None:
                with contextlib.suppress(BaseException):
                    uploading.pending.result()
            uploads.shutdown(wait=True)
            _drain(q, progress)


def run_pool(
    task: Task, todo: list[int], jobs: int, progress: RunProgress, halt: threading.Event
) -> Iterator[Outcome]:
    ctx = mp.get_context("spawn")
    # workers are born ignoring SIGINT (an ignored signal stays ignored across exec, and Python then
    # installs no KeyboardInterrupt handler): Ctrl-C reaches the whole group, but only this process
    # decides how the run stops, even while a worker is still starting up
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with isolated_spawning():  # (the workers, all started by the submits, isolated: k3lab.children)
            q = ctx.Queue()
            pool = ProcessPoolExecutor(
                max_workers=min(jobs, len(todo)),
                mp_context=ctx,
                initializer=worker.init_worker,
                initargs=(q, os.getpid()),
            )
            pending = {pool.submit(run_task, task, k): k for k in todo}
    finally:
        signal.signal(signal.SIGINT, previous)
    stopping = False
    busy: dict[int, int] = {}  # pid -> the file it converts
    workers: dict[int, Any] = {}  # pid -> its Process (the pool forgets them once broken)
    done: set[int] = set()
    try:
        while pending:
            _drain(q, progress, busy)
            workers.update(getattr(pool, "_processes", None) or {})
            if halt.is_set():  # files not begun yet are left for the rerun
                for f in [f for f in pending if f.cancel()]:
                    pending.pop(f)
            for f in [f for f in pending if f.done()]:
                k = pending.pop(f)
                try:
                    result = f.result()
                except K3LabError as e:
                    yield k, e
                except BrokenProcessPool:
                    _drain(q, progress, busy)
                    died, error = _worker_died(workers, busy, done, lambda: _left_partials(task, todo))
                    yield died or k, error
                    pending.clear()
                    break
                else:
                    done.add(k)
                    yield k, result
            time.sleep(0.05)
        _drain(q, progress, busy)
    except BaseException:  # Ctrl-C, SIGTERM: stop the workers now, not after their remaining files
        stopping = True
        raise
    finally:
        if stopping:
            _stop_workers(pool)
            # a worker whose cleanup outlasted the grace was killed with its .partial left; this run
            # holds the folder's lock, so every .partial there (and in its variants' folders) is its own
            folder = OutputFolder(task.out_dir)
            for f in (folder, *(folder.variant(label) for label in task.variants)):
                f.remove_partials()
        pool.shutdown(wait=True, cancel_futures=True)
        q.close()
        q.join_thread()


def _stop_workers(pool: ProcessPoolExecutor, grace: float = 1.5) -> None:
    """SIGTERM each worker (it unwinds and removes its .partial), then SIGKILL what is left."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


def _drain(q: Any, progress: RunProgress, busy: dict[int, int] | None = None) -> None:
    """The workers' messages into the run's bar (and, for ``busy``, which process took which file)."""
    while True:
        try:
            msg = q.get_nowait()
        except queue_mod.Empty:
            return
        if msg[0] == "start" and busy is not None:
            busy[int(str(msg[2]).rsplit(":", 1)[1])] = msg[1]
        progress.take(msg)


def _left_partials(task: Task, todo: list[int]) -> list[int]:
    """The files whose ``.partial`` is still there: a worker killed by SIGKILL could not remove its
    own (and its report of which file it took may have died with it, in its queue's thread)."""
    plan = task_plan(task.model, task.out_dir, task.plan_digest)
    folder = OutputFolder(task.out_dir)
    return [k for k in todo if folder.partial(plan.file(k).filename).exists()]


def _worker_died(
    workers: dict[int, Any], busy: dict[int, int], done: set[int], left: Callable[[], list[int]]
) -> tuple[int | None, MachineError]:
    """A worker killed from outside (the OOM killer, kill -9): the file it converted (if known) and one
    line naming it and the signal."""
    for p in workers.values():  # the others are stopped (and remove their .partial) first
        p.join(2)
    partials = left()
    for p in workers.values():  # what a killed worker was converting, where it could not say
        if p.exitcode and p.exitcode != -signal.SIGTERM and p.pid not in busy and len(partials) == 1:
            busy[p.pid] = partials[0]
    dead = []
    for p in workers.values():
        p.join(1)
        if p.exitcode and busy.get(p.pid) not in done | {None}:
            dead.append(p)
    # the pool terminates the others once one dies: the one killed from outside is not a SIGTERM
    dead.sort(key=lambda p: p.exitcode == -signal.SIGTERM)
    for p in dead:
        how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
        return busy[p.pid], MachineError(
            f"worker for output file {busy[p.pid]} died ({how}); finished files are kept: run the command again"
        )
    idle = [p for p in workers.values() if p.exitcode and p.exitcode != -signal.SIGTERM]
    how = f" (signal {-idle[0].exitcode})" if idle and idle[0].exitcode < 0 else ""
    return None, MachineError(
        f"a worker process died{how} before it began a file; finished files are kept: run the command again"
    )
