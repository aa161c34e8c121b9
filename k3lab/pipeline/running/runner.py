"""Run a conversion: the one loop. Plan once (or load the saved plan), then convert the chosen output
files in this process, in ``jobs`` worker processes (``processes``), or as one Dask task each on the
cluster at ``scheduler`` (``cluster``); every file is a ``task.run_task``. Publish them when asked
(``publish``), list what failed, and merge the manifest."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from k3lab.children import isolated_spawning
from k3lab.errors import K3LabError, MachineError
from k3lab.pipeline.model import Model
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.progress import RunProgress, byte_bar
from k3lab.pipeline.publishing.card import extra_files
from k3lab.pipeline.publishing.publish import Committer, Publication, open_committer, published
from k3lab.pipeline.publishing.upload import upload
from k3lab.pipeline.running.processes import run_here, run_pool
from k3lab.pipeline.running.start import RunOptions, _ranges, start_run
from k3lab.pipeline.running.task import Task, gives_up, run_task
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.record import Published
from k3lab.pipeline.streams import load_streams
from k3lab.pipeline.writing.convert import FileResult, is_converted
from k3lab.pipeline.writing.single import make_beside


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
    options: RunOptions | None = None,
    run_token: str | None = None,
    publication: Publication | None = None,
) -> list[FileResult]:
    """Convert the given output files (a list, a ``--shards`` string, or None: all), in this process,
    ``jobs`` at a time, or one Dask task each on the cluster at ``scheduler``; merge the manifest.
    With ``publication``, every task publishes its file (and its variants') from where it ran (on Dask
    in a folder of its own: nothing is shared but the Hub) and the run commits them. Progress: none
    when ``quiet``; on a terminal only when False; always when None (a notebook's output is no terminal)."""
    options = options or RunOptions()
    if publication and scheduler and any(v.imatrix and not v.imatrix.repo for v in options.variants):
        raise K3LabError("--imatrix: workers sharing nothing but the Hub read it there: give ORG/NAME:PATH")
    say = None if quiet else _say
    if scheduler is None:  # the files of numba's kernel read while the plan is made, before the disk is busy
        load_streams(model.transforms.values(), warm=True)
    with start_run(model, spec, out_dir, options, run_token, shards, say) as (plan, token, numbers):
        spec = spec.with_options(plan.inputs.get("pinned") or {})  # every task reads what was planned
        push = publication.target if publication else None
        private = bool(push and scheduler)
        labels = tuple(v.label for v in options.variants)
        task = Task(
            plan.model,
            str(out_dir),
            spec,
            plan.inputs_digest,
            options.force,
            token,
            "",
            push,
            private,
            labels,
        )
        return run_planned(plan, task, numbers, jobs, quiet, scheduler, publication, options, say)


def _say(line: str) -> None:
    print(f"k3lab: {line}", file=sys.stderr, flush=True)


def run_planned(
    plan: Plan,
    task: Task,
    numbers: list[int],
    jobs: int,
    quiet: bool | None,
    scheduler: str | None,
    publication: Publication | None,
    options: RunOptions,
    say: Callable[[str], None] | None = None,
) -> list[FileResult]:
    folder = OutputFolder(task.out_dir)
    saved = folder.variant_plans(task.variants)  # (each task checks the plan it finds is this one)
    task = dataclasses.replace(task, variant_digests=tuple(saved[v].digest if v in saved else "" for v in task.variants))  # fmt: skip
    committer = open_committer(plan, publication, say or _say) if publication else None
    if committer is not None:
        committer.made_as.update({v: vp.made_as() for v, vp in saved.items()})
    results, todo = _found_complete(plan, task, numbers, folder, committer)
    bar = _bar(plan, task, todo, quiet)
    progress = RunProgress(bar)
    failures: dict[int, K3LabError] = {}
    late: list[BaseException] = []
    stopped = True
    try:
        if todo:

            def finished(result: FileResult) -> None:
                results.append(result)
                made = [(None, result.record, result.upload)] + [
                    (v.label, v.record, v.upload) for v in result.variants
                ]
                for label, record, uploaded in made if committer is not None else ():
                    if record is not None:  # (kept here: the worker's folder may be another machine's)
                        folder.keep_record(record, label)
                        committer.add(uploaded, record, label or "")

            halt = threading.Event()
            failures = collect(
                _executor(plan, task, todo, jobs, scheduler, progress, halt, folder), halt, finished
            )
        stopped = False
    finally:
        for r in results:
            if not r.skipped:
                progress.finished(r.number, _work(plan, task, r.number))
        bar.close()
        open_source(task.source).close()
        published_to = None
        if committer is not None and publication is not None and not stopped:  # (Ctrl-C: nothing more)
            try:
                if not failures:
                    _publish_beside(committer, publication, plan, task, options)
                published_to = _final_commit(committer, plan, publication, not failures, task.out_dir)
            except K3LabError as e:
                late.append(e)
        try:
            folder.merge_manifests(task.convert, task.variants, published_to)
        except K3LabError as e:  # (a full disk) reported after the errors that came first
            late.append(e)
    if failures:
        if len(failures) == 1:  # one line (a failed merge after it is the same trouble, said once)
            raise next(iter(failures.values()))
        done = {r.number for r in results} | set(failures)
        raise RunFailed(
            [(k, plan.file(k).filename, e) for k, e in failures.items()],
            len(numbers),
            [k for k in todo if k not in done],
        )
    if late:
        raise late[0]
    return sorted(results, key=lambda r: r.number)


def collect(
    outcomes: Iterator[tuple[int, Any]], halt: threading.Event, finished: Callable[[Any], None]
) -> dict[int, K3LabError]:
    """The one failure loop, whatever runs the tasks (this process, ``--jobs`` processes, Dask) and
    whatever they do (convert a file, run a notebook): each result to ``finished``, each failure kept
    by file; after a failure every file would share (the machine's or the network's: a full disk,
    the Hub down past its budget) ``halt`` is set, so that no new task starts."""
    failures: dict[int, K3LabError] = {}
    for k, outcome in outcomes:
        if isinstance(outcome, K3LabError):
            failures[k] = outcome
            if gives_up(outcome):
                halt.set()
            continue
        finished(outcome)
    return failures


def run_notebooks(
    model: Model,
    spec: SourceSpec,
    out_dir: str | Path,
    options: RunOptions,
    notebook: str | Path,
    shards: list[int] | str | None,
    scheduler: str | None,
    workers: int,
    run_dir: Path,
    timeouts: tuple[float, float],
    say: Callable[[str], None] | None = None,
) -> list[Any]:
    """``notebook`` once per chosen output file with papermill, as tasks of one run holding the folder
    (the notebooks convert into it as part of it), on Dask: the cluster at ``scheduler``, or a
    LocalCluster of ``workers`` processes. Every file's run, failed ones too; the manifest merged
    when a file was converted."""
    results: list[Any] = []
    try:
        with start_run(model, spec, out_dir, options, None, shards, say) as (_, token, numbers):
            results = _run_notebooks(
                notebook, spec, out_dir, numbers, token, scheduler, workers, run_dir, timeouts, say
            )
            if any(r.status != "ok" for r in results):
                raise _NotAllRan(results)  # (as a failed convert: a run that finished no file leaves nothing)
    except _NotAllRan as e:
        results = e.results
    return sorted(results, key=lambda r: r.file)


class _NotAllRan(Exception):
    """Some notebook failed: raised inside the folder's block so the folder treats the run as failed
    (what it made goes when no file was finished), caught outside it to return every result."""

    def __init__(self, results: list[Any]):
        self.results = results


def _run_notebooks(  # (the block of run_notebooks holding the folder)
    notebook: str | Path,
    spec: SourceSpec,
    out_dir: str | Path,
    numbers: list[int],
    token: str,
    scheduler: str | None,
    workers: int,
    run_dir: Path,
    timeouts: tuple[float, float],
    say: Callable[[str], None] | None,
) -> list[Any]:
    from tqdm.auto import tqdm  # a widget bar in a notebook, a text bar on a terminal

    from k3lab.pipeline.running.batch import NotebookRun, notebook_task, run_notebook
    from k3lab.pipeline.running.cluster import run_on_dask

    run_dir.mkdir(parents=True, exist_ok=True)
    task = notebook_task(notebook, spec.meta_dir, spec.location, out_dir, run_dir, token, *timeouts)
    cluster = None
    if not scheduler:
        from distributed import LocalCluster

        with isolated_spawning():  # (its workers isolated from the current folder: k3lab.children)
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=None)
        scheduler = cluster.scheduler_address
    results: list[NotebookRun] = []
    bar = tqdm(
        total=len(numbers), desc="notebooks", unit="file", disable=say is None or None, dynamic_ncols=True
    )
    try:
        halt = threading.Event()
        outcomes = run_on_dask(run_notebook, task, numbers, scheduler, RunProgress(bar), halt, lambda k: 0)
        failures = collect(outcomes, halt, lambda r: (results.append(r), bar.update(1)))
    finally:
        bar.close()
        if cluster is not None:
            cluster.close()
        folder = OutputFolder(out_dir)
        if folder.records.all() or folder.manifest.exists():  # (notebooks that only looked: no manifest)
            folder.records.merge()
    results += [NotebookRun(k, "failed", 0.0, "", str(e).splitlines()[0]) for k, e in failures.items()]
    return results


