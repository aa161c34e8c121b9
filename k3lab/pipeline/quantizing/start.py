"""Starting a variant run: every variant planned against the set's saved plan before anything is
written (a variant llama-quantize would refuse is one line here), then the plans saved in their
folders (``OUT/LABEL/.k3lab/variant.json``) while the run holds the set's folder; what the run's
tasks need to find them (their labels)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from k3lab.errors import K3LabError
from k3lab.formats.gguf_stream import KV
from k3lab.pipeline.model import Model
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.quantizing.variant import Variant, VariantPlan, plan_variant
from k3lab.pipeline.state import OutputFolder
from k3lab.values import output_files


def plan_variants(
    plan: Plan, kvs: list[KV], variants: Sequence[Variant], forecast: bool = False
) -> list[VariantPlan]:
    """Each variant's plan (ggml's version from the library that will quantise: loaded here, so a
    machine without llama-cpp-python is told so before any work); ``forecast``: sizes only."""
    from k3lab.formats.ggml import ggml

    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise K3LabError(f"variants {', '.join(labels)}: each needs a name of its own (--label)")
    version = ggml().version
    return [plan_variant(plan, kvs, v, version, forecast) for v in variants]


def save_variants(out_dir: str, plans: Sequence[VariantPlan]) -> None:
    """Each plan into its folder (what a killed earlier run left there removed first, and the files
    of another split of the set, with their records: a manifest never lists both)."""
    folder = OutputFolder(out_dir)
    for vp in plans:
        vf = folder.variant(vp.label)
        vf.create()
        vf.remove_partials()
        vf.variant_plan.save(vp)
        if vf.records.retire(vp):
            vf.records.merge(made_as=vp.made_as())


def _asked(vp: VariantPlan) -> dict[str, str]:
    """What a user asked a variant to be (never what follows from the set: a set made again makes its
    variants again without asking)."""
    import json

    return {
        "type and flags": json.dumps(vp.spec.to_json(), sort_keys=True),
        "recipe": vp.recipe or "none",
        "imatrix": vp.imatrix.sha256[:12] if vp.imatrix is not None else "none",
    }


def _not_another_request(folder: OutputFolder, vp: VariantPlan) -> None:
    """A label that holds a variant made as another request (another type, flags, recipe or imatrix)
    is the user's work: one line, unless ``--force``."""
    vf = folder.variant(vp.label)
    saved = vf.variant_plan.load() if vf.path.is_dir() else None
    if saved is None or not any(r is not None for r in vf.records.all()):
        return
    before, now = _asked(saved), _asked(vp)
    changed = [k for k in now if before[k] != now[k]]
    if changed:
        what = changed[0]
        said = f"{before[what]} -> {now[what]}" if what != "type and flags" else "another type or flags"
        raise K3LabError(
            f"{vf.path}: holds {saved.label} made as another request ({what}: {said}): give the new one "
            "another --label, or --force to replace it"
        )


@contextlib.contextmanager
def start_variants(
    model: Model,
    set_dir: str,
    variants: Sequence[Variant],
    shards: str | list[int] | None = None,
    say: Callable[[str], None] | None = None,
    force: bool = False,
) -> Iterator[tuple[Plan, str, list[int], list[VariantPlan]]]:
    """A run making variants of the finished set in ``set_dir`` (``k3lab quantize``): planned, the
    chosen files checked finished, then the set's folder held (no conversion may change a file while
    it is read) and the plans saved. Yields (the set's plan, the run's token, files, variant plans)."""
    folder = OutputFolder(set_dir)
    plan = folder.plans.require(model)
    vplans = plan_variants(plan, folder.plans.kvs(plan), variants)
    from k3lab.pipeline.quantizing.costs import predicted_loss

    for vp in vplans:
        vp.predicted_loss = predicted_loss(folder, vp)
    for vp in vplans:  # (a folder that is a link, or holds a link for .k3lab: one line, before anything)
        folder.variant(vp.label).check_state_dir()
        if not force:
            _not_another_request(folder, vp)
    numbers = output_files(
        ",".join(map(str, shards)) if isinstance(shards, list) else shards, len(plan.files)
    )
    missing = [
        k for k in numbers if not folder.records.is_complete(k, plan.file(k).filename, plan.file(k).digest)
    ]
    if missing:
        first = plan.file(missing[0]).filename
        raise K3LabError(
            f"{folder.output(first)}: not a finished file of the set ({len(missing)} of {len(numbers)} are "
            "not): a variant is made from the lossless files; convert them first (or give --files)"
        )
    if say is not None:
        for vp in vplans:
            for note in vp.notes:
                say(note)
    with folder.hold() as token:
        save_variants(set_dir, vplans)
        yield plan, token, numbers, vplans
