"""The manifest: SHA-256 of every output tensor and of the source tensors it came from.

On disk (see README, "On-disk state"):
  OUT/.k3lab/NNNNN.json   one record per finished text file, written after its rename (the
                          resume evidence: a file without a matching record is redone)
  OUT/.k3lab/mmproj.json  the record of the vision mmproj file ("kind": "vision")
  OUT/.k3lab/tokenizer.json  the record of the standalone tokenizer GGUF ("kind": "tokenizer")
  OUT/MANIFEST.json       all records merged, stable key order; rebuilt from the records

A record:
  {"format": "k3lab-manifest/2", "kind": "text", "file": NAME, "number": k, "split_count": n,
   "split_tensors": tensors in the whole set,
   "basename": "Kimi-K3", "outtype": "auto", "size": bytes, "plan_digest": hex,
   "source": {"file", "size", "data_bytes", "header_sha256" (, "etag": the Hub's SHA-256 of the file)},
   "data_start": offset of the first tensor, "header_sha256": hex (the bytes before data_start),
   "tensors": [{"name", "type", "ne", "nbytes", "offset", "sha256", "transform",
                "sources": [{"name", "file"}]}]}
  offset is absolute in the file; sha256 is over the tensor's canonical GGML bytes. Source bytes
  are not hashed while converting (it would cost a second SHA-256 pass over 1.4 TiB): `verify
  --src` re-derives every tensor from the source and compares these hashes instead.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from k3lab.errors import K3LabError, MachineError

FORMAT = "k3lab-manifest/2"
RECORDS_DIR = ".k3lab"
MANIFEST_NAME = "MANIFEST.json"


class ManifestError(K3LabError):
    """A manifest or record that is not what k3lab writes: one line, naming the file and field; exit 1,
    as for any set that does not verify."""

    exit_code = 1


_HEX64 = re.compile(r"[0-9a-f]{64}")
_RECORD_FIELDS: dict[str, Any] = {  # field -> check
    "file": lambda v: isinstance(v, str) and v and "/" not in v and v not in (".", ".."),
    "number": lambda v: _int(v) and v >= 0,
    "size": lambda v: _int(v) and v >= 0,
    "data_start": lambda v: _int(v) and v >= 0,
    "header_sha256": lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)),
    "tensors": lambda v: isinstance(v, list),
}
_TEXT_FIELDS: dict[str, Any] = {
    "split_count": lambda v: _int(v) and v >= 1,
    "split_tensors": lambda v: _int(v) and v >= 0,
    "plan_digest": lambda v: isinstance(v, str),
    "basename": lambda v: isinstance(v, str),
    "outtype": lambda v: isinstance(v, str),
}
_TENSOR_FIELDS: dict[str, Any] = {
    "name": lambda v: isinstance(v, str) and v,
    "type": lambda v: isinstance(v, str),
    "ne": lambda v: isinstance(v, list) and all(_int(d) and d >= 0 for d in v),
    "nbytes": lambda v: _int(v) and v >= 0,
    "offset": lambda v: _int(v) and v >= 0,
    "sha256": lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)),
    "sources": lambda v: isinstance(v, list),
}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_manifest(man: Any, path: str | Path) -> list[dict[str, Any]]:
    """The records of a merged manifest, every field checked; a malformed one is one ManifestError."""
    if not isinstance(man, dict) or not isinstance(man.get("files"), list):
        raise ManifestError(f"{path}: not a k3lab manifest (no list of files)")
    for i, rec in enumerate(man["files"]):
        check_record(rec, f"{path}: files[{i}]")
    return man["files"]


def check_record(rec: Any, where: str) -> None:
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a {FORMAT} record")
    fields = {**_RECORD_FIELDS, **(_TEXT_FIELDS if rec.get("kind", "text") == "text" else {})}
    for key, ok in fields.items():
        if not ok(rec.get(key)):
            raise ManifestError(
                f"{where}: field {key!r} is missing or malformed ({json.dumps(rec.get(key))[:40]})"
            )
    end = rec["data_start"]
    for j, t in enumerate(
        sorted(rec["tensors"], key=lambda t: t.get("offset", -1) if isinstance(t, dict) else -1)
    ):
        if not isinstance(t, dict):
            raise ManifestError(f"{where}: tensors[{j}] is not an object")
        for key, ok in _TENSOR_FIELDS.items():
            if not ok(t.get(key)):
                raise ManifestError(
                    f"{where} ({rec['file']}): tensor {t.get('name', j)!r}: field {key!r} is missing or malformed"
                )
        if t["offset"] < end or t["offset"] + t["nbytes"] > rec["size"]:
            raise ManifestError(
                f"{where} ({rec['file']}): tensor {t['name']}: bytes [{t['offset']}, {t['offset'] + t['nbytes']}) "
                f"overlap another tensor or lie outside the data of a {rec['size']}-byte file"
            )
        end = t["offset"] + t["nbytes"]


def record_path(out_dir: str | Path, number: int) -> Path:
    return Path(out_dir) / RECORDS_DIR / f"{number:05d}.json"


def write_atomically(path: Path, write: Callable[[TextIO], Any]) -> None:
    """``write(fh)`` into ``path.PID.partial``, fsync, rename: ``path`` is old or new, never half; a
    failure (a full disk) removes the partial file and names ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # concurrent writers never share one
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        raise _disk_full(e, path) from None


def atomic_write_json(path: Path, data: Any, indent: int | None = 1) -> None:
    write_atomically(path, lambda fh: fh.write(json.dumps(data, indent=indent, sort_keys=True) + "\n"))


def write_record(out_dir: str | Path, record: dict[str, Any]) -> Path:
    key = record.get("key")
    path = Path(out_dir) / RECORDS_DIR / f"{key}.json" if key else record_path(out_dir, record["number"])
    atomic_write_json(path, record)
    return path


def record_single_file(
    path: Path, kind: str, key: str, data_start: int, tensors: list[dict[str, Any]]
) -> Path:
    """The record (``.k3lab/KEY.json``) of a file outside the split set: the mmproj (kind ``vision``),
    the standalone tokenizer (kind ``tokenizer``), in the folder beside it; then the merged manifest."""
    size = path.stat().st_size
    data_start = min(data_start, size)
    write_record(
        path.parent,
        {
            "format": FORMAT,
            "kind": kind,
            "file": path.name,
            "number": 0,
            "key": key,
            "size": size,
            "data_start": data_start,
            "header_sha256": header_sha256(path, data_start),
            "tensors": tensors,
        },
    )
    return merge(path.parent)


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

    def write(fh: TextIO) -> None:
        fh.write('{\n "files": [')
        for i, (_, p) in enumerate(_records(out_dir)):
            record = json.loads(p.read_text(encoding="utf-8"))
            fh.write(("," if i else "") + "\n" + json.dumps(record, indent=1, sort_keys=True))
        fh.write(f'\n ],\n "format": {json.dumps(FORMAT)}\n}}\n')

    path = out_dir / MANIFEST_NAME
    write_atomically(path, write)
    return path


def _disk_full(e: BaseException, path: Path) -> BaseException:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return MachineError(f"{path}: no space left on the device; nothing was kept of it")
    return e
