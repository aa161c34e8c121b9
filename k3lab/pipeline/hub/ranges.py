"""Byte ranges of the Hub's files, fetched once: a bounded on-disk cache that proves what it serves.

Looking inside a 1.42 TiB model from a laptop means reading a tensor's bytes, never its 16 GiB shard:
a ``RangeCache`` hands out exactly the bytes asked for, from a range it holds or fetched now by
ranged GETs (``transport.fetch_range``, in pieces of ``PIECE`` bytes, each riding out outages within the
retry budget) and kept, so a notebook that draws a view again fetches nothing.

On disk (``K3LAB_CACHE``, else ``$XDG_CACHE_HOME/k3lab``, else ``~/.cache/k3lab``)::

  ranges/<key>/<start>-<stop>.<sha256>   exactly bytes [start, stop) of one file, whose SHA-256
                                         (of those bytes) is the name's last part
  <key> = SHA-256 of the file's identity at the Hub: repo, commit, path and the file's own id
          (its LFS SHA-256, or git blob id) -- ``FileIdentity.key``

What it guarantees:

- **Only what was fetched for this very file.** A range answers only for the repo, commit, path
  and file id it was fetched for: another repo whose listing claims the same SHA-256, another
  commit, another file never reads it.
- **Proved on every read.** An entry's bytes are hashed when it is read and compared with the
  SHA-256 recorded in its name when it was fetched: an entry whose bytes changed (a disk fault, a
  hand edit, a crash's short write) is dropped and the range fetched again, never served.
- **Checked content, refetched once.** A caller may give a ``check`` (a header must parse, its
  length must fit the file): a range that fails it is dropped and fetched once more before it
  becomes an error, so a range the Hub once served wrong does not outlive the Hub's fix.
- **Regular files inside the root, never followed links.** ``ranges/`` and every ``<key>/`` are
  opened without following links (``O_NOFOLLOW``) and entries only as regular files, without
  blocking (a FIFO never hangs a read); a folder that is a link, or an entry that is not a regular
  file, is left alone and the bytes are fetched without caching. The root itself is the user's to
  choose: a ``K3LAB_CACHE`` that is a link to another disk is followed.
- **Bounded.** ``K3LAB_CACHE_SIZE`` bytes (default 8 GiB): after each store the least recently read
  ranges go first. A reader holds an open descriptor (or a map) of the entry it proved, so an
  eviction meanwhile, by this process or another, cannot take its bytes away.
- **Whole names only.** An entry is written as ``.<start>-<stop>.PID.partial`` and renamed when
  whole; a crash leaves a partial (removed by the next store of that range) or nothing.

Bytes that ``convert`` converts never come from here (it converts downloaded files whose SHA-256
it checked); a plan's headers may, and a task re-checks each against its downloaded file (a header
that differs drops the file's ranges: see ``distrust``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from k3lab.errors import K3LabError, MachineError
from k3lab.formats.files import PARTIAL, cache_home
from k3lab.pipeline.hub.range_files import (
    CHANGED,
    DIR_FLAGS,
    from_fd,
    load_proved,
    open_dir_in,
    remove_entry,
    taken_by_another,
    write_all,
)

CACHE_ENV, SIZE_ENV = "K3LAB_CACHE", "K3LAB_CACHE_SIZE"
DEFAULT_SIZE = 8 << 30
PIECE = 32 << 20  # one ranged GET at most: a cut costs at most this much again
_ENTRY = re.compile(r"(\d{1,20})-(\d{1,20})\.([0-9a-f]{64})")
_KEY = re.compile(r"[0-9a-f]{64}")
# the layout before entries proved themselves (ranges/<oid>/<start>-<stop>): evicted first, never read
_OLD_ENTRY, _OLD_KEY = re.compile(r"\d{1,20}-\d{1,20}"), re.compile(r"git-[0-9a-f]{40}")


def cache_root() -> Path:
    """Where the cache lives: ``K3LAB_CACHE``, else the user's cache folder (``files.cache_home``)."""
    return cache_home()


def cache_limit() -> int:
    value = os.environ.get(SIZE_ENV, "").strip()
    if not value:
        return DEFAULT_SIZE
    if not re.fullmatch(r"[0-9]{1,16}", value):
        raise K3LabError(f"{SIZE_ENV}={value!r}: give a number of bytes")
    return int(value)


