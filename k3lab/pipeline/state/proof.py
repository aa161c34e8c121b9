"""Whether a file on disk is the file its record describes: the one proof ``convert`` (to skip a
finished file) and ``verify`` (to pass a set) both use, so they never disagree about a folder.

- ``identity``: what the file system says of a file (size, mtime, inode, device), recorded when the
  file is written. The same identity means the same file k3lab wrote and renamed into place.
- ``check_bytes``: every byte against the record: the size, the bytes before the tensor data
  against ``header_sha256``, every tensor against its SHA-256, the padding zero. A file whose
  identity differs from its record's (copied, touched, replaced by another set's file of the same
  size and header) is skipped only when this finds nothing.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3lab.formats.files import hash_span
from k3lab.pipeline.state.record import Record

GGUF_MAGIC = b"GGUF"


def header_sha256(path: str | Path, data_start: int) -> str:
    """The SHA-256 of a finished file's bytes before its tensor data (what a record's
    ``header_sha256`` is)."""
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(data_start)).hexdigest()


def identity(path: Path) -> dict[str, int] | None:
    """(size, mtime_ns, inode, device) of a regular file, or None (not one, or gone)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a set: ``kind`` groups problems for the summary (``truncated``,
    ``foreign``, ``junk``, ``tensor``, ...), ``file`` is the file it is about ('' for the set)."""

    kind: str
    file: str
    text: str


def check_bytes(
    path: Path, rec: Record, advance: Callable[[int], None] | None = None, only: set[str] | None = None
) -> list[Problem]:
    """Every byte of ``path`` against ``rec`` (of the tensors, only those named in ``only`` when
    given: the header and padding always); [] when it is exactly the recorded file."""
    name = rec.file
    try:
        size = os.lstat(path).st_size
        fh = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as e:
        return [Problem("missing", name, f"{name}: cannot be read ({e.strerror or e})")]
    with fh:
        if fh.read(4) != GGUF_MAGIC:
            return [Problem("junk", name, f"{name}: not a GGUF file")]
        if size != rec.size:
            kind = "truncated" if size < rec.size else "longer"
            text = "truncated" if size < rec.size else "longer than recorded"
            return [Problem(kind, name, f"{name}: {text}: {size} bytes, the manifest says {rec.size}")]
        fh.seek(0)
        problems: list[Problem] = []
        header = fh.read(rec.data_start)
        header_ok = hashlib.sha256(header).hexdigest() == rec.header_sha256
        tensors = sorted(rec.tensors, key=lambda t: t.offset)
        pos, bad = rec.data_start, []
        for t in [*tensors, None]:
            end = t.offset if t else size
            gap = fh.read(end - pos)
            if gap.strip(b"\0"):
                where = f"before tensor {t.name}" if t else "after the last tensor"
                problems.append(Problem("padding", name, f"{name}: non-zero padding {where}"))
            if t is None:
                break
            if only is not None and t.name not in only:
                fh.seek(t.end)
                pos = t.end
                continue
            if hash_span(fh, t.nbytes, advance) != t.sha256:
                bad.append(t.name)
            pos = t.end
    if bad and len(bad) == len(tensors) > 1:
        return [
            Problem(
                "foreign",
                name,
                f"{name}: not from this conversion: all {len(bad)} tensors differ from the manifest",
            )
        ]
    if not header_ok:
        problems.insert(
            0,
            Problem("header", name, f"{name}: header (metadata and tensor infos) differs from the manifest"),
        )
    problems += [
        Problem("tensor", name, f"{name}: tensor {b}: SHA-256 differs from the manifest") for b in bad
    ]
    return problems


def is_recorded_file(path: Path, rec: Record) -> bool:
    """Whether ``path`` is the file ``rec`` describes: its identity as recorded, or else every byte."""
    found = identity(path)
    if found is None or found["size"] != rec.size:
        return False
    if rec.identity and found == rec.identity:
        return True
    return not check_bytes(path, rec)
