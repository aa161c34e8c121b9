"""Run a conversion: the one loop. Plan once (or load the saved plan), then convert the chosen
output files in this process, in ``jobs`` worker processes, or as one Dask task each on the cluster
at ``scheduler``; merge the manifest.

A task is ``run_task(task, number)``: plain values in (the output folder, where the plan is, and a
``SourceSpec``), so the same task runs unchanged in this process, a local worker process or a Dask
worker on another machine. It loads the saved plan and opens its own source: a local folder, or the
Hub, whence it downloads its shard into scratch, converts it and deletes it.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm  # a widget bar in a notebook, a text bar on a terminal

from k3lab.errors import K3LabError, MachineError
from k3lab.pipeline.convert import FileResult, convert_file, worker_name
from k3lab.pipeline.folder import OutputFolder, check_basename
from k3lab.pipeline.model import Model
from k3lab.pipeline.plan import Plan
from k3lab.pipeline.planner import make_plan, plan_options, still_current
from k3lab.pipeline.progress import RunProgress, TaskReport
from k3lab.pipeline.publish import Committer, Publication, PushTarget, open_target, published, upload
from k3lab.pipeline.record import Record
from k3lab.pipeline.sources import SourceSpec


class ShardSpecError(K3LabError):
    """A --shards value that is not N, A-B or a comma mix of them within the set."""


def parse_shards(chosen: str | None, n: int) -> list[int]:
    """``N``, ``A-B`` or a comma mix (1-based, inclusive); None or 'all' means every output file."""
    if chosen is None or chosen.strip().lower() == "all":
        return list(range(1, n + 1))
    out: set[int] = set()
    for part in chosen.split(","):
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
            raise ShardSpecError(f"--shards {chosen!r}: {part!r} is not N or A-B") from None
    bad = sorted(k for k in out if not 1 <= k <= n)
    if bad:
        raise ShardSpecError(f"--shards {chosen!r}: shard {bad[0]} is outside 1..{n}")
    return sorted(out)


@dataclass(frozen=True)
class Task:
    """Everything a worker needs to convert output files of one run, as plain values (the model
    travels by name: see ``Model.__reduce__``)."""

    model: Model
    out_dir: str
    source: SourceSpec  # pinned: the plan's commit, for a Hub source
    plan_digest: str  # the worker checks it loaded the plan this run made
    force: bool = False
    run_token: str = ""  # the run holding the folder: a task renames nothing once it does not
    channel: str = ""  # on Dask: the run's event topic and stop Event (see ``cluster``)
    push: PushTarget | None = None  # publish each finished file there (see ``publish``)
    private: bool = False  # each Dask worker writes into a folder of its own (needs ``push``)


@functools.lru_cache(maxsize=2)
def _task_plan(model: Model, out_dir: str, plan_digest: str) -> Plan:
    return OutputFolder(out_dir).require_plan(model, plan_digest)


_progress_queue: Any = None  # set in worker processes by _init_worker, and by _run_here


def _task_report(task: Task, number: int) -> TaskReport:
    """Where this task's messages go (the run's queue, or Dask's event stream), and how it hears of
    a stop (on Dask: the run's Event; elsewhere signals reach the process itself)."""
    if task.channel:
        from k3lab.pipeline.cluster import worker_channel

        emit, stop = worker_channel(task.channel)
        return TaskReport(number, emit, stop)
    q = _progress_queue
    return TaskReport(number, q.put if q is not None else None)


def worker_folder(task: Task) -> tuple[str, SourceSpec]:
    """Where this task writes, and the source it reads: the run's folder, or (``private``) a folder
    of this Dask worker's own, ``<worker local directory>/k3lab/out-<plan digest>``, with its
    downloads in ``.../k3lab/scratch``."""
    if not task.private:
        return task.out_dir, task.source
    from distributed import get_worker

    root = Path(get_worker().local_directory) / "k3lab"
    return str(root / f"out-{task.plan_digest[:16]}"), task.source.with_options(
        {"scratch": str(root / "scratch")}
    )


def run_task(
    task: Task, number: int, next_number: int | None = None, plan_state: dict[str, bytes] | None = None
) -> FileResult:
    """Convert output file ``number`` (and, with ``push``, publish it): the task every runner runs.
    ``plan_state``: the saved plan's files, for a worker writing a folder of its own."""
    report = _task_report(task, number)
    report.started(worker_name())
    try:
        report.check(now=True)  # a task the scheduler started as its run stopped does nothing
        out_dir, spec = worker_folder(task)
        folder = OutputFolder(out_dir)
        if plan_state is not None:
            folder.import_plan(plan_state)
        plan = _task_plan(task.model, out_dir, task.plan_digest)
        source = spec.open()
        if next_number is not None:
            ahead = TaskReport(next_number, report.emit, report.stop)
            source.prefetch(plan.file(next_number).source_file, ahead)

        def before_commit() -> None:
            report.check(now=True)
            if task.run_token and not task.private:
                folder.check_held(task.run_token)

        global _converting
        _converting += 1
        try:
            result = convert_file(plan, number, source, out_dir, task.force, report, before_commit)
            if task.push is not None:
                _publish_file(task.push, folder, plan.file(number).filename, number, report, result)
            return result
        finally:
            _converting -= 1
    finally:
        report.ended()


def _publish_file(
    push: PushTarget, folder: OutputFolder, filename: str, number: int, report: TaskReport, result: FileResult
) -> None:
    """Upload a finished file from this machine; its record gains the file's SHA-256 and travels back
    with the uploaded operation; the local copy goes unless ``keep_local``."""
    record = folder.text_record(number)
    if record is None:  # convert_file has just written or found it: never
        raise K3LabError(f"{folder.output(filename)}: no record after converting it")
    result.upload = upload(push, folder.output(filename), report)
    record.sha256 = result.upload.upload_info.sha256.hex()
    folder.write_record(record)
    result.record = record.to_json()
    if not push.keep_local:
        folder.remove_output(filename)


_converting = 0  # conversions running in this process (a SIGTERM then has cleaning up to do)


class Stopped(BaseException):
    """SIGTERM (or the run's end) reached a process mid-conversion: unwind, removing .partial files."""


def stop_on_sigterm() -> None:
    """Turn SIGTERM into ``Stopped`` in the main thread, so that cleanup runs (a plain SIGTERM
    would end the process with its .partial files left)."""

    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)