Fetch = Callable[[int, int], bytes]  # (start, stop) -> exactly those bytes
Check = Callable[[np.ndarray], object]  # raises K3LabError when the bytes cannot be the file's


@dataclass(frozen=True)
class FileIdentity:
    """A file as the Hub names it at one commit: what a cached range answers for, and only that."""

    repo: str
    commit: str
    path: str
    oid: str  # the LFS SHA-256, or ``git-<blob id>``

    @property
    def key(self) -> str:
        text = json.dumps([self.repo, self.commit, self.path, self.oid], ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Counts:
    """What reads cost: bytes fetched over the network, and bytes served from the cache."""

    fetched: int = 0
    cached: int = 0
    requests: int = 0
    dropped: int = 0  # entries dropped because their bytes failed a check
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, fetched: int = 0, cached: int = 0, requests: int = 0, dropped: int = 0) -> None:
        with self.lock:
            self.fetched += fetched
            self.cached += cached
            self.requests += requests
            self.dropped += dropped


class RangeCache:
    """Exact byte ranges of Hub files (by ``FileIdentity``), kept on disk within a size bound, each
    proved by its SHA-256 when read."""

    def __init__(self, root: Path | None = None, limit: int | None = None):
        self.base = root or cache_root()
        self.root = self.base / "ranges"
        self.limit = cache_limit() if limit is None else limit
        self.counts = Counts()
        self._lock = threading.Lock()
        self._stored, self._scanned = 0, False  # bytes stored since the last scan of the cache

    # --- reading ---
    def read(
        self, file: FileIdentity, start: int, stop: int, fetch: Fetch, check: Check | None = None
    ) -> np.ndarray:
        """Bytes ``[start, stop)`` of ``file`` as a read-only uint8 array: from a range held and
        proved, else fetched (in pieces) and kept. With ``check``, bytes that fail it are dropped and
        fetched once more; a second failure is the check's error."""
        if stop <= start:
            return np.empty(0, dtype=np.uint8)
        for attempt in (0, 1):
            data, name = self._held(file, start, stop) if attempt == 0 else (None, None)
            fresh = data is None
            if fresh:
                data, name = self._fetch(file, start, stop, fetch)
            if check is not None:
                try:
                    check(data)
                except K3LabError:
                    if name is not None:
                        self._drop(file, name)
                    if attempt == 1:
                        raise
                    continue
            if not fresh:
                self.counts.add(cached=stop - start)
            return data
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def _held(self, file: FileIdentity, start: int, stop: int) -> tuple[np.ndarray | None, str | None]:
        """A held range covering ``[start, stop)``, proved; entries that fail their proof are dropped."""
        folder = self._open_folder(file, create=False)
        if folder is None:
            return None, None
        try:
            for name in os.listdir(folder):
                m = _ENTRY.fullmatch(name)
                if not m or not (int(m[1]) <= start and stop <= int(m[2])):
                    continue
                a, b = int(m[1]), int(m[2])
                data = load_proved(folder, name, b - a, m[3], start - a, stop - start)
                if data is CHANGED:
                    remove_entry(folder, name)  # its bytes are not the ones fetched
                    self.counts.add(dropped=1)
                    continue
                if data is not None:
                    return data, name
            return None, None
        finally:
            os.close(folder)

    def distrust(self, file: FileIdentity) -> int:
        """Drop every range held of ``file`` (its bytes proved wrong elsewhere: a downloaded copy
        whose SHA-256 the Hub lists says otherwise). How many were dropped."""
        folder = self._open_folder(file, create=False)
        if folder is None:
            return 0
        try:
            gone = sum(remove_entry(folder, n) for n in os.listdir(folder) if _ENTRY.fullmatch(n))
        finally:
            os.close(folder)
        self.counts.add(dropped=gone)
        return gone

    def _drop(self, file: FileIdentity, name: str) -> None:
        folder = self._open_folder(file, create=False)
        if folder is not None:
            try:
                if remove_entry(folder, name):
                    self.counts.add(dropped=1)
            finally:
                os.close(folder)

    # --- fetching and storing ---
    def _fetch(
        self, file: FileIdentity, start: int, stop: int, fetch: Fetch
    ) -> tuple[np.ndarray, str | None]:
        """The range fetched now, and kept when the cache's folder for ``file`` can hold it (its name
        then, else None: a folder that is a link, or a name taken by something k3lab did not make)."""
        folder = self._open_folder(file, create=True)
        if folder is None:
            return np.frombuffer(self._fetch_all(start, stop, fetch), dtype=np.uint8), None
        try:
            return self._store(folder, file.key, start, stop, fetch)
        finally:
            os.close(folder)

    def _fetch_all(self, start: int, stop: int, fetch: Fetch) -> bytes:
        out = bytearray()
        for piece in self._pieces(start, stop, fetch):
            out += piece
        return bytes(out)

    def _pieces(self, start: int, stop: int, fetch: Fetch):
        at = start
        while at < stop:
            piece = fetch(at, min(stop, at + PIECE))
            if not piece:
                raise K3LabError(f"bytes [{at}, {stop}): the server sent none")
            self.counts.add(fetched=len(piece), requests=1)
            at += len(piece)
            yield piece

    def _store(
        self, folder: int, file_key: str, start: int, stop: int, fetch: Fetch
    ) -> tuple[np.ndarray, str | None]:
        tmp = f".{start}-{stop}.{os.getpid()}.{threading.get_ident()}{PARTIAL}"
        remove_entry(folder, tmp)  # (a killed store of this process id's)
        fd = os.open(
            tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder
        )
        try:
            h = hashlib.sha256()
            for piece in self._pieces(start, stop, fetch):
                h.update(piece)
                try:
                    write_all(fd, piece)
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    raise MachineError(
                        f"{self.root / file_key / tmp}: no space left on the device for k3lab's cache of"
                        f" Hub ranges ({stop - start:,} bytes; {self._free():,} free): free space there,"
                        " or set K3LAB_CACHE to a folder on a disk with room"
                    ) from None
            name = f"{start}-{stop}.{h.hexdigest()}"
            data = from_fd(fd, stop - start, 0, stop - start)
            # no fsync: a crash may lose a range or cut it short; a read proves it and fetches again
            if taken_by_another(folder, name):
                os.unlink(tmp, dir_fd=folder)
                return data, None
            os.rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            remove_entry(folder, tmp)
            raise
        finally:
            os.close(fd)
        self._evict(keep=name, size=stop - start)
        return data, name

    def _open_folder(self, file: FileIdentity, create: bool) -> int | None:
        """A descriptor of ``ranges/<key>/``, never through a link (None: absent, or not a folder k3lab
        can use)."""
        key = file.key
        assert _KEY.fullmatch(key)
        try:
            if create:
                self.base.mkdir(parents=True, exist_ok=True)
            base = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # (the user's choice)
        except OSError:
            return None
        try:
            ranges = open_dir_in(base, "ranges", create)
            if ranges is None:
                return None
            try:
                return open_dir_in(ranges, key, create)
            finally:
                os.close(ranges)
        finally:
            os.close(base)

    def _free(self) -> int:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return 0

    # --- the bound ---
    def _evict(self, keep: str, size: int) -> None:
        """Delete the least recently read ranges until the cache is within its bound (the folder is
        scanned when the running total may have passed the bound: at most every 1/16 of it)."""
        with self._lock:
            self._stored += size
            if self._stored < self.limit // 16 and self._scanned:
                return
            self._stored, self._scanned = 0, True
            try:
                ranges = os.open(self.root, DIR_FLAGS)
            except OSError:
                return
            try:
                entries = []
                for key in os.listdir(ranges):
                    known = _KEY.fullmatch(key) or _OLD_KEY.fullmatch(key)
                    folder = open_dir_in(ranges, key, False) if known else None
                    if folder is None:
                        continue
                    try:
                        for name in os.listdir(folder):
                            old = _OLD_ENTRY.fullmatch(name)
                            if not (old or _ENTRY.fullmatch(name)):
                                continue
                            try:
                                st = os.stat(name, dir_fd=folder, follow_symlinks=False)
                            except OSError:
                                continue
                            if stat.S_ISREG(st.st_mode):
                                entries.append((0 if old else st.st_atime_ns, st.st_size, key, name))
                    finally:
                        os.close(folder)
                total = sum(e[1] for e in entries)
                for _, nbytes, key, name in sorted(entries):
                    if total <= self.limit:
                        break
                    if name == keep:
                        continue
                    folder = open_dir_in(ranges, key, False)
                    if folder is not None:
                        try:
                            if remove_entry(folder, name):
                                total -= nbytes
                        finally:
                            os.close(folder)
            finally:
                os.close(ranges)
