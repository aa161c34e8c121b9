"""``k3lab quantize``: variants of a finished set, as a run of the one loop (``running.runner``): the
set's folder held, every variant planned and saved first, then a task per file (here, ``--jobs``
processes or Dask) making that file of each variant, and, publishing, uploading it from there."""

from __future__ import annotations

import sys

from k3lab.pipeline.model import Model
from k3lab.pipeline.publishing.publish import Publication
from k3lab.pipeline.quantizing.start import start_variants
from k3lab.pipeline.quantizing.variant import Variant
from k3lab.pipeline.running.runner import run_planned
from k3lab.pipeline.running.start import RunOptions
from k3lab.pipeline.running.task import Task
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.writing.convert import FileResult


def quantize_set(
    model: Model,
    set_dir: str,
    variants: tuple[Variant, ...],
    shards: list[int] | str | None = None,
    jobs: int = 1,
    quiet: bool | None = False,
    scheduler: str | None = None,
    force: bool = False,
    threads: int | None = None,
    publication: Publication | None = None,
) -> list[FileResult]:
    """Make ``variants`` of the finished set in ``set_dir``, file by file, in this process, ``jobs`` at
    a time, or as Dask tasks (the set's folder shared); with ``publication``, each file is uploaded
    into its variant's folder of the repo from where it was made, and committed by this client."""
    say = None if quiet else _say
    with start_variants(model, set_dir, variants, shards, say, force) as (plan, token, numbers, _):
        labels = tuple(v.label for v in variants)
        spec = SourceSpec.local(set_dir, set_dir)  # (read by nothing: the set's files are the source)
        push = publication.target if publication else None
        task = Task(
            model, set_dir, spec, plan.inputs_digest, force, token, "", push, False, labels, False, threads
        )
        options = RunOptions(force=force)
        return run_planned(plan, task, numbers, jobs, quiet, scheduler, publication, options, say)


def _say(line: str) -> None:
    print(f"k3lab: {line}", file=sys.stderr, flush=True)
