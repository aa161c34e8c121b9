"""A GGUF split set in a Hub repo, read by byte ranges: every file's header, and any tensor's bytes.

A header is parsed as it arrives (``formats.gguf_header``, held to gguf-py's reader by the tests):
the parser says when it needs more, and the reads double from ``PROBE`` until the header ends (at
most twice the header's bytes in all, a few reads for file 1's 163,840-string vocabulary, which is
walked past, never held). Tensor bytes are read in pieces of ``PIECE`` bytes and handed on (to a hash), never
stored.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats import gguf_header

PROBE = 64 << 10  # the smallest ranged read of a header
MAX_HEADER = 512 << 20
PIECE = 16 << 20
SPLIT = re.compile(r"(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
KEYS = ("split.no", "split.count", "split.tensors.count", "general.architecture")

Fetch = Callable[[str, int, int], bytes]  # (file, start, stop) -> exactly those bytes


class RemoteSetError(K3LabError):
    """A repo's GGUF files cannot be read as a set: one line naming the file."""


@dataclass(frozen=True)
class Tensor(gguf_header.TensorInfo):
    """One tensor of a remote GGUF file, as its header says, and the file it is in."""

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
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_header(file: str, size: int, fetch: Fetch, probe: int = PROBE) -> Header:
    """``file``'s header, fetching only its bytes (and, to reach the data's alignment, its padding)."""
    have = bytearray()
    want = min(probe, size)
    while True:
        got = fetch(file, len(have), want) if want > len(have) else b""
        if not got and len(have) < want:
            raise RemoteSetError(f"{file}: the repo served no bytes from {len(have)} on, of {size}")
        have += got
        try:
            parsed = gguf_header.parse(have, KEYS, size)
        except gguf_header.NeedMore as more:
            if more.at_least > min(size, MAX_HEADER):
                raise RemoteSetError(f"{file}: its header runs past {min(size, MAX_HEADER)} bytes") from None
            want = min(size, max(more.at_least, 2 * len(have)))  # (at most twice the header in all)
            continue
        except gguf_header.GGUFHeaderError as e:
            raise RemoteSetError(f"{file}: {e}") from None
        # the padding up to the data's alignment (a file of no tensors, the tokenizer GGUF, may end
        # at its last key: its header is then the whole file)
        data_start = min(parsed.data_start, size)
        if data_start > len(have):
            want = data_start
            continue
        tensors = [Tensor(t.name, t.type, t.ne, t.offset, t.nbytes, file) for t in parsed.tensors]
        digest = hashlib.sha256(have[:data_start]).hexdigest()
        return Header(file, size, parsed.kvs, tensors, data_start, digest, len(have))


def tensor_pieces(t: Tensor, fetch: Fetch, piece: int = PIECE) -> Iterator[bytes]:
    """A tensor's bytes in pieces of at most ``piece`` bytes (each one ranged GET)."""
    at, end = t.offset, t.offset + t.nbytes
    while at < end:
        data = fetch(t.file, at, min(end, at + piece))
        at += len(data)
        yield data


def split_sets(names: list[str]) -> dict[str, list[str]]:
    """The GGUF sets among a repo's files: a split set's ``BASE`` (name and type label) -> its files
    by number; any other ``.gguf`` is a set of one, under its own name (a set of one file, as
    upstream's converter names it, or a file beside a set: which, its header says). Files of one
    base but another count are another set (``BASE (N files)``): neither stands in for the other."""
    sets: dict[tuple[str, int], dict[int, str]] = {}
    for n in names:
        m = SPLIT.fullmatch(n)
        if m:
            sets.setdefault((m["base"], int(m["count"])), {})[int(m["no"])] = n
        elif n.endswith(".gguf") and "/" not in n:
            sets.setdefault((n, 0), {})[1] = n
    counts: dict[str, int] = {}
    for base, _ in sets:
        counts[base] = counts.get(base, 0) + 1
    return {
        (base if counts[base] == 1 else f"{base} ({count} files)"): [files[k] for k in sorted(files)]
        for (base, count), files in sets.items()
    }
