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


def atomic_write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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


def merge(out_dir: str | Path) -> Path:
    """Rebuild OUT/MANIFEST.json from the per-file records."""
    out_dir = Path(out_dir)
    records = []
    for p in sorted((out_dir / RECORDS_DIR).glob("*.json")):
        try:
            r = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            continue
        if r.get("format") == FORMAT:
            records.append(r)
    records.sort(key=lambda r: (r.get("kind", "text"), r["number"]))
    manifest = {"format": FORMAT, "files": records}
    path = out_dir / MANIFEST_NAME
    atomic_write_json(path, manifest)
    return path
