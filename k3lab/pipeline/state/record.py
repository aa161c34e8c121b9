"""The record of one finished output file, and the merged manifest: typed, one parser, one writer.

A record says what a finished file holds, byte by byte: the SHA-256 of everything before the tensor
data (header, metadata, tensor infos) and of every tensor's GGML bytes, where each lies, and which
source tensors it was made from. It is the resume evidence (a file without a matching record is
redone) and what ``verify`` checks a set against. ``MANIFEST.json`` is every record merged
(``write_manifest``, read back by ``read_manifest``), the same document in an output folder and in a
published repo.

A record (``Record.to_json``):
  {"format": "k3lab-manifest/3", "kind": "text" | "vision" | "tokenizer" | "imatrix", "file": NAME, "number": k,
   "size": bytes, "data_start": offset of the first tensor, "header_sha256": hex,
   "tensors": [TensorRecord: {"name", "type", "ne", "nbytes", "offset", "sha256", "transform",
                              "sources": [{"name", "file"}]}],
   text files also: "split_count", "split_tensors", "plan_digest", "basename", "outtype",
                    "sources": [every source file it read: {"file", "size", "data_bytes",
                                "header_sha256" (, "sha256": the Hub's)}];
   single files also: "key" (the record's name in .k3lab/: "mmproj", "tokenizer", "imatrix": the importance
                      matrix ``k3lab imatrix`` made of the set, beside it);
   once published: "sha256" (the whole file's)}
  offset is absolute in the file; sha256 is over the tensor's canonical GGML bytes.
  A k3lab-manifest/2 record (k3lab before output files could read several source files) is read too:
  its "source" is its one source file.

The manifest: {"format": FORMAT, "files": [record, ...], "published": {"repo", "branch", "made",
"commit"} (once published; "commit" only in a local copy: a repo cannot name its own commit),
"tensors": {NAME: {"sha256", "type", "ne"}} (every tensor by name, the seed kit's view of the same
records)}, keys sorted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from k3lab.errors import K3LabError
from k3lab.formats.files import InputFileError, parse_json
from k3lab.pipeline.sources.base import SourceFile

FORMAT = "k3lab-manifest/3"
FORMATS = (FORMAT, "k3lab-manifest/2")  # the formats read (/2: one "source" file per record)
MANIFEST_NAME = "MANIFEST.json"
MANIFEST_LIMIT = 512 << 20  # the real set's manifest is tens of MB


class ManifestError(K3LabError):
    """A manifest or record that is not what k3lab writes: one line, naming the file and field; exit 1,
    as for any set that does not verify."""

    exit_code = 1


_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_IDENTITY = {"size", "mtime_ns", "ino", "dev"}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _basename(v: Any) -> bool:
    return isinstance(v, str) and bool(v) and "/" not in v and "\0" not in v and v not in (".", "..")


def _sha(v: Any) -> bool:
    return isinstance(v, str) and bool(_HEX64.fullmatch(v))


def _check(fields: dict[str, Any], data: dict[str, Any], where: str) -> None:
    for key, ok in fields.items():
        if not ok(data.get(key)):
            shown = repr(data.get(key))[:40]
            raise ManifestError(f"{where}: field {key!r} is missing or malformed ({shown})")


@dataclass(frozen=True)
class SourceRef:
    """A source tensor an output tensor was made from, and the shard holding it."""

    name: str
    file: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "file": self.file}


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a finished file: where its bytes are and their SHA-256."""

    name: str
    type: str  # a GGML type's name (gguf-py's GGMLQuantizationType)
    ne: tuple[int, ...]
    nbytes: int
    offset: int  # absolute in the file
    sha256: str
    transform: str = ""
    sources: tuple[SourceRef, ...] = ()
    why: str = ""  # a variant's tensor: why it has its type (llama.cpp's rule, an override)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "ne": list(self.ne),
            "nbytes": self.nbytes,
            "offset": self.offset,
            "sha256": self.sha256,
            "transform": self.transform,
            "sources": [s.to_json() for s in self.sources],
        } | ({"why": self.why} if self.why else {})

    @classmethod
    def from_json(cls, t: Any, where: str) -> TensorRecord:
        if not isinstance(t, dict):
            raise ManifestError(f"{where}: is not an object")
        _check(_TENSOR_FIELDS, t, where)
        sources = []
        for s in t["sources"]:
            if not (
                isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("file"), str)
            ):
                raise ManifestError(f"{where}: field 'sources' is missing or malformed")
            sources.append(SourceRef(s["name"], s["file"]))
        transform, why = t.get("transform", ""), t.get("why", "")
        return cls(
            t["name"],
            t["type"],
            tuple(t["ne"]),
            t["nbytes"],
            t["offset"],
            t["sha256"],
            transform if isinstance(transform, str) else "",
            tuple(sources),
            why if isinstance(why, str) else "",
        )