def _found_complete(
    plan: Plan, task: Task, numbers: list[int], folder: OutputFolder, committer: Committer | None
) -> tuple[list[FileResult], list[int]]:
    """The chosen files already done (in the folder, or, publishing, in the repo: its record is the
    resume evidence), found here and sent nowhere; and those to do."""
    done, todo = [], []
    source = open_source(task.source) if task.convert and task.source.changes_in_place else None
    for k in numbers:
        pf = plan.file(k)
        if task.force:
            todo.append(k)
            continue
        if committer is not None:
            found = published(committer.state, pf.filename, pf.digest, k) if task.convert else True
            theirs = [_variant_published(committer, folder, label, k) for label in task.variants]
            if found is not None and all(theirs):
                if task.convert:
                    folder.records.write(found)  # type: ignore[arg-type]
                done.append(FileResult(k, pf.filename, True, 0.0, pf.nbytes, variants=theirs))  # type: ignore[arg-type]
                continue
        elif not task.convert or is_converted(folder, k, pf, source):
            variants = [_variant_done(folder, label, k) for label in task.variants]
            if all(variants):
                done.append(FileResult(k, pf.filename, True, 0.0, pf.nbytes, variants=variants))  # type: ignore[arg-type]
                continue
        todo.append(k)
    return done, todo


