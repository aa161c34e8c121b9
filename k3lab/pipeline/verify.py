"""Verify a converted split set against its manifest, trusting nothing else.

Every byte of every file is accounted for: the bytes before the tensor data against the
header hash, each tensor against its SHA-256, and the padding between and after tensors must be
zero. The split keys must agree across the set, and the set must hold each tensor exactly once.
With a source checkpoint, each output tensor is also re-derived from the source by the
converter's own streaming code and compared, and the source tensors' hashes are checked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from k3lab.formats.manifest import MANIFEST_NAME, RECORDS_DIR, ManifestError, check_manifest

READ = 16 * 1024 * 1024


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def load_manifest(out_dir: Path, manifest: str | Path | None) -> dict[str, Any]:
    """The manifest (or, without one, the per-file records), every field checked: a malformed one is
    one line, never a traceback later."""
    path = Path(manifest) if manifest else out_dir / MANIFEST_NAME
    if path.is_dir():
        raise ManifestError(f"{path}: is a directory, not a manifest")
    if path.exists():
        try:
            man = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ManifestError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
        check_manifest(man, path)
        return man
    records = [
        p for p in sorted((out_dir / RECORDS_DIR).glob("*.json")) if p.name not in ("plan.json", "kvs.json")
    ]
    if manifest or not records:
        raise ManifestError(f"{path}: no manifest (convert writes it; or pass --manifest)")
    files = []
    for p in records:
        try:
            files.append(json.loads(p.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{p}: not valid JSON ({e})") from None
    man = {"files": files}
    check_manifest(man, out_dir / RECORDS_DIR)
    return man


def _split_fields(path: Path) -> dict[str, int]:
    r = gguf.GGUFReader(path)
    out = {}
    for key in ("split.no", "split.count", "split.tensors.count"):
        if key in r.fields:
            out[key] = int(r.fields[key].contents())
    return out


def _check_file(path: Path, rec: dict[str, Any], report: Report, advance: Callable[[int], None]) -> None:
    name = rec["file"]
    size = path.stat().st_size
    if size != rec["size"]:
        kind = "truncated" if size < rec["size"] else "longer than recorded"
        report.problems.append(f"{name}: {kind}: {size} bytes, the manifest says {rec['size']}")
        return
    tensors = sorted(rec["tensors"], key=lambda t: t["offset"])
    bad: list[str] = []
    with open(path, "rb") as fh:
        header = fh.read(rec["data_start"])
        if hashlib.sha256(header).hexdigest() != rec["header_sha256"]:
            report.problems.append(f"{name}: header (metadata and tensor infos) differs from the manifest")
        pos = rec["data_start"]
        for t in tensors + [None]:
            end = t["offset"] if t else size
            gap = fh.read(end - pos)
            if gap.strip(b"\0"):
                where = f"before tensor {t['name']}" if t else "after the last tensor"
                report.problems.append(f"{name}: non-zero padding {where}")
            if t is None:
                break
            h, left = hashlib.sha256(), t["nbytes"]
            while left:
                chunk = fh.read(min(READ, left))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
                advance(len(chunk))
            if h.hexdigest() != t["sha256"]:
                bad.append(t["name"])
            pos = t["offset"] + t["nbytes"]
            report.tensors += 1
    if bad and len(bad) == len(tensors) > 1:
        report.problems.append(
            f"{name}: not from this conversion: all {len(bad)} tensors differ from the manifest"
        )
    else:
        report.problems += [f"{name}: tensor {b}: SHA-256 differs from the manifest" for b in bad]


def verify(
    out_dir: str | Path,
    manifest: str | Path | None = None,
    src: str | Path | None = None,
    meta: str | Path | None = None,
    quiet: bool = False,
    only: set[str] | None = None,
) -> Report:
    """Check the split set in ``out_dir``; with ``src`` also re-derive it from the source.
    ``only`` restricts the check to those file names (one shard of a run still in progress)."""
    out_dir = Path(out_dir)
    man = load_manifest(out_dir, manifest)
    n_tensors = sum(len(r["tensors"]) for r in man["files"] if r.get("kind", "text") == "text")
    if only is not None:
        man = {**man, "files": [r for r in man["files"] if r["file"] in only]}
        missing = sorted(only - {r["file"] for r in man["files"]})
        if missing:
            return Report(problems=[f"{missing[0]}: no manifest record (not converted yet?)"])
    records = [r for r in man["files"] if r.get("kind", "text") == "text"]
    others = [r for r in man["files"] if r.get("kind", "text") != "text"]
    report = Report()
    if not records and not others:
        report.problems.append(f"{out_dir}: the manifest lists no files")
        return report
    count = records[0]["split_count"] if records else 0
    present = {r["number"]: r for r in records}
    for k in range(1, count + 1 if only is None else 0):
        if k not in present:
            report.problems.append(f"split file {k} of {count}: not in the manifest (not converted yet?)")
    total = sum(r["size"] for r in records + others)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=True if quiet else None)
    names: dict[str, str] = {}
    if only is None:  # a .gguf in the folder that the manifest does not know is not part of this set
        listed = {r["file"] for r in records + others}
        for stray in sorted(p.name for p in out_dir.glob("*.gguf") if p.name not in listed):
            report.problems.append(f"{stray}: in the folder but not part of this set (not in the manifest)")
    for rec in records + others:
        path = out_dir / rec["file"]
        if path.is_dir():
            report.problems.append(f"{rec['file']}: is a directory, not a GGUF file")
            continue
        if not path.exists():
            report.problems.append(f"{rec['file']}: missing")
            continue
        if not path.is_file():
            report.problems.append(f"{rec['file']}: is not a regular file")
            continue
        report.files += 1
        report.bytes += rec["size"]
        for t in rec["tensors"]:
            if t["name"] in names and rec in records:
                report.problems.append(f"{rec['file']}: tensor {t['name']}: also in {names[t['name']]}")
            names[t["name"]] = rec["file"]
        _check_file(path, rec, report, bar.update)
        if rec in records and path.stat().st_size == rec["size"]:
            try:
                fields = _split_fields(path)
            except Exception as e:  # a header gguf-py cannot even parse
                report.problems.append(f"{rec['file']}: header unreadable ({e})")
                continue
            total = rec.get("split_tensors", n_tensors)
            want = {"split.no": rec["number"] - 1, "split.count": count, "split.tensors.count": total}
            for key, value in want.items():
                if fields.get(key) != value:
                    report.problems.append(f"{rec['file']}: {key} is {fields.get(key)}, expected {value}")
    bar.close()
    if src is not None:
        _rederive(out_dir, records, Path(src), Path(meta or src), report, quiet)
    return report


def _rederive(
    out_dir: Path, records: list[dict[str, Any]], src: Path, meta: Path, report: Report, quiet: bool
) -> None:
    """Plan the source again and stream every planned tensor from it; compare hashes. A file whose
    record was made from other inputs (another config, tokenizer or template) is reported stale."""
    from k3lab.kimi_k3.config import K3Config
    from k3lab.pipeline.convert import Reader, tensor_pieces
    from k3lab.pipeline.plan import PlanError, build_plan, load_plan
    from k3lab.pipeline.sources import LocalSource

    if not records:
        return
    try:
        options = load_plan(out_dir).inputs.get("options", {})
    except PlanError:
        options = {}
    source = LocalSource(src, meta)
    plan = build_plan(
        K3Config.load(meta),
        source,
        records[0]["outtype"],
        records[0]["basename"],
        options.get("chat_template"),
    )
    bar = tqdm(
        total=sum(plan.file(r["number"]).source_bytes for r in records if r["number"] <= len(plan.files)),
        unit="B",
        unit_scale=True,
        desc="re-derive",
        disable=True if quiet else None,
    )
    for rec in records:
        if rec["number"] > len(plan.files):
            report.problems.append(f"{rec['file']}: the source plans only {len(plan.files)} files")
            continue
        pf = plan.file(rec["number"])
        if rec.get("plan_digest") != pf.digest:
            what = "metadata, tensors or source shard" if pf.number == 1 else "tensors or source shard"
            report.problems.append(
                f"{rec['file']}: stale: made from other inputs than {src} ({what} differ); convert again"
            )
        want = {t["name"]: t for t in rec["tensors"]}
        entries = source.header(pf.source_file)
        reader = Reader(source, entries, bar.update)
        for pt in pf.tensors:
            h = hashlib.sha256()
            for piece in tensor_pieces(pt, reader):
                h.update(memoryview(np.ascontiguousarray(piece)).cast("B"))
            t = want.get(pt.name)
            if t is None:
                report.problems.append(
                    f"{rec['file']}: tensor {pt.name}: planned from the source but not in the manifest"
                )
                continue
            if h.hexdigest() != t["sha256"]:
                report.problems.append(
                    f"{rec['file']}: tensor {pt.name}: re-derived from the source, SHA-256 differs "
                    f"(source {pf.source_file}: {pt.sources[0]}"
                    + (f" and {len(pt.sources) - 1} more)" if len(pt.sources) > 1 else ")")
                )
        source.release(pf.source_file)
        source.release_header(pf.source_file)
    bar.close()
