"""Verify a converted split set against its manifest, trusting nothing else.

Every byte of every file is accounted for: the bytes before the tensor data against the
header hash, each tensor against its SHA-256, and the padding between and after tensors must be
zero. The split keys must agree across the set, and the set must hold each tensor exactly once.
With a source checkpoint, each output tensor is also re-derived from the source by the
converter's own streaming code and compared, and the source tensors' hashes are checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from k3lab.errors import K3LabError
from k3lab.pipeline.checking.by_tensor import kit_view, verify_by_tensors
from k3lab.pipeline.checking.report import Report
from k3lab.pipeline.model import Model
from k3lab.pipeline.progress import TaskReport, byte_bar
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.proof import Problem, check_bytes
from k3lab.pipeline.state.record import ManifestError, Record

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = (
    gguf.Keys.Split.LLM_KV_SPLIT_NO,
    gguf.Keys.Split.LLM_KV_SPLIT_COUNT,
    gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
)


def load_manifest(out_dir: Path, manifest: str | Path | None) -> list[Record]:
    """The manifest's records (or, without one, the per-file records in ``.k3lab/``), every field
    checked: a malformed one is one line, never a traceback later."""
    folder = OutputFolder(out_dir)
    path = Path(manifest) if manifest else folder.manifest
    if path.exists() or manifest:
        return folder.records.manifest(path).records
    damaged = folder.records.damaged()
    if damaged:
        raise ManifestError(f"{folder.state / damaged[0]}: damaged or edited record (its digest differs)")
    records = folder.records.all()
    if not records:
        raise ManifestError(f"{path}: no manifest (convert writes it; or pass --manifest)")
    return records


def _not_here(folder: OutputFolder, out_dir: Path, manifest: str | Path | None, every: list[Record]) -> None:
    """A folder holding none of its set, published and not kept here: one line, where to check it."""
    path = Path(manifest) if manifest else folder.manifest
    if not every or any((out_dir / r.file).exists() for r in every) or not path.exists():
        return
    if (published := folder.records.manifest(path).published) is None:
        return
    branch = "" if published.branch == "main" else f" --revision {published.branch}"
    raise K3LabError(
        f"{out_dir}: holds none of the set's {len(every)} files: they were published to "
        f"{published.repo}@{published.branch} and not kept here (--keep-local keeps them); check them "
        f"there: k3lab verify {published.repo}{branch}"
    )


def _split_fields(path: Path) -> dict[str, int]:
    r = gguf.GGUFReader(path)
    out = {}
    for key in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS):
        if key in r.fields:
            out[key] = int(r.fields[key].contents())
    return out


WHOLE_FILE = ("truncated", "longer", "foreign", "junk")  # kinds that say the file as a whole is wrong
MAX_LISTED = 20  # problems of one kind listed one by one; the rest are counted


def verify(
    out_dir: str | Path,
    manifest: str | Path | None = None,
    source: SourceSpec | None = None,
    model: Model | None = None,
    quiet: bool = False,
    only: set[str] | None = None,
    choice: Any = None,
) -> Report:
    """Check the split set in ``out_dir`` against its manifest; with ``model``, also against the
    folder's plan; with ``source`` (local or the Hub: any source kind) and ``model``, re-derive every
    tensor from the source. ``only`` restricts the check to those file names (one shard of a run
    still in progress). The work is bounded by the records and the files present, never by a count
    a manifest claims."""
    out_dir = Path(out_dir)
    if (kit := kit_view(manifest)) is not None:
        return verify_by_tensors(out_dir, kit, choice)
    folder = OutputFolder(out_dir)
    every = load_manifest(out_dir, manifest)
    _not_here(folder, out_dir, manifest, every)
    if only is not None:
        missing = sorted(only - {r.file for r in every})
        if missing:
            report = Report()
            report.add("missing", missing[0], f"{missing[0]}: no manifest record (not converted yet?)")
            return report
    chosen = [r for r in every if only is None or r.file in only]
    records = [r for r in chosen if r.is_text]
    others = [r for r in chosen if not r.is_text]
    report = Report()
    if not records and not others:
        report.add("set", "", f"{out_dir}: the manifest lists no files")
        return report
    texts = [r for r in every if r.is_text]
    count = texts[0].split_count if texts else 0
    n_tensors = texts[0].split_tensors if texts else 0
    _check_set(folder, model, texts, count, n_tensors, report, complete=only is None)
    total = sum(r.size for r in records + others if (out_dir / r.file).is_file())  # (what is read)
    bar = byte_bar(total, "verify", True if quiet else None)
    names: dict[str, str] = {}
    by_number = {r.number: r.file for r in texts}
    if only is None:  # a .gguf in the folder that the manifest does not know is not part of this set
        listed = {r.file for r in every}
        for stray in sorted(p.name for p in out_dir.glob("*.gguf") if p.name not in listed):
            report.add(
                "stray", stray, f"{stray}: in the folder but not part of this set (not in the manifest)"
            )
    for rec in records + others:
        path = out_dir / rec.file
        if path.is_symlink() or (path.exists() and not path.is_file()):
            kind = "a directory" if path.is_dir() else "not a regular file"
            report.add("not-a-file", rec.file, f"{rec.file}: is {kind}, not a GGUF file")
            continue
        if not path.exists():
            report.add("missing", rec.file, f"{rec.file}: missing")
            continue
        report.files += 1
        report.bytes += rec.size
        for t in rec.tensors:
            if t.name in names and rec.is_text:
                report.add("set", rec.file, f"{rec.file}: tensor {t.name}: also in {names[t.name]}")
            names[t.name] = rec.file
        chosen = (
            set(choice.pick(rec.file, {t.name: t.nbytes for t in rec.tensors}))
            if choice is not None
            else None
        )
        at = bar.n
        found = check_bytes(path, rec, bar.update, chosen)
        bar.update(max(0, at + rec.size - bar.n))  # (its header and padding too: the bar ends at 100%)
        if not found or found[0].kind not in WHOLE_FILE:
            report.tensors += len(rec.tensors) if chosen is None else len(chosen)
        if not rec.is_text or (found and found[0].kind == "junk"):
            report.found += found
            continue
        try:
            fields = _split_fields(path)
        except Exception as e:  # a header gguf-py cannot even parse
            report.found += found or [Problem("junk", rec.file, f"{rec.file}: header unreadable ({e})")]
            continue
        number = fields.get(SPLIT_NO, -1) + 1
        if found and found[0].kind in WHOLE_FILE and number != rec.number and number in by_number:
            report.add(
                "swapped", rec.file, f"{rec.file}: holds file {number} of the set ({by_number[number]})"
            )
            continue
        report.found += found
        if found and found[0].kind in WHOLE_FILE:
            continue
        # a set of one file carries no split keys (as upstream's converter writes one)
        want = {SPLIT_NO: rec.number - 1, SPLIT_COUNT: count, SPLIT_TENSORS: n_tensors} if count > 1 else {}
        want = want or dict.fromkeys((SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS))
        for key, value in want.items():
            if fields.get(key) != value:
                report.add("split", rec.file, f"{rec.file}: {key} is {fields.get(key)}, expected {value}")
    bar.close()
    variant = folder.variant_plan.load() if source is not None else None
    if variant is not None:  # a variant's source is its set: every tensor quantised again from it
        from k3lab.pipeline.quantizing.check import rederive_variant

        rederive_variant(variant, source.location, records, report.add, source.token)
        return report
    if source is not None:
        if model is None:
            raise ManifestError("re-deriving from a source needs the model")
        _rederive(model, out_dir, records, source, report, quiet)
        _rederive_single(
            model, [r for r in others if model.single and r.kind == model.single.kind], source, report
        )
    return report


def _rederive_single(model: Model, records: list[Record], spec: SourceSpec, report: Report) -> None:
    """The model's single file (the mmproj) made again from the source, by ranges, and compared."""
    from k3lab.pipeline.writing.single import compare_derived, single_digests

    if not records:
        return
    source = open_source(spec, fresh=True)
    try:
        source.fetch_meta()
        derived = single_digests(model, model.load_config(Path(spec.meta_dir)), source)
    finally:
        source.close()
    for rec in records:
        recorded = {t.name: (t.type, tuple(t.ne), t.sha256) for t in rec.tensors}
        compare_derived(rec.file, recorded, derived, report.add)


