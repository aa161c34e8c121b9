"""What a conversion read of each source file, proven by its content: the SHA-256 of every source
tensor's bytes, made as they are read (on a thread of its own), and the file's identity when its
reading began. A record keeps both (``Record.read``); a later run takes an output file as finished
only while every local source file it read is the same: the same identity, or, when that changed (a
touch, a copy, data rewritten in place under the same header), the same bytes hashed again. A source
whose files cannot change under a run (the Hub: one pinned commit, every download checked against its
SHA-256) records no identity and is not hashed.

A file's digest (``files_digest``) is the SHA-256 over its tensors' names and SHA-256s, in name order:
it does not depend on the order the converter read them in, and a rerun makes it again by reading
each tensor whole. A tensor a stream read out of order (no stream of k3lab's does) leaves its file
without a digest: that file's output is then redone whenever its identity changes.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np

from k3lab.formats import hashing

PROOF_PIECE = 16 << 20  # bytes of a tensor read at once when it is hashed again
HASH_HELD = 16 << 20  # bytes of read pieces waiting to be hashed, at most (the forecast counts them)


def files_digest(tensor_sha: dict[str, str]) -> str:
    """One file's digest from its tensors' SHA-256s (see the module's docstring)."""
    h = hashlib.sha256()
    for name in sorted(tensor_sha):
        h.update(f"{name}\0{tensor_sha[name]}\n".encode())
    return h.hexdigest()


class _Tensor:
    __slots__ = ("hasher", "next", "complete", "sha")

    def __init__(self) -> None:
        self.hasher = hashlib.sha256()
        self.next = 0
        self.complete = False  # every piece given to the hashing thread
        self.sha: str | None = None  # set on the hashing thread once the last piece is hashed


def _finish(t: _Tensor) -> None:
    t.sha = t.hasher.hexdigest()


class SourceHashes:
    """The bytes a task reads, hashed as they are read: ``began`` with each file's identity when its
    reading begins, ``seen`` with every piece (a tensor read from its start to its end, in order, gets
    a SHA-256; a tensor read again after that is not hashed again). Pieces wait for the hashing thread
    up to ``HASH_HELD`` bytes; past that, the reader waits. ``read`` then says, per file, its identity
    when it began (None: nothing to prove, or it changed while it was read) and its digest (None: a
    tensor was read out of order, or not whole)."""

    def __init__(self) -> None:
        self._tensors: dict[tuple[str, str], _Tensor] = {}
        self._identity: dict[str, dict[str, Any] | None] = {}
        self._broken: set[str] = set()
        self._pending: collections.deque[tuple[Future, int]] = collections.deque()
        self._held = 0

    def began(self, file: str, identity: dict[str, Any] | None) -> None:
        self._identity.setdefault(file, identity)

    def seen(self, file: str, name: str, nbytes: int, offset: int, piece: np.ndarray) -> None:
        if self._identity.get(file) is None or file in self._broken:  # (nothing to check it against)
            return
        t = self._tensors.get((file, name))
        if t is None:
            t = self._tensors[(file, name)] = _Tensor()
        if t.complete:  # (hashed whole already)
            return
        if offset != t.next:
            self._broken.add(file)
            return
        while self._pending and self._held + piece.nbytes > HASH_HELD:
            done, n = self._pending.popleft()
            done.result()
            self._held -= n
        self._pending.append((hashing.on_read_lane(t.hasher.update, hashing.as_bytes(piece)), piece.nbytes))
        self._held += piece.nbytes
        t.next += piece.nbytes
        if t.next == nbytes:
            t.complete = True
            hashing.on_read_lane(_finish, t)

    def read(self, identity_now: Callable[[str], dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
        """Per file read: ``{"identity", "sha256"}`` (see the class's docstring)."""
        hashing.on_read_lane(lambda: None).result()  # (everything given before is hashed)
        self._pending.clear()
        self._held = 0
        out: dict[str, dict[str, Any]] = {}
        for file, began in self._identity.items():
            mine = {name: t.sha for (f, name), t in self._tensors.items() if f == file}
            whole = began is not None and file not in self._broken and None not in mine.values()
            same = began is not None and identity_now(file) == began
            out[file] = {
                "identity": began if same else None,
                "sha256": files_digest(mine) if whole and same else None,  # type: ignore[arg-type]
            }
        return out


def hashed_again(
    names: Iterable[str], read: Callable[[str, int, int], np.ndarray], sizes: dict[str, int]
) -> str:
    """A file's digest made again: each named tensor read whole (``read(name, offset, nbytes)``, in
    bounded pieces) and hashed."""
    shas = {}
    for name in names:
        h = hashlib.sha256()
        size = sizes[name]
        for at in range(0, size, PROOF_PIECE):
            h.update(hashing.as_bytes(read(name, at, min(PROOF_PIECE, size - at))))
        shas[name] = h.hexdigest()
    return files_digest(shas)