_FIELDS: dict[str, Any] = {  # field -> check, for every record
    "kind": lambda v: v in ("text", "vision", "tokenizer", "imatrix"),
    "file": _basename,
    "number": lambda v: _int(v) and v >= 0,
    "size": lambda v: _int(v) and v >= 0,
    "data_start": lambda v: _int(v) and v >= 0,
    "header_sha256": _sha,
    "tensors": lambda v: isinstance(v, list),
}
_TEXT_FIELDS: dict[str, Any] = {
    "split_count": lambda v: _int(v) and v >= 1,
    "split_tensors": lambda v: _int(v) and v >= 0,
    "plan_digest": lambda v: isinstance(v, str),
    "basename": lambda v: isinstance(v, str),
    "outtype": lambda v: isinstance(v, str),
    "sources": lambda v: isinstance(v, list) and 1 <= len(v) <= 1_000_000,
}
_SINGLE_FIELDS: dict[str, Any] = {"key": lambda v: isinstance(v, str) and bool(_KEY.fullmatch(v))}
_TENSOR_FIELDS: dict[str, Any] = {
    "name": lambda v: isinstance(v, str) and v,
    "type": lambda v: isinstance(v, str),
    "ne": lambda v: isinstance(v, list) and all(_int(d) and d >= 0 for d in v),
    "nbytes": lambda v: _int(v) and v >= 0,
    "offset": lambda v: _int(v) and v >= 0,
    "sha256": _sha,
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
    tensors: list[TensorRecord] = field(default_factory=list)
    # text files of a split set
    split_count: int = 0
    split_tensors: int = 0
    plan_digest: str = ""
    basename: str = ""
    outtype: str = ""
    sources: list[SourceFile] = field(default_factory=list)  # every source file it was made from
    # files outside the split set: the record's name in .k3lab/
    key: str = ""
    # once published: the whole file's SHA-256 (its LFS oid on the Hub)
    sha256: str = ""
    # the file as written (size, mtime_ns, ino, dev: ``proof.identity``); kept in .k3lab/ only
    identity: dict[str, int] = field(default_factory=dict)
    # each input file read: {"identity" when reading began, "sha256": its digest} (writing.sources_read)
    read: dict[str, dict[str, Any]] = field(default_factory=dict)

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
            "tensors": [t.to_json() for t in self.tensors],
        }
        if self.is_text:
            out |= {
                "split_count": self.split_count,
                "split_tensors": self.split_tensors,
                "plan_digest": self.plan_digest,
                "basename": self.basename,
                "outtype": self.outtype,
                "sources": [s.to_json() for s in self.sources],
            }
        else:
            out["key"] = self.key
        if self.sha256:
            out["sha256"] = self.sha256
        if state:  # (this machine's: the file's identity, its inputs' identities; never in a manifest)
            out |= ({"identity": self.identity} if self.identity else {}) | ({"read": self.read} if self.read else {})  # fmt: skip
        return out

    @classmethod
    def from_json(cls, rec: Any, where: str) -> Record:
        """A record, every field checked: anything else is one ManifestError naming ``where``."""
        if not isinstance(rec, dict) or rec.get("format") not in FORMATS:
            raise ManifestError(f"{where}: not a {FORMAT} record")
        rec = {"kind": "text", **rec}
        if rec["format"] != FORMAT and isinstance(rec.get("source"), dict):  # (/2: one source file)
            rec["sources"] = [rec.pop("source")]
        fields = {**_FIELDS, **(_TEXT_FIELDS if rec["kind"] == "text" else _SINGLE_FIELDS)}
        _check(fields, rec, where)
        tensors = [
            TensorRecord.from_json(
                t, f"{where} ({rec['file']}): tensor {t.get('name', j) if isinstance(t, dict) else j!r}"
            )
            for j, t in enumerate(rec["tensors"])
        ]
        _check_ranges(tensors, rec["data_start"], rec["size"], f"{where} ({rec['file']})")
        sha = rec.get("sha256", "")
        if sha and not _sha(sha):
            raise ManifestError(f"{where}: field 'sha256' is malformed ({repr(sha)[:40]})")
        ident = rec.get("identity") or {}
        if not (
            isinstance(ident, dict)
            and (not ident or set(ident) == _IDENTITY)
            and all(_int(v) and v >= 0 for v in ident.values())
        ):
            raise ManifestError(f"{where}: field 'identity' is malformed")
        read = rec.get("read") or {}
        if not (isinstance(read, dict) and len(read) <= 1_000_000 and all(map(_read_entry, read.values()))):
            raise ManifestError(f"{where}: field 'read' is malformed")
        kept = {k: rec[k] for k in fields if k not in ("tensors", "sources")}
        try:
            sources = [SourceFile.from_json(s) for s in rec.get("sources", [])]
        except ValueError as e:
            raise ManifestError(f"{where}: field 'sources' is malformed ({e})") from None
        return cls(**kept, tensors=tensors, sha256=sha, identity=ident, sources=sources, read=read)


