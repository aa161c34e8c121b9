"""Planning: from config.json, the index, the tokenizer files and every shard's header (one in memory
at a time), every output file and tensor, checked before anything is written.

Every source tensor must be used by a rule and every rule must find its sources; every source
tensor's dtype and shape is checked against what the config implies (the model's ``layout``), so a
header that disagrees with the config can never convert, nor verify.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from k3lab.formats.files import file_identity
from k3lab.formats.gguf_stream import KV, TensorInfo
from k3lab.formats.safetensors import TensorEntry
from k3lab.pipeline.model import Model, Rule, TensorSpec
from k3lab.pipeline.planning.forecast import file_memory, vocab_memory
from k3lab.pipeline.planning.inputs import inputs_digest, inputs_fingerprint, proven_inputs
from k3lab.pipeline.planning.plan import (
    FLOAT_DTYPES,
    OUTTYPES,
    Plan,
    PlanError,
    PlannedFile,
    PlannedTensor,
    file_digest,
    kvs_digest,
    output_filename,
    size_label,
)
from k3lab.pipeline.planning.split import Split, group_units
from k3lab.pipeline.sources.base import SourceFile
from k3lab.pipeline.streams import TransformError


def _output_type(rule: Rule, src_dtype: str, outtype: str, where: str) -> GGMLQuantizationType:
    if rule.dtype == "mxfp4":
        return GGMLQuantizationType.MXFP4
    if src_dtype not in FLOAT_DTYPES:
        raise PlanError(f"{where}: is {src_dtype}, expected a float tensor (BF16, F16 or F32)")
    if rule.dtype == "f32":
        return GGMLQuantizationType.F32
    return FLOAT_DTYPES[src_dtype] if outtype == "auto" else FLOAT_DTYPES[outtype.upper()]


FLOAT_SOURCE = ("BF16", "F16", "F32")


def check_entry(e: TensorEntry, spec: TensorSpec | None, bid: int | None, rule: Rule) -> None:
    """A source tensor against what the config says it is: its shape exactly, and its dtype (one of
    ``spec.accepts`` when the model names them; else packed MXFP4 bytes are U8 and any float type
    may hold a float tensor)."""
    if spec is None:
        return  # an optional tensor the layout does not list (a vision bias): its rule checks it
    if spec.accepts:
        dtype_ok = e.dtype in spec.accepts
    else:
        dtype_ok = e.dtype == spec.dtype if spec.dtype not in FLOAT_SOURCE else e.dtype in FLOAT_SOURCE
    if not dtype_ok or e.shape != spec.shape:
        want = "/".join(spec.accepts) if spec.accepts else spec.dtype if spec.dtype == "U8" else "float"
        where = f"layer {bid}" if bid is not None else "output tensors"
        raise PlanError(
            f"{e.file}: tensor {e.name}: {e.dtype} {list(e.shape)}, expected {want} {list(spec.shape)} "
            f"(from config.json; {where}, {rule.note or rule.output_name(bid)})"
        )


def check_stack(
    entries: list[TensorEntry], expected: Mapping[str, TensorSpec], width: int, bid: int | None, rule: Rule
) -> None:
    """A stack of experts (``width`` sources each, expert-major) checked a column at a time: the first
    expert's entries against their specs, every other expert's against the first's dtype and shape
    (one GGUF tensor stacks them: a layout gives a stack's experts one spec, renamed; the last
    expert's spec is compared with the first's to hold it to that). A column that is not uniform is
    checked entry by entry, so the first one at fault is named as ``check_entry`` names it. Kimi-K3
    has 500,000 expert tensors: one by one, this was a third of its plan."""
    for j in range(width):
        column = entries[j::width]
        first, last = column[0], column[-1]
        spec, last_spec = expected.get(first.name), expected.get(last.name)
        check_entry(first, spec, bid, rule)
        same_spec = (spec is None) == (last_spec is None) and (
            spec is None
            or (spec.dtype, spec.shape, spec.accepts) == (last_spec.dtype, last_spec.shape, last_spec.accepts)
        )
        if not same_spec or len(set(map(_DTYPE_SHAPE, column))) > 1:
            for e in column:
                check_entry(e, expected.get(e.name), bid, rule)


_DTYPE_SHAPE = operator.itemgetter(1, 2)  # (a TensorEntry's dtype and shape)
_PAIR_UNIT, _PAIR_NAME = operator.itemgetter(0), operator.itemgetter(1)  # (of a (unit, name) pair)
_NAME, _NBYTES, _FILE = map(operator.itemgetter, (0, 4, 5))  # (a TensorEntry's fields)


def plan_tensor(
    rule: Rule,
    cfg: Any,
    source: Any,
    bid: int | None,
    outtype: str,
    where: str,
    expected: dict[str, TensorSpec],
    unit_tags: frozenset[str],
    config_tags: frozenset[str],
    model: Any,
) -> tuple[PlannedTensor, list[TensorEntry]] | None:
    """One rule at one unit (or none): its sources checked against ``expected`` (what the config
    says each source tensor is), output type and shape decided; with its source entries. ``model``
    gives the transforms."""
    if not rule.applies(unit_tags, config_tags):
        return None
    names = rule.source_names(cfg, bid)
    weight_map = source.weight_map
    missing = [] if all(map(weight_map.__contains__, names)) else [n for n in names if n not in weight_map]
    if missing and rule.optional and len(missing) == len(names):
        return None
    if missing:
        raise PlanError(f"{where}: tensor {missing[0]} is missing ({rule.output_name(bid)} needs it)")
    entries = source.entries(names)
    if rule.per_expert:
        check_stack(entries, expected, len(rule.sources), bid, rule)
    else:
        for e in entries:
            check_entry(e, expected.get(e.name), bid, rule)
    transform = model.transforms[rule.transform]
    try:
        shape = transform.shape(*(e.shape for e in entries), cfg=cfg)
    except TransformError as err:
        raise PlanError(f"{entries[0].file}: tensor {entries[0].name}: {err}") from None
    gtype = _output_type(rule, entries[0].dtype, outtype, f"{entries[0].file}: tensor {entries[0].name}")
    try:
        info = TensorInfo(rule.output_name(bid), gtype, tuple(shape))
        info.nbytes  # noqa: B018 - raises when the last dimension does not fill the type's blocks
    except ValueError as err:
        raise PlanError(f"{entries[0].file}: tensor {entries[0].name}: {err}") from None
    return PlannedTensor(info, rule, bid, cfg, transform, read=sum(map(_NBYTES, entries))), entries


def _choose_variants(rules: list[Rule], cfg: Any, bid: int | None, weight_map: dict[str, str]) -> list[Rule]:
    """Where several rules make one output tensor (a stack of MXFP4-packed experts, or of plain
    ones), the one whose sources the checkpoint holds: a tensor's format is read from the headers,
    never from what the config claims."""
    by_output: dict[str, list[Rule]] = {}
    for r in rules:
        by_output.setdefault(r.output_name(bid), []).append(r)
    chosen = []
    for r in rules:
        group = by_output[r.output_name(bid)]
        if len(group) == 1:
            chosen.append(r)
            continue
        present = next((g for g in group if g.first_source_name(bid) in weight_map), group[0])
        if r is present:
            chosen.append(r)
    return chosen


def _plan_unit(
    model: Model,
    cfg: Any,
    source: Any,
    bid: int | None,
    outtype: str,
    config_tags: frozenset[str],
    where: str,
) -> tuple[list[PlannedTensor], list[list[TensorEntry]]]:
    """Every output tensor of one unit (a layer, or the output tensors), its sources checked; and
    each one's source entries."""
    expected = model.layout(cfg, bid)
    tags = model.unit_tags(cfg, bid)
    applying = [r for r in model.rules if r.applies(tags, config_tags)]
    tensors, entries = [], []
    for rule in _choose_variants(applying, cfg, bid, source.weight_map):
        planned = plan_tensor(rule, cfg, source, bid, outtype, where, expected, tags, config_tags, model)
        if planned is not None:
            tensors.append(planned[0])
            entries.append(planned[1])
    return tensors, entries


