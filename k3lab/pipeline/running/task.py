"""The task: one output file converted (and, when publishing, uploaded) wherever it runs, in this
process, a ``--jobs`` worker process or a Dask worker on another machine.

A task is ``run_task(task, number)``: plain values in (the output folder, where the plan is, and a
``SourceSpec``), so the same task runs unchanged anywhere. It loads the saved plan and opens its own
source: a local folder, or the Hub, whence it downloads its shard into scratch, converts it and
deletes it. It reports to its run through a ``TaskReport`` and stops when its run has stopped. This
module also holds what a worker process needs to be stopped cleanly (SIGTERM, its parent gone).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError, MachineError
from k3lab.pipeline.model import Model
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.progress import TaskReport
from k3lab.pipeline.publishing.upload import PushTarget, upload
from k3lab.pipeline.running import worker
from k3lab.pipeline.running.events import worker_channel
from k3lab.pipeline.running.stages import held, leave_pool, worker_stages
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.names import SCRATCH_NAME
from k3lab.pipeline.writing.convert import FileResult, convert_file, worker_name


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
    variants: tuple[str, ...] = ()  # quantised variants of each file, made right after it (their folders)
    convert: bool = True  # False: the set's files are finished already (``k3lab quantize``)
    threads: int | None = None  # threads quantising a variant's rows (default: the process's cores)
    variant_digests: tuple[str, ...] = ()  # each variant's plan as this run saved it (its digest)


@functools.lru_cache(maxsize=2)
def task_plan(model: Model, out_dir: str, plan_digest: str) -> Plan:
    return OutputFolder(out_dir).plans.require(model, plan_digest)


@functools.lru_cache(maxsize=8)
def variant_plan(out_dir: str, label: str, identity: tuple, digest: str | None) -> Any:
    """A variant's saved plan, the one its run saved (``digest``: one line for any other);
    ``identity``: its file's, so an edited or re-made plan is read again."""
    return OutputFolder(out_dir).variant(label).variant_plan.require(digest)


def _variant_plan(out_dir: str, label: str, digest: str | None = None) -> Any:
    from k3lab.pipeline.state.names import STATE_DIR, VARIANT_NAME
    from k3lab.pipeline.state.proof import identity

    found = identity(OutputFolder(out_dir).variant(label).path / STATE_DIR / VARIANT_NAME) or {}
    return variant_plan(out_dir, label, tuple(sorted(found.items())), digest)


def _task_report(task: Task, number: int) -> TaskReport:
    """Where this task's messages go (the run's queue, or Dask's event stream), and how it hears of
    a stop (on Dask: the run's Event; elsewhere signals reach the process itself)."""
    if task.channel:
        emit, stop = worker_channel(task.channel)
        return TaskReport(number, emit, stop)
    return worker.report(number)


def worker_folder(task: Task) -> tuple[str, SourceSpec]:
    """Where this task writes, and the source it reads: the run's folder, or (``private``) a folder
    of this Dask worker's own, ``<worker local directory>/k3lab/out-<plan digest>``, with its
    downloads in ``.../k3lab/scratch``."""
    if not task.private:
        return task.out_dir, task.source
    from distributed import get_worker

    out, scratch = worker_folders(get_worker().local_directory, task.plan_digest)
    return str(out), task.source.with_options({"scratch": str(scratch)})


WORKER_DIR = "k3lab"  # in a Dask worker's local directory


def worker_folders(local_directory: str | os.PathLike, plan_digest: str) -> tuple[Path, Path]:
    """A Dask worker's own output folder and scratch, for a run that shares nothing but the Hub:
    ``<local directory>/k3lab/out-<plan digest>/`` and ``<local directory>/k3lab/scratch/``."""
    root = Path(local_directory) / WORKER_DIR
    return root / f"out-{plan_digest[:16]}", root / SCRATCH_NAME


