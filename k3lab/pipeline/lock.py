"""One writer per output folder: an OS lock on ``OUT/.k3lab/lock``, held for the whole run.

``flock`` locks belong to the open file, so the kernel drops the lock when its holder exits, however
it exits (``kill -9`` included): there is no stale lock to clear by hand. The file holds the
holder's pid and a run token. A second run on the same folder fails at once with one line naming
the pid. The processes of one run (its ``--jobs`` workers, Dask tasks, the notebooks a batch runs)
do not take the lock: they are given the run's token and check they belong to the run holding it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from k3lab.errors import K3LabError

LOCK_NAME = "lock"


class FolderBusyError(K3LabError):
    """Another run is writing this output folder."""


def _holder(path: Path) -> tuple[str, str]:
    try:
        pid, _, token = path.read_text(encoding="utf-8").strip().partition(" ")
    except OSError:
        return "?", ""
    return pid or "?", token


@contextlib.contextmanager
def hold_folder(out_dir: str | Path, run_token: str | None = None) -> Iterator[str]:
    """Hold ``out_dir``'s lock for the block; yields the run's token. With ``run_token`` (a process of
    a run that already holds it), check the holder is that run instead of locking."""
    d = Path(out_dir) / ".k3lab"
    path = d / LOCK_NAME
    if run_token is not None:
        pid, token = _holder(path)
        if token != run_token or _is_free(path):
            raise FolderBusyError(
                f"{out_dir}: this task's run (token {run_token[:8]}) does not hold the folder lock"
            )
        yield run_token
        return
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            pid, _ = _holder(path)
            raise FolderBusyError(
                f"{out_dir}: another k3lab run (pid {pid}) is writing this folder; wait for it or use another --out-dir"
            ) from None
        token = uuid.uuid4().hex
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {token}\n".encode(), 0)
        yield token
    finally:
        os.close(fd)  # releases the lock


def _is_free(path: Path) -> bool:
    """Whether nobody holds the lock (tested without taking it for long)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def remove_partials(out_dir: str | Path) -> list[Path]:
    """Delete ``*.partial`` files a killed run left (only while holding the folder's lock)."""
    out_dir = Path(out_dir)
    gone = [*out_dir.glob("*.partial"), *(out_dir / ".k3lab").glob("*.partial")]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone
