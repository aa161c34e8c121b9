"""What names a source and what a plan keeps of its files, as plain values: ``SourceSpec`` (how to
open a source, anywhere: sent to worker processes and Dask workers), ``SourceFile`` (a file as a plan
and a record know it), and the fingerprints of the metadata files a plan is made from."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.formats.files import file_identity, read_chunks

META_LIMIT = 256 * 1024 * 1024  # a config, tokenizer file or template larger than this is not one


def sha256_file(path: Path, limit: int = META_LIMIT) -> str:
    """SHA-256 of a regular file of at most ``limit`` bytes (a FIFO or a device is one line)."""
    h = hashlib.sha256()
    for chunk in read_chunks(path, limit, "metadata file"):
        h.update(chunk)
    return h.hexdigest()


def meta_fingerprint(
    meta_dir: str | Path, names: tuple[str, ...], proven: dict[str, Any] | None = None
) -> dict[str, str | None]:
    """SHA-256 of each metadata file the plan reads (None where an optional one is absent). A file
    whose identity is the one ``proven`` records beside its SHA-256 (``meta_identities``) is not read."""
    out: dict[str, str | None] = {}
    for name in names:
        path = Path(meta_dir) / name
        known = (proven or {}).get(name)
        if known is not None and file_identity(path) == known.get("identity"):
            out[name] = known["sha256"]
            continue
        present = path.exists() or path.is_symlink()
        out[name] = sha256_file(path) if present else None
    return out


@dataclass(frozen=True)
class SourceFile:
    """A source file as a plan and a record know it: what identifies its bytes, read cheaply (its
    size and the SHA-256 of its header; from the Hub also the SHA-256 of the whole file, its LFS
    oid), and how many bytes of tensor data it holds."""

    file: str
    size: int
    header_sha256: str
    data_bytes: int
    sha256: str | None = None

    def fingerprint(self) -> dict[str, Any]:
        """What an output file's digest covers of this file (its bytes, not its name)."""
        out = {"data_bytes": self.data_bytes, "size": self.size, "header_sha256": self.header_sha256}
        return out | ({"sha256": self.sha256} if self.sha256 else {})

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, **self.fingerprint()}

    @classmethod
    def from_json(cls, data: Any) -> SourceFile:
        """The JSON ``to_json`` wrote; anything else raises ValueError."""
        if not isinstance(data, dict) or not isinstance(data.get("file"), str):
            raise ValueError("a source file is an object naming its file")
        ints = [data.get(k) for k in ("size", "data_bytes")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ValueError(f"{data['file']}: size and data_bytes are counts")
        sha, head = data.get("sha256"), data.get("header_sha256")
        if not isinstance(head, str) or (sha is not None and not isinstance(sha, str)):
            raise ValueError(f"{data['file']}: header_sha256 and sha256 are hex strings")
        return cls(data["file"], data["size"], head, data["data_bytes"], sha)


@dataclass(frozen=True)
class SourceSpec:
    """How to open a source: its ``kind`` (a key of ``KINDS``), the metadata folder, where the shards
    are (a folder, a repo), the kind's own options, and the metadata files it may fetch. Plain values
    only, so that it can be sent to a worker process or a Dask worker."""

    kind: str
    meta_dir: str
    location: str
    options: tuple[tuple[str, Any], ...] = ()
    token: str | None = field(default=None, repr=False)
    meta_files: tuple[str, ...] = ()  # (required, then optional: see ``optional_meta``)
    optional_meta: tuple[str, ...] = ()

    @classmethod
    def local(cls, meta_dir: str | Path, src_dir: str | Path | None = None) -> SourceSpec:
        return cls("local", str(meta_dir), str(src_dir or meta_dir))

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    @property
    def changes_in_place(self) -> bool:
        """Whether its files can change under an output file made from them (a folder's can; a Hub
        source reads one pinned commit, every download checked against its SHA-256)."""
        return self.kind == "local"

    def describe(self) -> str:
        return self.location

    def with_options(self, extra: dict[str, Any]) -> SourceSpec:
        """This spec with ``extra`` options set (a plan's ``pin``: the Hub's commit)."""
        if not extra:
            return self
        kept = tuple((k, v) for k, v in self.options if k not in extra)
        return dataclasses.replace(self, options=kept + tuple(sorted(extra.items())))