def build_plan(
    model: Model,
    cfg: Any,
    source: Any,
    outtype: str = "auto",
    basename: str | None = None,
    chat_template: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    split: Split | None = None,
) -> Plan:
    """``plan_and_kvs``' plan."""
    return plan_and_kvs(model, cfg, source, outtype, basename, chat_template, progress, split)[0]


def plan_and_kvs(
    model: Model,
    cfg: Any,
    source: Any,
    outtype: str = "auto",
    basename: str | None = None,
    chat_template: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    split: Split | None = None,
) -> tuple[Plan, list[KV]]:
    """Plan the conversion of the text model from config, index and every source file's header
    (each in memory only while the units it holds are planned), checking every source tensor is used
    by a rule and every rule finds its sources, with the dtype and shape the config implies. The
    output files are whole units, cut by ``split``, whatever the source's files are.
    ``progress(done, total)`` hears of each unit planned (a Hub source reads headers for it). With
    file 1's KVs, made once (its vocabulary is the costly part)."""
    if outtype not in OUTTYPES:
        raise PlanError(f"--outtype {outtype!r}: choose from {', '.join(OUTTYPES)}")
    split = split or Split()
    basename = basename or model.default_basename
    weight_map: dict[str, str] = source.weight_map
    text_names = list(filter(operator.methodcaller("startswith", model.text_prefix), weight_map))
    others = weight_map.keys() - text_names
    unknown = {n for n in others if not n.startswith(model.other_prefixes)}
    if unknown:
        first = next(n for n in weight_map if n in unknown)  # (the index's first)
        raise PlanError(f"{weight_map[first]}: tensor {first} is not a tensor any rule table knows")
    _check_counts(cfg, text_names)
    if model.check_source is not None:
        model.check_source(cfg, weight_map)
    by_unit: dict[int | None, list[str]] = {}
    # (a unit's names mostly follow each other in the index: grouped a run at a time, at C speed)
    for unit, run in itertools.groupby(zip(map(model.unit_of, text_names), text_names), key=_PAIR_UNIT):
        by_unit.setdefault(unit, []).extend(map(_PAIR_NAME, run))
    bad = sorted(b for b in by_unit if b is not None and not 0 <= b < cfg.n_layer)
    if bad:
        raise PlanError(
            f"{weight_map[by_unit[bad[0]][0]]}: tensor {by_unit[bad[0]][0]} is layer {bad[0]}, "
            f"but the config has {cfg.n_layer} layers"
        )
    config_tags = model.config_tags(cfg)
    units = model.units(cfg)
    # a file's header is kept while the units it holds are planned, then dropped (bounded memory)
    homes = [set(map(weight_map.__getitem__, by_unit.get(bid, ()))) for bid in units]
    last_unit = {file: k for k, home in enumerate(homes) for file in home}
    used: set[str] = set()
    described: dict[str, SourceFile] = {}
    # (unit, its tensors, the source files each reads in order, peak memory)
    planned: list[tuple[int | None, list[PlannedTensor], list[list[str]], int]] = []
    for k, bid in enumerate(units):
        where = next(iter(homes[k])) if len(homes[k]) == 1 else str(source.index_path)
        tensors, entries = _plan_unit(model, cfg, source, bid, outtype, config_tags, where)
        reads = []
        for es in entries:
            used.update(map(_NAME, es))
            paths = dict.fromkeys(map(_FILE, es))  # (one, but for a stack spread over files)
            names = map(_NAME, es) if len(paths) > 1 else [es[0].name]
            reads.append(list(dict.fromkeys(map(weight_map.__getitem__, names))))
        planned.append((bid, tensors, reads, file_memory(tensors, entries)))
        for file in [f for f, last in last_unit.items() if last == k]:
            described[file] = source.source_file(file)  # (while its header is held: read once)
            source.release_header(file)
        if progress is not None:
            progress(k + 1, len(units))
    unused = [n for n in text_names if n not in used]
    if unused:
        raise PlanError(
            f"{weight_map[unused[0]]}: tensor {unused[0]} is not used by any rule (k3lab never drops "
            "a tensor silently)"
        )
    del used, text_names, by_unit  # (the real model's 500,000 names: not held while the vocabulary is made)
    _check_outtype(outtype, [t for _, ts, _, _ in planned for t in ts], source)
    groups = group_units([(sum(t.nbytes for t in ts), len(ts)) for _, ts, _, _ in planned], split)
    files: list[PlannedFile] = []
    for group in groups:
        names: list[str] = []  # the source files, in the order the file's tensors first need them
        tensors = []
        for t, mine in ((t, r) for k in group for t, r in zip(planned[k][1], planned[k][2])):
            names += [f for f in mine if f not in names]
            tensors.append(dataclasses.replace(t, files=tuple(names.index(f) for f in mine)))
        sources = [described[f] if f in described else source.source_file(f) for f in names]
        for f in names:
            source.release_header(f)
        pf = PlannedFile(len(files) + 1, "", sources, tensors, [planned[k][0] for k in group])
        pf.memory = max(planned[k][3] for k in group)
        files.append(pf)
    plan = Plan(model, cfg, outtype, basename, files, split=split)
    if hasattr(source, "release_listing"):
        source.release_listing()
    kvs = plan_kvs(plan, source.meta_dir, chat_template)
    label = size_label(plan, kvs, source.name) if len(files) == 1 else ""
    for f in files:
        f.filename = output_filename(basename, plan.label, f.number, len(files), label)
    plan.kvs_digest = kvs_digest(kvs)
    files[0].memory += vocab_memory(kvs)
    for f in files:
        f.digest = file_digest(plan, f)
    return plan, kvs


