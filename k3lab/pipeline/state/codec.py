"""A state file in ``OUT/.k3lab/``: a first line ``k3lab-state/1 KIND SHA256`` (KIND is ``plan``,
``kvs``, ``record``, ``variant`` or ``imatrix``; SHA256 that of the rest), then one JSON document (``tail -n +2 FILE`` shows
it). Written as ``NAME.PID.partial`` (created new, never through a symlink), fsynced and renamed;
read back only when its line, kind and digest check out, else it reads as absent (None): the work it
describes is redone, never trusted, never a traceback."""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from k3lab.errors import MachineError
from k3lab.formats.files import InputFileError, json_bytes, read_bounded
from k3lab.formats.files import write_atomically as _write_atomically
from k3lab.pipeline.state.names import FolderError

STATE_MAGIC = "k3lab-state/1"
MiB = 1024 * 1024
STATE_LIMITS = {
    "plan": 512 * MiB,
    "kvs": 512 * MiB,
    "record": 256 * MiB,
    "variant": 512 * MiB,
    "imatrix": 64 * MiB,
    "costs": 64 * MiB,
}


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``files.write_atomically``, with a full disk or a stranger's file in the way as one line
    naming ``path``."""
    try:
        _write_atomically(path, write)
    except BaseException as e:
        raise disk_full(e, path) from None


def write_state(path: Path, kind: str, body: Any) -> Path:
    data = json_bytes(body)
    head = f"{STATE_MAGIC} {kind} {hashlib.sha256(data).hexdigest()}\n".encode()
    write_atomically(path, lambda fh: fh.write(head + data))
    return path


def state_body(path: Path, kind: str) -> bytes | None:
    """A state file's JSON bytes when its first line names ``kind`` and the SHA-256 of the rest;
    None when it is missing, malformed, tampered with or not a regular file."""
    try:
        data = read_bounded(path, STATE_LIMITS[kind], f"{kind} file", follow=False)
    except InputFileError:
        return None
    head, _, body = data.partition(b"\n")
    parts = head.split(b" ")
    if len(parts) != 3 or parts[0] != STATE_MAGIC.encode() or parts[1] != kind.encode():
        return None
    if hashlib.sha256(body).hexdigest().encode() != parts[2]:
        return None
    return body


def read_state(path: Path, kind: str) -> Any | None:
    body = state_body(path, kind)
    if body is None:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def disk_full(e: BaseException, path: Path) -> BaseException:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return MachineError(f"{path}: no space left on the device; nothing was kept of it")
    if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ELOOP):
        return FolderError(f"{path}: a file k3lab did not make is in the way ({e.strerror}); remove it")
    return e