def _init_worker(progress_queue: Any, parent: int) -> None:
    """In each local worker process: report progress to the parent, and die with it (SIGINT is
    ignored from birth: see _run_pool)."""
    global _progress_queue
    _progress_queue = progress_queue
    signal.signal(signal.SIGTERM, _worker_sigterm)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="k3lab-parent-watch").start()


def _worker_sigterm(signum: int, frame: Any) -> None:
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


@dataclass(frozen=True)
class RunOptions:
    outtype: str = "auto"
    basename: str | None = None  # the model's default
    chat_template: str | None = None
    force: bool = False


def prepare(
    model: Model,
    spec: SourceSpec,
    out_dir: str | Path,
    options: RunOptions = RunOptions(),
    say: Callable[[str], None] | None = None,
) -> tuple[Plan, list | None]:
    """The plan for this output folder, every input checked: the saved one when it can be trusted
    and its inputs are unchanged, else a new one with the KVs to save (``say`` hears which files a
    moved source changes). Writes nothing."""
    basename = check_basename(options.basename or model.default_basename)
    folder = OutputFolder(out_dir)
    folder.check_state_dir()
    source = spec.open_fresh()
    source.fetch_meta()
    saved = folder.load_plan(model)
    if saved is not None and still_current(
        saved, source, plan_options(options.outtype, basename, options.chat_template)
    ):
        return saved, None
    plan, kvs = make_plan(model, source, options.outtype, basename, options.chat_template)
    if saved is not None and say is not None:
        say(describe_change(saved, plan))
    return plan, kvs


