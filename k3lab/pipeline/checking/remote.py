"""A GGUF split set in a Hub repo, read by byte ranges: every file's header, and any tensor's bytes.

A header is parsed by gguf-py's own ``GGUFReader``, which reads a local file: it is given a sparse
stand-in of the file's size holding only the header bytes fetched so far, followed by a guard of
0xFF bytes (a length or count read past the fetched bytes is absurd, so the reader fails rather
than parse zeros as a shorter header). Until the reader parses a header that ends within the
fetched bytes, more is fetched (4x at a time, at most ``MAX_HEADER``). Tensor bytes are read in
pieces of ``PIECE`` bytes and handed on (to a hash), never stored.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError

PROBE = 64 << 10  # the first ranged read of a header (then 4x as much at a time: file 1 holds ~10 MB)
MAX_HEADER = 512 << 20
PIECE = 16 << 20
GUARD = 1 << 16
SPLIT = re.compile(r"(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")

Fetch = Callable[[str, int, int], bytes]  # (file, start, stop) -> exactly those bytes


class RemoteSetError(K3LabError):
    """A repo's GGUF files cannot be read as a set: one line naming the file."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of a remote GGUF file, as its header says."""

    name: str
    type: str  # GGMLQuantizationType's name
    ne: tuple[int, ...]
    offset: int  # absolute in the file
    nbytes: int
    file: str


@dataclass
class Header:
    """A remote GGUF file's header: its split keys, tensors, where the data starts, and the SHA-256 of
    the bytes before it (what a k3lab record's ``header_sha256`` is)."""

    file: str
    size: int
    fields: dict[str, Any]
    tensors: list[Tensor] = field(default_factory=list)
    data_start: int = 0
    header_sha256: str = ""
    fetched: int = 0

    def split(self, key: str) -> int | None:
        value = self.fields.get(key)
        return int(value) if isinstance(value, (int, float)) else None


def read_header(file: str, size: int, fetch: Fetch, probe: int = PROBE) -> Header:
    """``file``'s header through gguf-py's reader, fetching only what the header needs."""
    import gguf

    have = bytearray()
    want = min(probe, size)
    with tempfile.TemporaryDirectory(prefix="k3lab-gguf-") as tmp:
        stand = Path(tmp) / "stand-in.gguf"
        while True:
            have += fetch(file, len(have), want)
            with open(stand, "wb") as fh:
                fh.write(have)
                fh.write(b"\xff" * min(GUARD, size - len(have)))
                fh.truncate(size)
            try:
                reader = gguf.GGUFReader(stand)
                complete = int(reader.data_offset) <= len(have)
            except Exception:  # the header runs on past the bytes fetched (or is no GGUF at all)
                reader, complete = None, False
            if complete and reader is not None:
                return _header(file, size, reader, bytes(have))
            if len(have) >= min(size, MAX_HEADER):
                raise RemoteSetError(
                    f"{file}: not a GGUF file gguf-py can read (its first {len(have)} bytes)"
                )
            want = min(size, MAX_HEADER, len(have) * 4)


def _header(file: str, size: int, reader: Any, head: bytes) -> Header:
    fields: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("split."):
            try:
                fields[key] = f.contents()
            except Exception:
                continue
    arch = reader.fields.get("general.architecture")
    if arch is not None:
        fields["general.architecture"] = arch.contents()
    data_start = int(reader.data_offset)
    tensors = [
        Tensor(
            t.name,
            t.tensor_type.name,
            tuple(int(n) for n in t.shape),
            int(t.data_offset),
            int(t.n_bytes),
            file,
        )
        for t in reader.tensors
    ]
    for t in tensors:
        if t.offset < data_start or t.offset + t.nbytes > size:
            raise RemoteSetError(f"{file}: tensor {t.name}: its bytes lie outside the {size}-byte file")
    return Header(
        file, size, fields, tensors, data_start, hashlib.sha256(head[:data_start]).hexdigest(), len(head)
    )


def tensor_pieces(t: Tensor, fetch: Fetch, piece: int = PIECE) -> Iterator[bytes]:
    """A tensor's bytes in pieces of at most ``piece`` bytes (each one ranged GET)."""
    at, end = t.offset, t.offset + t.nbytes
    while at < end:
        data = fetch(t.file, at, min(end, at + piece))
        at += len(data)
        yield data


def split_sets(names: list[str]) -> dict[str, list[str]]:
    """The split sets among a repo's files: ``BASE`` (name and type label) -> its files by number."""
    sets: dict[str, dict[int, str]] = {}
    for n in names:
        m = SPLIT.fullmatch(n)
        if m:
            sets.setdefault(m["base"], {})[int(m["no"])] = n
    return {base: [files[k] for k in sorted(files)] for base, files in sets.items()}
