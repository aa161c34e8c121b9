"""Starting a run: the plan for the output folder (the saved one when it can be trusted and its
inputs are unchanged, else a new one), the files chosen, and the folder held for the run (its lock,
the new plan saved, another split's files retired, a killed run's leftovers removed). Nothing is
written before every input is checked."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from k3lab.pipeline.model import Model
from k3lab.pipeline.planning.inputs import still_current
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.planning.planner import make_plan, plan_options
from k3lab.pipeline.planning.split import Split
from k3lab.pipeline.quantizing.variant import Variant
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import Source, SourceSpec
from k3lab.pipeline.state import OutputFolder
from k3lab.values import basename as check_basename
from k3lab.values import output_files


@dataclass(frozen=True)
class RunOptions:
    outtype: str = "auto"
    basename: str | None = None  # the model's default
    chat_template: str | None = None
    force: bool = False
    split: Split | None = None  # how the set is cut into files (None: as the folder's plan has it)
    note: str | None = None  # a line to say once every input is checked (which chat template goes in)
    variants: tuple[Variant, ...] = ()  # quantised variants made of each file as it is converted


def prepare(
    model: Model,
    spec: SourceSpec,
    out_dir: str | Path,
    options: RunOptions | None = None,
    say: Callable[[str], None] | None = None,
    source: Source | None = None,
) -> tuple[Plan, list | None]:
    """The plan for this output folder, every input checked: the saved one when it can be trusted
    and its inputs are unchanged, else a new one with the KVs to save (``say`` hears which files a
    moved source changes). Reads through ``source`` when given (a notebook's, which then knows what
    was fetched). Writes nothing."""
    options = options or RunOptions()
    basename = check_basename(model.default_basename if options.basename is None else options.basename)
    if source is None:
        source = open_source(spec, fresh=True)
        source.fetch_meta()
    saved = OutputFolder(out_dir).plans.load(model)
    # a folder keeps its set's split unless the request names one; a new folder takes the default
    split = options.split or (saved.split if saved is not None else Split())
    if saved is not None and still_current(
        saved, source, plan_options(options.outtype, basename, options.chat_template, split)
    ):
        return saved, None
    from tqdm.auto import tqdm  # a widget bar in a notebook, a text bar on a terminal

    bar = tqdm(
        desc="planning: headers read",
        unit=" file",
        disable=True if say is None else None,
        leave=False,
        dynamic_ncols=True,
    )

    def planned(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        plan, kvs = make_plan(model, source, options.outtype, basename, options.chat_template, planned, split)
    finally:
        bar.close()
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
    options: RunOptions | None = None,
    run_token: str | None = None,
    shards: list[int] | str | None = None,
    say: Callable[[str], None] | None = None,
) -> Iterator[tuple[Plan, str, list[int]]]:
    """Plan and pick the files (failing before anything is written), then hold the folder for the
    block: lock, save a new plan, remove what a killed run left. With ``run_token``, join the run
    holding the lock."""
    options = options or RunOptions()
    plan, kvs = prepare(model, spec, out_dir, options, say)
    if say is not None and options.note:
        say(options.note)  # (after the checks: a run that fails says its one line, nothing before it)
    numbers = (
        output_files(",".join(str(k) for k in shards) or "-", len(plan.files))
        if isinstance(shards, list)
        else output_files(shards, len(plan.files))
    )
    vplans = []
    if options.variants:  # (planned before anything is written: a variant refused is one line)
        from k3lab.pipeline.quantizing.start import plan_variants, save_variants  # (ggml's binding)

        vplans = plan_variants(plan, kvs or OutputFolder(out_dir).plans.kvs(plan), options.variants)
        for note in (n for vp in vplans for n in vp.notes) if say is not None else ():
            say(note)
    with OutputFolder(out_dir).begin(plan, kvs, run_token) as (token, gone):
        if vplans and run_token is None:
            save_variants(str(out_dir), vplans)
        if gone and say is not None:
            say(
                f"the set is now {len(plan.files)} file{'s' if len(plan.files) > 1 else ''} "
                f"({plan.files[0].filename}{' ...' if len(plan.files) > 1 else ''}): removed the "
                f"{len(gone)} files of its earlier split that k3lab wrote here ({gone[0]} ...)"
            )
        yield plan, token, numbers
