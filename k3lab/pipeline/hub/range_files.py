"""The range cache's folders and entries on disk (``ranges``), by descriptor: folders opened
without following links, entries only as regular files and without blocking, an entry proved by the
SHA-256 its name records before any byte of it is handed out, and handed out as bytes read or a map
that stay valid after the name is gone (an eviction cannot take them from a reader)."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import stat
import time

import numpy as np

from k3lab.errors import K3LabError

MAP_FROM = 16 << 20  # entries this large are mapped; smaller ones are read (a map costs more than a read)
HASH_STEP = 16 << 20  # bytes hashed at once when proving a mapped entry
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CHANGED = object()  # an entry whose bytes are not the ones its name records


def open_dir_in(parent: int, name: str, create: bool) -> int | None:
    """``name`` inside the folder ``parent`` as a folder descriptor, never through a link."""
    for attempt in (0, 1):
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create or attempt:
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                pass  # (another process made it meanwhile)
            except OSError:
                return None
        except OSError:  # a link (ELOOP), a file (ENOTDIR), no permission: not a folder to use
            return None
    return None


def load_proved(folder: int, name: str, size: int, digest: str, offset: int, n: int) -> object:
    """``n`` bytes from ``offset`` of the entry ``name`` of ``size`` bytes, whose whole bytes must
    hash to ``digest``: an array; None when it is gone or not a regular file (left alone); ``CHANGED``
    when its bytes are not the recorded ones. Marks it read (its access time orders eviction)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size != size:
            return CHANGED
        whole = from_fd(fd, size, 0, size)
        h = hashlib.sha256()
        view = memoryview(whole)
        for at in range(0, size, HASH_STEP):
            h.update(view[at : at + HASH_STEP])
        if h.hexdigest() != digest:
            return CHANGED
        os.utime(fd, ns=(_now_ns(), st.st_mtime_ns))
        return whole[offset : offset + n]
    finally:
        os.close(fd)


def from_fd(fd: int, size: int, offset: int, n: int) -> np.ndarray:
    """``n`` bytes from ``offset`` of an open file of ``size`` bytes, read-only: read (small) or mapped
    (large); either stays valid after the descriptor is closed and the name removed."""
    if size >= MAP_FROM:
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        return np.frombuffer(mapped, dtype=np.uint8, count=n, offset=offset)
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise K3LabError(f"a cached range: {len(data)} of {n} bytes read")
    return np.frombuffer(data, dtype=np.uint8)


def remove_entry(folder: int, name: str) -> bool:
    """Delete ``name`` in ``folder`` if it is a regular file (k3lab's own by its name); anything else
    of that name is left alone. Whether it deleted one."""
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(name, dir_fd=folder)
        return True
    except OSError:
        return False


def taken_by_another(folder: int, name: str) -> bool:
    """Whether ``name`` is held by something that is not a regular file (never replaced)."""
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError as e:
        return e.errno != errno.ENOENT
    return not stat.S_ISREG(st.st_mode)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _now_ns() -> int:
    return time.time_ns()