def _variant_done(folder: OutputFolder, label: str, k: int) -> FileResult | None:
    """File ``k`` of variant ``label``, when it is complete."""
    variant = folder.variant(label)
    vp = variant.variant_plan.load()
    if vp is None or not folder.variant_file_complete(label, k, vp.file(k).filename, vp.file(k).digest):
        return None
    return FileResult(k, vp.file(k).filename, True, 0.0, vp.file(k).nbytes, label=label)


def _variant_published(committer: Committer, folder: OutputFolder, label: str, k: int) -> FileResult | None:
    """File ``k`` of variant ``label`` when the repo holds it as this plan makes it (its record kept here)."""
    vp = folder.variant(label).variant_plan.load()
    found = published(committer.state, vp.file(k).filename, vp.file(k).digest, k, label) if vp else None
    if found is None:
        return None
    folder.variant(label).records.write(found)
    committer.add(None, found, label)
    return FileResult(k, found.file, True, 0.0, found.size, label=label)


def _work(plan: Plan, task: Task, k: int) -> int:
    """File ``k``'s share of the run's bar: the source bytes converted, and the set's bytes each
    variant reads."""
    folder = OutputFolder(task.out_dir)
    work = plan.file(k).source_bytes if task.convert else 0
    for label in task.variants:
        vp = folder.variant(label).variant_plan.load()
        work += vp.file(k).source_bytes if vp is not None else 0
    return work


def _bar(plan: Plan, task: Task, todo: list[int], quiet: bool | None) -> Any:
    """The run's one byte bar (source bytes converted and quantised; bytes down and up beside them)."""
    disable = {True: True, False: None, None: False}[quiet]  # tqdm's None: bars on a terminal only
    return byte_bar(sum(_work(plan, task, k) for k in todo), f"{len(todo)} files", disable if todo else True)


def _executor(
    plan: Plan,
    task: Task,
    todo: list[int],
    jobs: int,
    scheduler: str | None,
    progress: RunProgress,
    halt: threading.Event,
    folder: OutputFolder,
) -> Iterator[tuple[int, FileResult | K3LabError]]:
    """Where the tasks run: on the Dask cluster at ``scheduler``, in ``jobs`` worker processes, or
    here; each yields ``(k, result or error)``."""
    if scheduler:
        from k3lab.pipeline.running.cluster import run_on_dask

        state = folder.exported_plans(task.variants) if task.private else None
        return run_on_dask(
            run_task, task, todo, scheduler, progress, halt, lambda k: _work(plan, task, k), state
        )
    if jobs <= 1:
        return run_here(task, todo, progress, halt)
    return run_pool(task, todo, jobs, progress, halt)


def _publish_beside(
    committer: Committer, publication: Publication, plan: Plan, task: Task, options: RunOptions
) -> None:
    """The files beside the set (the mmproj, the tokenizer GGUF), made here as part of this run and
    uploaded like the set's files (the local copies go unless ``keep_local``); committed with the
    set's last files. A run that uploaded nothing to a repo holding them already makes none."""
    target = publication.target
    if not publication.beside:  # (--text-only)
        return
    if committer.uploaded == 0 and any(not r.is_text for r in committer.state.records.values()):
        return
    folder = OutputFolder(task.out_dir)
    made = make_beside(
        plan.model, task.source, task.out_dir, plan.basename, options.chat_template, task.run_token
    )
    for rec in made:
        op = upload(target, folder.output(rec.file))  # (a blob the repo has already is not sent again)
        rec.sha256 = op.upload_info.sha256.hex()
        folder.records.write(rec)
        committer.add(op, rec)
        if not target.keep_local:
            folder.remove_output(rec.file)


def _final_commit(
    committer: Committer, plan: Plan, publication: Publication, complete: bool, out_dir: str
) -> Published:
    """The last commit: what is pending and the manifest, and (the set complete) the extra files."""
    records = list(committer.records.values())
    whole = complete and {r.file for r in records if r.is_text} >= {pf.filename for pf in plan.files}
    kvs = OutputFolder(out_dir).plans.kvs(plan) if whole else []
    extra = (
        extra_files(plan.model, plan, records, kvs, publication.target, committer.variant_table())
        if whole
        else None
    )
    commit = committer.commit(extra, "k3lab: the whole set" if extra else "")
    target = publication.target
    return Published(target.repo, target.branch, committer.made, commit or committer.state.commit)