def run_task(
    task: Task,
    number: int,
    next_number: int | None = None,
    plan_state: dict[str, bytes] | None = None,
    uploads: Any = None,
) -> FileResult:
    """Convert output file ``number`` (and, with ``push``, publish it): the task every runner runs.
    ``plan_state``: the saved plan's files, for a worker writing a folder of its own. ``uploads``: an
    executor the upload goes to, so that it overlaps the next conversion (``result.pending`` then
    says when it is done); on Dask the task leaves the worker's thread pool once its shard is here,
    within the worker's bounds (``stages``)."""
    report = _task_report(task, number)
    report.started(worker_name())
    try:
        report.check(now=True)  # a task the scheduler started as its run stopped does nothing
        out_dir, spec = worker_folder(task)
        folder = OutputFolder(out_dir)
        if plan_state is not None:
            folder.plans.install({k: v for k, v in plan_state.items() if "/" not in k})
            for label in task.variants:  # (exported as "LABEL/variant.json")
                folder.variant(label).variant_plan.install(plan_state[f"{label}/variant"])
        plan = task_plan(task.model, out_dir, task.plan_digest)
        source = open_source(spec)

        stages = worker_stages() if task.channel else None  # on Dask: the worker as a pipeline
        until_uploaded, until_converted = contextlib.ExitStack(), contextlib.ExitStack()

        def acquired() -> None:  # its first files are here: the worker's next task starts now
            if stages is not None:
                leave_pool()
                if task.push is not None:
                    until_uploaded.enter_context(held(stages.outputs, report))
                until_converted.enter_context(held(stages.converting, report))

        # the files a later task reads too are kept: the next task of this process (known here), or
        # on Dask any later output file's (which this worker may well run next)
        if next_number is not None:
            then = tuple(plan.file(next_number).source_names)
        elif stages is not None:
            then = tuple(f for f in plan.file(number).source_names if max(plan.readers_of(f)) > number)
        else:
            then = ()

        def before_commit() -> None:
            report.check(now=True)
            if task.run_token and not task.private:
                folder.lock.check_held(task.run_token)

        with worker.converting():
            with until_uploaded:
                with until_converted:
                    if stages is not None:  # (taken while this task still holds its worker thread)
                        until_converted.enter_context(held(stages.sources, report))
                    push = task.push
                    if task.convert:
                        result = convert_file(
                            plan,
                            number,
                            source,
                            out_dir,
                            task.force,
                            report,
                            before_commit=before_commit,
                            file_sha256=push is not None,
                            acquired=acquired,
                            then=then,
                        )
                    else:
                        acquired()
                        pf = plan.file(number)
                        result = FileResult(number, pf.filename, True, 0.0, pf.nbytes)
                    result.variants = _make_variants(task, out_dir, number, report, before_commit)
                if push is None:
                    return result
                publish = functools.partial(
                    _publish_file,
                    push,
                    folder,
                    plan.file(number).filename,
                    number,
                    report,
                    result,
                    task.convert,
                )
                if stages is not None:
                    with held(stages.uploading, report):
                        publish()
                    return result
                if uploads is not None:  # this process: the upload overlaps the next conversion
                    result.pending = uploads.submit(publish)
                    return result
                publish()
                return result
    finally:
        report.ended()


def _make_variants(
    task: Task, out_dir: str, number: int, report: TaskReport, before_commit: Any
) -> list[FileResult]:
    """File ``number`` of each variant, made from the set's file ``number`` where it was written."""
    if not task.variants:
        return []  # (nothing of ggml's imported)
    from k3lab.pipeline.quantizing.quantize import quantize_file

    made = []
    for i, label in enumerate(task.variants):
        digest = task.variant_digests[i] if i < len(task.variant_digests) else None
        result = quantize_file(
            _variant_plan(out_dir, label, digest),
            number,
            out_dir,
            task.force,
            report,
            before_commit=before_commit,
            file_sha256=task.push is not None,
            n_threads=task.threads,
            hub_token=task.source.token or (task.push.token if task.push else None),
        )
        result.label = label
        made.append(result)
    return made


def _publish_file(
    push: PushTarget,
    folder: OutputFolder,
    filename: str,
    number: int,
    report: TaskReport,
    result: FileResult,
    convert: bool = True,
) -> None:
    """Upload a finished file (when this run converted it) and its variants' from this machine (each
    variant's into its folder of the repo); each record gains its file's SHA-256 and travels back with
    the uploaded operation; the local copies go unless ``keep_local``."""
    made = [(folder, filename, "", result)] if convert else []
    made += [(folder.variant(v.label), v.filename, v.label, v) for v in result.variants]
    for where, name, label, res in made:
        record = where.records.text(number)
        if record is None:  # convert_file or quantize_file has just written or found it: never
            raise K3LabError(f"{where.output(name)}: no record after making it")
        # the file's SHA-256 was made as it was written (a file found complete is hashed by the upload)
        res.upload = upload(push, where.output(name), report, record.sha256, folder=label)
        record.sha256 = res.upload.upload_info.sha256.hex()
        where.records.write(record)
        res.record = record
        if not push.keep_local:
            where.remove_output(name)


def gives_up(e: K3LabError) -> bool:
    """After this failure a run starts no more files: the machine's or the network's trouble (a full
    disk, the Hub down past its retry budget) would fail them all, one budget each."""
    return isinstance(e, MachineError)