_READ_IDENTITY = {"size", "mtime_ns", "ctime_ns", "ino", "dev"}  # (``formats.files.file_identity``)


def _read_entry(v: Any) -> bool:
    """An entry of ``read``: an identity (or None) and a SHA-256 (or None)."""
    if not isinstance(v, dict) or set(v) != {"identity", "sha256"}:
        return False
    ident, sha = v["identity"], v["sha256"]
    fine = ident is None or (isinstance(ident, dict) and set(ident) == _READ_IDENTITY and all(map(_int, ident.values())))  # fmt: skip
    return fine and (sha is None or _sha(sha))


def _check_ranges(tensors: list[TensorRecord], data_start: int, size: int, where: str) -> None:
    """Every tensor's bytes inside the data, in order, never overlapping."""
    end = data_start
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset < end or t.end > size:
            raise ManifestError(
                f"{where}: tensor {t.name}: bytes [{t.offset}, {t.end}) overlap another tensor or lie "
                f"outside the data of a {size}-byte file"
            )
        end = t.end


# --- the manifest: every record merged --------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    """Where a set was published: the repo, the branch, the files besides the set k3lab made there
    (name -> git blob id: a file with another id is the user's), and the commit (a local manifest's:
    a repo's own manifest cannot name the commit that holds it)."""

    repo: str
    branch: str
    made: dict[str, str] = field(default_factory=dict)
    commit: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "repo": self.repo,
            "branch": self.branch,
            "made": dict(sorted(self.made.items())),
        }
        if self.commit:
            out["commit"] = self.commit
        return out

    @classmethod
    def from_json(cls, data: Any) -> Published | None:
        if not isinstance(data, dict) or not isinstance(data.get("repo"), str):
            return None
        made = data.get("made") if isinstance(data.get("made"), dict) else {}
        commit = data.get("commit")
        return cls(
            data["repo"],
            str(data.get("branch", "main")),
            {k: v for k, v in made.items() if isinstance(k, str) and isinstance(v, str)},
            commit if isinstance(commit, str) else None,
        )


def write_manifest(
    fh: BinaryIO, records: Iterable[Record], published: Published | None = None, made_as: str = ""
) -> None:
    """``MANIFEST.json``, streamed one record at a time (at real scale the records add up to tens of
    MB), keys sorted: the one writer of a manifest, in an output folder and in a repo. Beside the
    records, ``tensors`` gives every tensor by name as the seed kit reads a manifest
    (``{"sha256", "type": GGML type number, "ne"}``): a view of the same records, not a second truth."""
    from gguf import GGMLQuantizationType

    fh.write(b'{\n "files": [')
    sep, view = b"\n", {}
    for rec in records:
        fh.write(sep + json.dumps(rec.to_json(), indent=1, sort_keys=True).encode())
        sep = b",\n"
        for t in rec.tensors:
            view[t.name] = {"ne": list(t.ne), "sha256": t.sha256, "type": int(GGMLQuantizationType[t.type])}
    fh.write(f'\n ],\n "format": {json.dumps(FORMAT)}'.encode())
    if made_as:  # a variant's: the llama-quantize command that makes its bytes from the set
        fh.write(b',\n "made_as": ' + json.dumps(made_as).encode())
    if published is not None:
        fh.write(b',\n "published": ' + json.dumps(published.to_json(), sort_keys=True).encode())
    fh.write(b',\n "tensors": ' + json.dumps(view, sort_keys=True).encode())
    fh.write(b"\n}\n")


def manifest_bytes(records: Iterable[Record], published: Published | None = None, made_as: str = "") -> bytes:
    import io

    buf = io.BytesIO()
    write_manifest(buf, records, published, made_as)
    return buf.getvalue()


@dataclass
class Manifest:
    """A manifest as read: its records, and where it says it was published."""

    records: list[Record]
    published: Published | None = None
    made_as: str = ""  # a variant's manifest: the llama-quantize command that makes its bytes

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)


def read_manifest(data: bytes, where: str) -> Manifest:
    """A manifest's bytes (from a file or a repo), depth bounded and every field checked: anything
    else is one ``ManifestError`` naming ``where``."""
    try:
        man = parse_json(data, where)
    except InputFileError as e:
        raise ManifestError(str(e)) from None
    if not isinstance(man, dict) or not isinstance(man.get("files"), list):
        raise ManifestError(f"{where}: not a k3lab manifest (no list of files)")
    records = [Record.from_json(rec, f"{where}: files[{i}]") for i, rec in enumerate(man["files"])]
    made_as = man.get("made_as")
    made_as = made_as[:4096] if isinstance(made_as, str) else ""
    return Manifest(records, Published.from_json(man.get("published")), made_as)