def _check_set(
    folder: OutputFolder,
    model: Model | None,
    texts: list[Record],
    count: int,
    n_tensors: int,
    report: Report,
    complete: bool,
) -> None:
    """The records agree on the set (count, tensors, numbers within it, no number twice) and, where
    the folder holds a plan it can trust, with that plan: file names, tensor names, types and shapes."""
    for r in texts:
        if r.split_count != count or r.split_tensors != n_tensors:
            report.add(
                "set",
                r.file,
                f"{r.file}: says the set has {r.split_count} files and {r.split_tensors} tensors, "
                f"{texts[0].file} says {count} and {n_tensors}",
            )
        if not 1 <= r.number <= count:
            report.add("set", r.file, f"{r.file}: number {r.number} is outside the set's 1..{count}")
    numbers = [r.number for r in texts]
    if len(set(numbers)) != len(numbers):
        report.add("set", "", "the manifest lists a split file number twice")
    if complete and count:
        absent = count - len({n for n in numbers if 1 <= n <= count})
        if absent > len(texts) + MAX_LISTED:  # a count no folder of records backs: say so once
            report.add("set", "", f"the manifest claims {count} split files but lists {len(texts)}")
        else:
            gone = [k for k in range(1, count + 1) if k not in set(numbers)]
            for k in gone[:MAX_LISTED]:
                report.add(
                    "unlisted", "", f"split file {k} of {count}: not in the manifest (not converted yet?)"
                )
            if len(gone) > MAX_LISTED:
                report.add(
                    "unlisted", "", f"... and {len(gone) - MAX_LISTED} more split files not in the manifest"
                )
    plan = folder.plans.load(model) if model is not None else None
    if plan is None or len(plan.files) != count:
        return
    for r in texts:
        if not 1 <= r.number <= count:
            continue
        pf = plan.file(r.number)
        planned = {t.name: (t.info.type.name, list(t.info.ne)) for t in pf.tensors}
        recorded = {t.name: (t.type, list(t.ne)) for t in r.tensors}
        if r.file != pf.filename:
            report.add("plan", r.file, f"{r.file}: the folder's plan names file {r.number} {pf.filename}")
        elif recorded != planned:
            name = next(
                (n for n in sorted(planned.keys() | recorded.keys()) if planned.get(n) != recorded.get(n)),
                "?",
            )
            report.add(
                "plan",
                r.file,
                f"{r.file}: tensor {name}: recorded {recorded.get(name)}, the folder's plan says {planned.get(name)}",
            )