def _check_outtype(outtype: str, tensors: list[PlannedTensor], source: Any) -> None:
    """An ``--outtype`` that would change nothing is refused: with MXFP4 tensors (which stay MXFP4:
    k3lab never dequantises), asking for the type the float tensors already have makes the default's
    file, named for its MXFP4, where the user asked for something else."""
    packed = sum(t.info.type == GGMLQuantizationType.MXFP4 for t in tensors)
    floats = [t for t in tensors if t.info.type != GGMLQuantizationType.MXFP4 and t.rule.dtype == "keep"]
    if outtype == "auto" or not packed:
        return
    if all(source.entry(t.sources[0]).dtype == outtype.upper() for t in floats):
        raise PlanError(
            f"--outtype {outtype}: the checkpoint's float tensors are {outtype.upper()} already and its "
            f"{packed} MXFP4 tensors stay MXFP4 (k3lab never dequantises): the file would be the "
            "default's; leave --outtype out"
        )


def _check_counts(cfg: Any, text_names: list[str]) -> None:
    """The config's counts against the index, before anything loops over them: every layer holds
    tensors, and no more experts than the index has tensors."""
    if cfg.n_layer > len(text_names):
        raise PlanError(
            f"{cfg.path}: {cfg.n_layer} layers, but the checkpoint holds only {len(text_names)} text tensors"
        )
    if cfg.n_expert > len(text_names):
        raise PlanError(
            f"{cfg.path}: {cfg.n_expert} experts, but the index lists only {len(text_names)} text tensors"
        )