def describe_change(saved: Plan, plan: Plan) -> str:
    """One line: what a new plan changes against the saved one (a source that moved, new options)."""
    before, after = saved.inputs.get("pinned") or {}, plan.inputs.get("pinned") or {}
    old = {f.number: f.digest for f in saved.files}
    changed = [f.number for f in plan.files if old.get(f.number) != f.digest]
    moved = [f"{k} {before.get(k, '?')[:12]} -> {after[k][:12]}" for k in after if before.get(k) != after[k]]
    what = f"the source moved ({', '.join(moved)})" if moved else "the inputs changed"
    if not changed:
        return f"{what}: no output file changes; finished files are kept"
    return (
        f"{what}: {len(changed)} of {len(plan.files)} output files change "
        f"({_ranges(changed)}) and are converted again; the others are kept"
    )


def _ranges(numbers: list[int]) -> str:
    """1,2,3,5 -> '1-3,5' (as --shards takes them)."""
    spans: list[list[int]] = []
    for k in sorted(set(numbers)):
        if spans and spans[-1][1] == k - 1:
            spans[-1][1] = k
        else:
            spans.append([k, k])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


@contextlib.contextmanager
def start_run(
    model: Model,
    spec: SourceSpec,
    out_dir: str | Path,
    options: RunOptions = RunOptions(),
    run_token: str | None = None,
    shards: list[int] | str | None = None,
    say: Callable[[str], None] | None = None,
) -> Iterator[tuple[Plan, str, list[int]]]:
    """Plan and pick the files (failing before anything is written), then hold the folder for the
    block: lock, save a new plan, remove what a killed run left. With ``run_token``, join the run
    holding the lock."""
    plan, kvs = prepare(model, spec, out_dir, options, say)
    numbers = shards if isinstance(shards, list) else parse_shards(shards, len(plan.files))
    folder = OutputFolder(out_dir)
    with folder.hold(run_token) as token:
        if kvs is not None:
            folder.save_plan(plan, kvs)
        if run_token is None:
            folder.remove_partials()
        yield plan, token, numbers


def gives_up(e: K3LabError) -> bool:
    """After this failure a run starts no more files: the machine's or the network's trouble (a full
    disk, the Hub down past its retry budget) would fail them all, one budget each."""
    return isinstance(e, MachineError)


class RunFailed(K3LabError):
    """Some output files failed (others may be done): every one listed, then how to resume. Exit 1
    when every failure is the machine's or the network's, 2 when one is the input's."""

    def __init__(self, failures: list[tuple[int, str, K3LabError]], total: int, not_attempted: list[int]):
        numbers = sorted([k for k, _, _ in failures] + not_attempted)
        lines = [f"output file {k} ({file}): {e}" for k, file, e in sorted(failures, key=lambda f: f[0])]
        skipped = f", {len(not_attempted)} not attempted" if not_attempted else ""
        lines.append(
            f"{len(failures)} of {total} output files failed{skipped}; finished files are kept: run the "
            f"same command again to convert the rest (they are {_ranges(numbers)})"
        )
        super().__init__("\n".join(lines))
        self.exit_code = 1 if all(isinstance(e, MachineError) for _, _, e in failures) else 2


def convert_shards(
    model: Model,
    spec: SourceSpec,
    out_dir: str | Path,
    shards: list[int] | str | None = None,
    jobs: int = 1,
    quiet: bool | None = False,
    scheduler: str | None = None,
    options: RunOptions = RunOptions(),
    run_token: str | None = None,
    publication: Publication | None = None,
) -> list[FileResult]:
    """Convert the given output files (a list, a ``--shards`` string, or None: all), in this process,
    ``jobs`` at a time, or one Dask task each on the cluster at ``scheduler``; merge the manifest.
    With ``publication``, every task publishes its file to the Hub repo from where it ran (on Dask
    each worker writes into a folder of its own: nothing is shared but the Hub) and the run commits
    them. Progress: none when ``quiet`` (errors only); shown on a terminal only when False; always
    when None (a notebook, whose output is no terminal)."""
    say = None if quiet else _say
    with start_run(model, spec, out_dir, options, run_token, shards, say) as (plan, token, numbers):
        spec = spec.with_options(plan.inputs.get("pinned") or {})  # every task reads what was planned
        push = publication.target if publication else None
        private = bool(push and scheduler)
        task = Task(
            plan.model, str(out_dir), spec, plan.inputs_digest, options.force, token, "", push, private
        )
        return _convert_planned(plan, task, numbers, jobs, quiet, scheduler, publication)