def _rederive(
    model: Model, out_dir: Path, records: list[Record], spec: SourceSpec, report: Report, quiet: bool
) -> None:
    """Plan the source again and stream every planned tensor from it (a Hub source downloads each
    shard in turn, converts nothing, and deletes it); compare hashes, types and shapes. A file whose
    record was made from other inputs (another config, tokenizer or template) is reported stale."""
    from k3lab.pipeline.planning.planner import build_plan
    from k3lab.pipeline.writing.convert import PlannedInputs, tensor_pieces

    if not records:
        return
    saved = OutputFolder(out_dir).plans.load(model)
    options = saved.inputs.get("options", {}) if saved is not None else {}
    source = open_source(spec, fresh=True)
    source.fetch_meta()
    cfg = model.load_config(Path(spec.meta_dir))
    args = (model, cfg, source, records[0].outtype, records[0].basename, options.get("chat_template"))
    plan = build_plan(*args, split=saved.split if saved is not None else None)
    groups = records_split(plan, records)  # (a set without its folder's plan: split as its files are)
    if groups is not None and saved is None:
        plan = build_plan(*args, split=groups)
    bar = byte_bar(
        sum(plan.file(r.number).source_bytes for r in records if r.number <= len(plan.files)),
        "re-derive",
        True if quiet else None,
    )
    report_bytes = TaskReport(emit=lambda m: bar.update(m[2]))
    try:
        chosen = [r for r in records if 1 <= r.number <= len(plan.files)]
        for rec in records:
            if rec not in chosen:
                report.add("stale", rec.file, f"{rec.file}: the source plans only {len(plan.files)} files")
        for k, rec in enumerate(chosen):
            pf = plan.file(rec.number)
            if rec.plan_digest != pf.digest and not _same_files_elsewhere(plan, pf, rec):
                what = "metadata, tensors or source files" if pf.number == 1 else "tensors or source files"
                report.add(
                    "stale",
                    rec.file,
                    f"{rec.file}: stale: made from other inputs than {spec.describe()} ({what} differ); convert again",
                )
            then = tuple(plan.file(chosen[k + 1].number).source_names) if k + 1 < len(chosen) else ()
            inputs = PlannedInputs(source, pf, report_bytes, then=then)
            try:
                _compare(rec, pf, inputs, report, tensor_pieces)
            finally:
                inputs.close()
                for f in pf.source_names:
                    source.release_header(f)
    finally:
        bar.close()
        source.close()


