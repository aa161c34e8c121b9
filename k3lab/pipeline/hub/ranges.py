"""Byte ranges of the Hub's files, fetched once: a bounded on-disk cache.

Looking inside a 1.42 TiB model from a laptop means reading a tensor's bytes, never its 16 GiB shard:
a ``RangeCache`` hands out exactly the bytes asked for, from a range it holds or fetched now by
ranged GETs (``transport.fetch_range``, in pieces of ``PIECE`` bytes, each riding out outages within the
retry budget) and kept, so a notebook that draws a view again fetches nothing.

On disk (``K3LAB_CACHE``, else ``$XDG_CACHE_HOME/k3lab``, else ``~/.cache/k3lab``)::

  ranges/<file oid>/<start>-<stop>     exactly bytes [start, stop) of the file with that oid
                                       (its SHA-256, or git blob id: the same bytes in any repo or commit)

written as ``NAME.PID.partial``, fsynced and renamed, so a name only ever holds whole bytes. The
cache is bounded by ``K3LAB_CACHE_SIZE`` (bytes, default 8 GiB): after each store the least recently
used ranges go first. Reads map the cached file (no copy): memory stays bounded whatever the size.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.files import partial_path, remove_regular

CACHE_ENV, SIZE_ENV = "K3LAB_CACHE", "K3LAB_CACHE_SIZE"
DEFAULT_SIZE = 8 << 30
PIECE = 32 << 20  # one ranged GET at most: a cut costs at most this much again
_RANGE = re.compile(r"(\d+)-(\d+)")
_OID = re.compile(r"[0-9a-z-]{8,80}")


def cache_root() -> Path:
    """Where the cache lives: ``K3LAB_CACHE``, else the user's cache folder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3lab"


def cache_limit() -> int:
    value = os.environ.get(SIZE_ENV, "").strip()
    if not value:
        return DEFAULT_SIZE
    if not re.fullmatch(r"[0-9]{1,16}", value):
        raise K3LabError(f"{SIZE_ENV}={value!r}: give a number of bytes")
    return int(value)


Fetch = Callable[[int, int], bytes]  # (start, stop) -> exactly those bytes


@dataclass
class Counts:
    """What reads cost: bytes fetched over the network, and bytes served from the cache."""

    fetched: int = 0
    cached: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, fetched: int = 0, cached: int = 0, requests: int = 0) -> None:
        with self.lock:
            self.fetched += fetched
            self.cached += cached
            self.requests += requests


class RangeCache:
    """Exact byte ranges of files (by oid), kept on disk within a size bound."""

    def __init__(self, root: Path | None = None, limit: int | None = None):
        self.root = (root or cache_root()) / "ranges"
        self.limit = cache_limit() if limit is None else limit
        self.counts = Counts()
        self._lock = threading.Lock()
        self._index: dict[str, list[tuple[int, int, Path]]] = {}  # oid -> ranges held (listed once)
        self._stored, self._scanned = 0, False  # bytes stored since the last scan of the cache

    def _folder(self, oid: str) -> Path:
        if not _OID.fullmatch(oid):
            raise K3LabError(f"{oid!r}: not a file id the range cache can name")
        return self.root / oid

    def _held(self, oid: str) -> list[tuple[int, int, Path]]:
        """The ranges held for ``oid``: listed from disk once, then kept up to date by this process
        (a range another process stored meanwhile is fetched again: only a cost, never wrong bytes)."""
        with self._lock:
            held = self._index.get(oid)
            if held is not None:
                return list(held)
        folder = self._folder(oid)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            names = []
        held = [(int(m[1]), int(m[2]), folder / n) for n in names if (m := _RANGE.fullmatch(n))]
        with self._lock:
            self._index[oid] = held
        return list(held)

    def read(self, oid: str, start: int, stop: int, fetch: Fetch) -> np.ndarray:
        """Bytes ``[start, stop)`` of the file ``oid``, as a read-only uint8 array mapped from the
        cache: from a range held there, else fetched (in pieces) and kept."""
        if stop <= start:
            return np.empty(0, dtype=np.uint8)
        for a, b, path in self._held(oid):
            if a <= start and stop <= b:
                data = _load(path, b - a, start - a, stop - start)
                if data is None:  # removed meanwhile (evicted), or cut short by a crash: fetch again
                    self._forget(oid, path)
                    continue
                self.counts.add(cached=stop - start)
                return data
        path = self._store(oid, start, stop, fetch)
        data = _load(path, stop - start, 0, stop - start)
        if data is None:
            raise K3LabError(
                f"{path}: a range just stored is gone (is the cache shared with a smaller bound?)"
            )
        return data

    def _store(self, oid: str, start: int, stop: int, fetch: Fetch) -> Path:
        folder = self._folder(oid)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{start}-{stop}"
        tmp = partial_path(path, os.getpid())
        remove_regular(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            with open(fd, "wb") as fh:
                at = start
                while at < stop:
                    piece = fetch(at, min(stop, at + PIECE))
                    fh.write(piece)
                    self.counts.add(fetched=len(piece), requests=1)
                    at += len(piece)
            # no fsync: a cache may lose a range in a crash (a read checks each range's size, and a
            # short one is fetched again), and an fsync per range would cost more than its fetch
            os.replace(tmp, path)
        except BaseException:
            remove_regular(tmp)
            raise
        with self._lock:
            self._index.setdefault(oid, []).append((start, stop, path))
        self._evict(keep=path)
        return path

    def _forget(self, oid: str, path: Path) -> None:
        with self._lock:
            self._index[oid] = [r for r in self._index.get(oid, []) if r[2] != path]

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used ranges until the cache is within its bound (the folder is
        scanned when the running total may have passed the bound: at most every 1/16 of it)."""
        size = os.stat(keep).st_size
        with self._lock:
            self._stored += size
            if self._stored < self.limit // 16 and self._scanned:
                return
            self._stored, self._scanned = 0, True
            entries = []
            try:
                folders = list(os.scandir(self.root))
            except FileNotFoundError:
                return
            for d in folders:
                if not d.is_dir(follow_symlinks=False):
                    continue
                for f in os.scandir(d.path):
                    if _RANGE.fullmatch(f.name) and f.is_file(follow_symlinks=False):
                        st = f.stat(follow_symlinks=False)
                        entries.append((st.st_mtime_ns, st.st_size, Path(f.path)))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= self.limit:
                    break
                if path != keep and remove_regular(path):
                    total -= size
                    for oid, held in self._index.items():
                        self._index[oid] = [r for r in held if r[2] != path]


MAP_FROM = 16 << 20  # ranges this large are mapped; smaller ones are read (a map costs more than a read)


def _load(path: Path, size: int, offset: int, n: int) -> np.ndarray | None:
    """``n`` bytes from ``offset`` of a cached range of ``size`` bytes (None when it is gone or is
    not that size: a crash can leave a renamed range without its bytes); marks it used."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        os.utime(fd)
        if n >= MAP_FROM:
            return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(n,))
        data = os.pread(fd, n, offset)
        return np.frombuffer(data, dtype=np.uint8) if len(data) == n else None
    finally:
        os.close(fd)