def _say(line: str) -> None:
    print(f"k3lab: {line}", file=sys.stderr, flush=True)


class Results(list):
    """The run's finished files; ``then(result)`` hears of each new one as it arrives (the commits of
    a published run)."""

    def __init__(self, then: Callable[[FileResult], None] | None = None):
        super().__init__()
        self.then = then

    def append(self, result: FileResult) -> None:
        super().append(result)
        if self.then is not None and not result.skipped:
            self.then(result)


def _convert_planned(
    plan: Plan,
    task: Task,
    numbers: list[int],
    jobs: int,
    quiet: bool | None,
    scheduler: str | None,
    publication: Publication | None = None,
) -> list[FileResult]:
    folder = OutputFolder(task.out_dir)
    committer = _committer(plan, publication, task.force) if publication else None
    results = Results(functools.partial(_record_published, folder, committer) if committer else None)
    todo = []
    for k in numbers:  # complete files are found here, not sent anywhere
        pf = plan.file(k)
        if committer is not None:
            done = None if task.force else published(committer.state, pf.filename, pf.digest)
            if done is not None:  # in the repo already: its record is the resume evidence
                folder.write_record(done)
                results.append(FileResult(k, pf.filename, True, 0.0, pf.nbytes))
                continue
        elif not task.force and folder.is_complete(k, pf.filename, pf.digest):
            results.append(FileResult(k, pf.filename, True, 0.0, pf.nbytes))
            continue
        todo.append(k)
    failures: dict[int, K3LabError] = {}
    disable = {True: True, False: None, None: False}[quiet]  # tqdm's None: bars on a terminal only
    bar = tqdm(
        total=sum(plan.file(k).source_bytes for k in todo),
        unit="B",
        unit_scale=True,
        desc=f"{len(todo)} files",
        disable=disable if todo else True,
    )
    progress = RunProgress(bar)
    late: list[BaseException] = []
    stopped = True
    try:
        if todo and scheduler:
            from k3lab.pipeline.cluster import run_on_dask

            run_on_dask(
                run_task,
                task,
                todo,
                scheduler,
                progress,
                results,
                failures,
                lambda k: plan.file(k).source_bytes,
                folder.export_plan() if task.private else None,
            )
        elif todo and jobs <= 1:
            _run_here(task, todo, progress, results, failures)
        elif todo:
            _run_pool(task, todo, jobs, progress, results, failures)
        stopped = False
    finally:
        for r in results:
            if not r.skipped:
                progress.finished(r.number, plan.file(r.number).source_bytes)
        bar.close()
        task.source.open().close()
        published_to = None
        if committer is not None and not stopped:  # (Ctrl-C: nothing more is written)
            try:
                published_to = _final_commit(committer, plan, publication, complete=not failures)
            except K3LabError as e:
                late.append(e)
        try:
            folder.merge(published_to)
        except K3LabError as e:  # (a full disk) reported after the errors that came first
            late.append(e)
    if failures:
        if len(failures) == 1:  # one line (a failed merge after it is the same trouble, said once)
            raise next(iter(failures.values()))
        done = {r.number for r in results} | set(failures)
        raise RunFailed(
            [(k, plan.file(k).source_file, e) for k, e in failures.items()],
            len(numbers),
            [k for k in todo if k not in done],
        )
    if late:
        raise late[0]
    return sorted(results, key=lambda r: r.number)


def _committer(plan: Plan, publication: Publication, force: bool) -> Committer:
    """The target repo opened (made if missing; another set there refused unless --force)."""
    planned = {pf.filename: pf.digest for pf in plan.files}
    state = open_target(publication.target, planned, force or publication.force)
    # --force: the other set's split files go in the same commits as this one's
    stale = tuple(r.file for r in state.records.values() if r.is_text and r.file not in planned)
    return Committer(publication.target, state, publication.commit_every, stale)


def _record_published(folder: OutputFolder, committer: Committer, result: FileResult) -> None:
    """A task's published file: its record kept here (the worker's folder may be another machine's)
    and its upload committed with the next batch."""
    if result.record is None:
        return
    record = Record.from_json(result.record, f"the result of output file {result.number}")
    folder.write_record(record)
    committer.add(result.upload, record)