def records_split(plan: Any, records: list[Record]) -> Any:
    """The split a complete set's records show (which units each file holds), as a ``Split`` that
    re-plans the same files; None when the records do not cover the plan's units in order."""
    from k3lab.pipeline.planning.split import Split

    unit_of = {t.name: t.layer for f in plan.files for t in f.tensors}
    order = [u for f in plan.files for u in f.units]
    groups = []
    for rec in sorted((r for r in records if r.is_text), key=lambda r: r.number):
        units = list(dict.fromkeys(unit_of.get(t.name, "?") for t in rec.tensors))
        if "?" in units or any(u not in order for u in units):
            return None
        groups.append(tuple(order.index(u) for u in units))
    if [k for g in groups for k in g] != list(range(len(order))):
        return None
    return Split(plan.split.max_size, plan.split.max_tensors, True, tuple(groups))


def _same_files_elsewhere(plan: Any, pf: Any, rec: Record) -> bool:
    """Whether the record was made from these very files read from another kind of source (a local
    copy records no Hub SHA-256): every fact both sides know agrees, and with the record's own
    facts of them the plan gives the record's digest."""
    from k3lab.pipeline.planning.plan import file_digest

    if len(rec.sources) != len(pf.sources):
        return False
    if len(pf.sources) > 1 and [s.file for s in rec.sources] != pf.source_names:
        return False
    for theirs, ours in zip(rec.sources, pf.sources):
        a, b = theirs.fingerprint(), ours.fingerprint()
        if any(a[k] != b[k] for k in a.keys() & b.keys()):
            return False
    return file_digest(plan, dataclasses.replace(pf, sources=list(rec.sources))) == rec.plan_digest


def _compare(rec: Record, pf: Any, reader: Any, report: Report, tensor_pieces: Callable) -> None:
    """Every planned tensor of one file re-derived and compared with its record."""
    want = {t.name: t for t in rec.tensors}
    for position, pt in enumerate(pf.tensors):
        h = hashlib.sha256()
        reader.open_for(position, pt)
        for piece in tensor_pieces(pt, reader):
            h.update(memoryview(np.ascontiguousarray(piece)).cast("B"))
        reader.done_with(position, pt)
        t = want.get(pt.name)
        if t is None:
            report.add(
                "rederive",
                rec.file,
                f"{rec.file}: tensor {pt.name}: planned from the source but not in the manifest",
            )
            continue
        if (t.type, list(t.ne)) != (pt.info.type.name, list(pt.info.ne)):
            report.add(
                "rederive",
                rec.file,
                f"{rec.file}: tensor {pt.name}: recorded {t.type} {list(t.ne)}, the source gives "
                f"{pt.info.type.name} {list(pt.info.ne)}",
            )
        if h.hexdigest() != t.sha256:
            report.add(
                "rederive",
                rec.file,
                f"{rec.file}: tensor {pt.name}: re-derived from the source, SHA-256 differs "
                f"(source {pf.sources[pt.files[0]].file if pt.files else '?'}: {pt.sources[0]}"
                + (f" and {len(pt.sources) - 1} more)" if len(pt.sources) > 1 else ")"),
            )
