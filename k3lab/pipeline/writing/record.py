"""The record of one finished output file, and the merged manifest: one type, one parser, one serializer.

A record says what a finished file holds, byte by byte: the SHA-256 of everything before the tensor
data (header, metadata, tensor infos) and of every tensor's GGML bytes, where each lies, and which
source tensors it was made from. It is the resume evidence (a file without a matching record is
redone) and what ``verify`` checks a set against. ``MANIFEST.json`` is every record merged:
``{"format": FORMAT, "files": [record, ...]}``, keys sorted.

A record (``Record.to_json``):
  {"format": "k3lab-manifest/2", "kind": "text" | "vision" | "tokenizer", "file": NAME, "number": k,
   "size": bytes, "data_start": offset of the first tensor, "header_sha256": hex,
   "tensors": [{"name", "type", "ne", "nbytes", "offset", "sha256", "transform",
                "sources": [{"name", "file"}]}],
   text files also: "split_count", "split_tensors", "plan_digest", "basename", "outtype",
                    "source": {"file", "size", "data_bytes", "header_sha256" (, "sha256": the Hub's)};
   single files also: "key" (the record's name in .k3lab/: "mmproj", "tokenizer")}
  offset is absolute in the file; sha256 is over the tensor's canonical GGML bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from k3lab.errors import K3LabError

FORMAT = "k3lab-manifest/2"


class ManifestError(K3LabError):
    """A manifest or record that is not what k3lab writes: one line, naming the file and field; exit 1,
    as for any set that does not verify."""

    exit_code = 1


_HEX64 = re.compile(r"[0-9a-f]{64}")
_IDENTITY = {"size", "mtime_ns", "ino", "dev"}
_KEY = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _basename(v: Any) -> bool:
    return isinstance(v, str) and bool(v) and "/" not in v and "\0" not in v and v not in (".", "..")


_FIELDS: dict[str, Any] = {  # field -> check, for every record
    "kind": lambda v: v in ("text", "vision", "tokenizer"),
    "file": _basename,
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
    "source": lambda v: isinstance(v, dict),
}
_SINGLE_FIELDS: dict[str, Any] = {"key": lambda v: isinstance(v, str) and bool(_KEY.fullmatch(v))}
_TENSOR_FIELDS: dict[str, Any] = {
    "name": lambda v: isinstance(v, str) and v,
    "type": lambda v: isinstance(v, str),
    "ne": lambda v: isinstance(v, list) and all(_int(d) and d >= 0 for d in v),
    "nbytes": lambda v: _int(v) and v >= 0,
    "offset": lambda v: _int(v) and v >= 0,
    "sha256": lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)),
    "sources": lambda v: isinstance(v, list),
}


@dataclass
class Record:
    kind: str
    file: str
    number: int
    size: int
    data_start: int
    header_sha256: str
    tensors: list[dict[str, Any]] = field(default_factory=list)
    # text files of a split set
    split_count: int = 0
    split_tensors: int = 0
    plan_digest: str = ""
    basename: str = ""
    outtype: str = ""
    source: dict[str, Any] = field(default_factory=dict)
    # files outside the split set: the record's name in .k3lab/
    key: str = ""
    # once published: the whole file's SHA-256 (its LFS oid on the Hub)
    sha256: str = ""
    # the file as written (size, mtime_ns, ino, dev: ``proof.identity``); kept in .k3lab/ only
    identity: dict[str, int] = field(default_factory=dict)

    @property
    def is_text(self) -> bool:
        return self.kind == "text"

    @property
    def state_name(self) -> str:
        """The record's file name in ``OUT/.k3lab/``."""
        return f"{self.number:05d}.json" if self.is_text else f"{self.key}.json"

    def to_json(self, state: bool = False) -> dict[str, Any]:
        """The record as JSON; ``state``: as kept in ``.k3lab/`` (with the file's identity on this
        machine, which a manifest leaves out)."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "kind": self.kind,
            "file": self.file,
            "number": self.number,
            "size": self.size,
            "data_start": self.data_start,
            "header_sha256": self.header_sha256,
            "tensors": self.tensors,
        }
        if self.is_text:
            out |= {
                "split_count": self.split_count,
                "split_tensors": self.split_tensors,
                "plan_digest": self.plan_digest,
                "basename": self.basename,
                "outtype": self.outtype,
                "source": self.source,
            }
        else:
            out["key"] = self.key
        if self.sha256:
            out["sha256"] = self.sha256
        if state and self.identity:
            out["identity"] = self.identity
        return out

    @classmethod
    def from_json(cls, rec: Any, where: str) -> Record:
        """A record, every field checked: anything else is one ManifestError naming ``where``."""
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a {FORMAT} record")
        rec = {"kind": "text", **rec}
        fields = {**_FIELDS, **(_TEXT_FIELDS if rec["kind"] == "text" else _SINGLE_FIELDS)}
        for key, ok in fields.items():
            if not ok(rec.get(key)):
                shown = repr(rec.get(key))[:40]
                raise ManifestError(f"{where}: field {key!r} is missing or malformed ({shown})")
        _check_tensors(rec, where)
        sha = rec.get("sha256", "")
        if sha and not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
            raise ManifestError(f"{where}: field 'sha256' is malformed ({repr(sha)[:40]})")
        ident = rec.get("identity") or {}
        if not (
            isinstance(ident, dict)
            and (not ident or set(ident) == _IDENTITY)
            and all(_int(v) and v >= 0 for v in ident.values())
        ):
            raise ManifestError(f"{where}: field 'identity' is malformed")
        return cls(**{k: rec[k] for k in fields}, sha256=sha, identity=ident)


def _check_tensors(rec: dict[str, Any], where: str) -> None:
    """Every tensor's fields, and their byte ranges: inside the data, in order, never overlapping."""
    tensors = rec["tensors"]
    for j, t in enumerate(tensors):
        if not isinstance(t, dict):
            raise ManifestError(f"{where}: tensors[{j}] is not an object")
        for key, ok in _TENSOR_FIELDS.items():
            if not ok(t.get(key)):
                raise ManifestError(
                    f"{where} ({rec['file']}): tensor {t.get('name', j)!r}: field {key!r} is missing or malformed"
                )
    end = rec["data_start"]
    for t in sorted(tensors, key=lambda t: t["offset"]):
        if t["offset"] < end or t["offset"] + t["nbytes"] > rec["size"]:
            raise ManifestError(
                f"{where} ({rec['file']}): tensor {t['name']}: bytes [{t['offset']}, {t['offset'] + t['nbytes']}) "
                f"overlap another tensor or lie outside the data of a {rec['size']}-byte file"
            )
        end = t["offset"] + t["nbytes"]


def records_of_manifest(man: Any, where: str) -> list[Record]:
    """The records of a merged manifest, every field checked; a malformed one is one ManifestError."""
    if not isinstance(man, dict) or not isinstance(man.get("files"), list):
        raise ManifestError(f"{where}: not a k3lab manifest (no list of files)")
    return [Record.from_json(rec, f"{where}: files[{i}]") for i, rec in enumerate(man["files"])]