def _final_commit(
    committer: Committer, plan: Plan, publication: Publication, complete: bool
) -> dict[str, str]:
    """The last commit: what is pending and the manifest, and (the set complete) the extra files."""
    records = list(committer.records.values())
    whole = complete and {r.file for r in records if r.is_text} >= {pf.filename for pf in plan.files}
    extra = publication.extra_files(plan, records) if whole and publication.extra_files else None
    commit = committer.commit(extra, "k3lab: the whole set" if extra else "")
    target = publication.target
    return {"repo": target.repo, "branch": target.branch, "commit": commit or committer.state.commit}


def _run_here(task: Task, todo: list[int], progress: RunProgress, results: list, failures: dict) -> None:
    global _progress_queue
    q: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    _progress_queue = q
    try:
        for i, k in enumerate(todo):
            try:
                results.append(run_task(task, k, todo[i + 1] if i + 1 < len(todo) else None))
            except K3LabError as e:  # a bad shard does not stop the others; the machine's trouble does
                failures[k] = e
                if gives_up(e):
                    break
            _drain(q, progress)
    finally:
        _progress_queue = None
        _drain(q, progress)


def _run_pool(
    task: Task, todo: list[int], jobs: int, progress: RunProgress, results: list, failures: dict
) -> None:
    ctx = mp.get_context("spawn")
    # workers are born ignoring SIGINT (an ignored signal stays ignored across exec, and Python then
    # installs no KeyboardInterrupt handler): Ctrl-C reaches the whole group, but only this process
    # decides how the run stops, even while a worker is still starting up
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        q = ctx.Queue()
        pool = ProcessPoolExecutor(
            max_workers=min(jobs, len(todo)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(q, os.getpid()),
        )
        pending = {pool.submit(run_task, task, k): k for k in todo}
    finally:
        signal.signal(signal.SIGINT, previous)
    stopping = False
    busy: dict[int, int] = {}  # pid -> the file it converts
    workers: dict[int, Any] = {}  # pid -> its Process (the pool forgets them once broken)
    try:
        while pending:
            _drain(q, progress, busy)
            workers.update(getattr(pool, "_processes", None) or {})
            for f in [f for f in pending if f.done()]:
                k = pending.pop(f)
                try:
                    results.append(f.result())
                except K3LabError as e:
                    failures[k] = e
                    if gives_up(e):  # files not begun yet are left for the rerun
                        for other in [f for f in pending if f.cancel()]:
                            pending.pop(other)
                except BrokenProcessPool:
                    _drain(q, progress, busy)
                    died = _worker_died(workers, busy, results, lambda: _left_partials(task, todo))
                    failures[died[0] or k] = died[1]
                    pending.clear()
                    break
            time.sleep(0.05)
        _drain(q, progress, busy)
    except BaseException:  # Ctrl-C, SIGTERM: stop the workers now, not after their remaining shards
        stopping = True
        raise
    finally:
        if stopping:
            _stop_workers(pool)
            # a worker whose cleanup outlasted the grace was killed with its .partial left; this run
            # holds the folder's lock, so every .partial there is its own
            OutputFolder(task.out_dir).remove_partials()
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
    plan = _task_plan(task.model, task.out_dir, task.plan_digest)
    folder = OutputFolder(task.out_dir)
    return [k for k in todo if folder.output(plan.file(k).filename + ".partial").exists()]


def _worker_died(
    workers: dict[int, Any], busy: dict[int, int], results: list[FileResult], left: Callable[[], list[int]]
) -> tuple[int | None, MachineError]:
    """A worker killed from outside (the OOM killer, kill -9): the file it converted (if known) and one
    line naming it and the signal."""
    done = {r.number for r in results}
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
            f"worker for shard {busy[p.pid]} died ({how}); finished files are kept: run the command again"
        )
    idle = [p for p in workers.values() if p.exitcode and p.exitcode != -signal.SIGTERM]
    how = f" (signal {-idle[0].exitcode})" if idle and idle[0].exitcode < 0 else ""
    return None, MachineError(
        f"a worker process died{how} before it began a shard; finished files are kept: run the command again"
    )
