"""The manifest: SHA-256 of every output tensor and of the source tensors it came from.

On disk (see README, "On-disk state"):
  OUT/.k3lab/NNNNN.json   one record per finished text file, written after its rename (the
                          resume evidence: a file without a matching record is redone)
  OUT/.k3lab/mmproj.json  the record of the vision mmproj file ("kind": "vision")
  OUT/MANIFEST.json       all records merged, stable key order; rebuilt from the records

A record:
  {"format": "k3lab-manifest/1", "kind": "text", "file": NAME, "number": k, "split_count": n,
   "split_tensors": tensors in the whole set,
   "basename": "Kimi-K3", "outtype": "auto", "size": bytes, "plan_digest": hex,
   "data_start": offset of the first tensor, "header_sha256": hex (the bytes before data_start),
   "tensors": [{"name", "type", "ne", "nbytes", "offset", "sha256", "transform",
                "sources": [{"name", "file", "sha256"}]}]}
  offset is absolute in the file; sha256 is over the tensor's canonical GGML bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

FORMAT = "k3lab-manifest/1"
RECORDS_DIR = ".k3lab"
MANIFEST_NAME = "MANIFEST.json"


def record_path(out_dir: str | Path, number: int) -> Path:
    return Path(out_dir) / RECORDS_DIR / f"{number:05d}.json"


def atomic_write_json(path: Path, data: Any, indent: int | None = 1) -> None:
    """Write JSON to ``path.partial``, fsync, rename: ``path`` is old or new, never half; a failure
    (a full disk) removes the partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # concurrent writers never share one
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=indent, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_record(out_dir: str | Path, record: dict[str, Any]) -> Path:
    key = record.get("key")
    path = Path(out_dir) / RECORDS_DIR / f"{key}.json" if key else record_path(out_dir, record["number"])
    atomic_write_json(path, record)
    return path


def read_record(out_dir: str | Path, number: int) -> dict[str, Any] | None:
    path = record_path(out_dir, number)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if record.get("format") == FORMAT else None


def header_sha256(path: str | Path, data_start: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(data_start)).hexdigest()


def is_complete(out_dir: str | Path, number: int, filename: str, plan_digest: str) -> bool:
    """The resume test: the record exists for this plan, and the file has its size and header."""
    record = read_record(out_dir, number)
    path = Path(out_dir) / filename
    if record is None or record.get("plan_digest") != plan_digest or record.get("file") != filename:
        return False
    try:
        if path.stat().st_size != record["size"]:
            return False
        return header_sha256(path, record["data_start"]) == record["header_sha256"]
    except (OSError, KeyError):
        return False


def _records(out_dir: Path) -> list[tuple[tuple[str, int], Path]]:
    """The per-file records in ``.k3lab/`` (not the plan), as (sort key, path): one parsed at a time."""
    found = []
    for p in sorted((out_dir / RECORDS_DIR).glob("*.json")):
        try:
            r = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            continue
        if isinstance(r, dict) and r.get("format") == FORMAT and isinstance(r.get("number"), int):
            found.append(((str(r.get("kind", "text")), r["number"]), p))
    return sorted(found)


def merge(out_dir: str | Path) -> Path:
    """Rebuild OUT/MANIFEST.json from the per-file records, streaming (at real scale the records
    add up to tens of MB: memory stays at one record)."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST_NAME
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write('{\n "files": [')
            for i, (_, p) in enumerate(_records(out_dir)):
                record = json.loads(p.read_text(encoding="utf-8"))
                fh.write(("," if i else "") + "\n" + json.dumps(record, indent=1, sort_keys=True))
            fh.write(f'\n ],\n "format": {json.dumps(FORMAT)}\n}}\n')
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