def plan_kvs(plan: Plan, meta_dir: Any, chat_template: str | None = None) -> list[KV]:
    """File 1's metadata, besides the split keys."""
    tensors = [(t.name, t.info.shape) for f in plan.files for t in f.tensors]
    name = f"{plan.basename} {plan.label}"
    return plan.model.file_kvs(plan.cfg, meta_dir, name, plan.file_type, chat_template, tensors)


def make_plan(
    model: Model,
    source: Any,
    outtype: str = "auto",
    basename: str | None = None,
    chat_template: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    split: Split | None = None,
) -> tuple[Plan, list[KV]]:
    """A new plan of converting ``source``, with its inputs' fingerprint, and file 1's KVs."""
    basename = basename or model.default_basename
    split = split or Split()
    options = plan_options(outtype, basename, chat_template, split)
    # (identities before anything is read: a file that changes while the plan is made is not proven)
    before = {f: source.content_identity(f) for f in source.files()}
    before |= {
        name: file_identity(Path(source.meta_dir) / name) for name in model.meta_files + model.optional_meta
    }
    cfg = model.load_config(source.meta_dir)
    with _no_collection():
        plan, kvs = plan_and_kvs(model, cfg, source, outtype, basename, chat_template, progress, split)
    plan.inputs = inputs_fingerprint(model, source, [s.file for s in plan.source_files], options)
    plan.inputs_digest = inputs_digest(plan.inputs)
    plan.proven = proven_inputs(model, source, plan, before)
    return plan, kvs


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a plan is made: planning Kimi-K3 makes and drops
    about a million small objects (header entries, specs), none in cycles, and each collection walked
    them all again (a fifth of the plan's time). Turned back on, as it was, whatever happens."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def plan_options(
    outtype: str, basename: str, chat_template: str | None, split: Split | None = None
) -> dict[str, Any]:
    return {
        "outtype": outtype,
        "basename": basename,
        "chat_template": chat_template,
        "split": (split or Split()).to_json(),
    }
