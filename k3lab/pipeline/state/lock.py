"""The folder's lock: ``OUT/.k3lab/lock``, held (``flock``) by the one run writing the folder, with
``PID TOKEN`` inside. ``flock`` locks belong to the open file: the kernel drops the lock when its
holder exits, however it exits, so there is no stale lock to clear by hand. A run's other
processes (``--jobs`` workers, Dask tasks, a batch's notebooks) carry its token and check, before
they write, that the run still holds the folder."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from k3lab.errors import K3LabError
from k3lab.formats.files import InputFileError, open_lock_file, read_bounded


class FolderBusyError(K3LabError):
    """Another run is writing this output folder."""


class FolderLock:
    def __init__(self, folder: Path, path: Path):
        self.folder, self.path = folder, path

    @contextlib.contextmanager
    def hold(self, run_token: str | None = None) -> Iterator[str]:
        """Hold the lock for the block; yields the run's token. With ``run_token`` (a process of a run
        that already holds it), check that the holder is that run instead of locking."""
        if run_token is not None:
            self.check_held(run_token)
            yield run_token
            return
        fd = open_lock_file(self.path, "the folder's lock")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                pid, _ = self.holder()
                raise FolderBusyError(
                    f"{self.folder}: another k3lab run (pid {pid}) is writing this folder; wait for it or use another --out-dir"
                ) from None
            token = uuid.uuid4().hex
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {token}\n".encode(), 0)
            yield token
        finally:
            os.close(fd)  # releases the lock

    def check_held(self, run_token: str) -> None:
        """That the run with ``run_token`` holds the lock now (a task checks before it writes)."""
        _, token = self.holder()
        if token != run_token or self._free():
            raise FolderBusyError(
                f"{self.folder}: this task's run (token {run_token[:8]}) does not hold the folder lock"
            )

    def holder(self) -> tuple[str, str]:
        """(pid, token) of the run holding the folder, as its lock file says."""
        try:
            text = read_bounded(self.path, 4096, "lock file", follow=False).decode("ascii")
        except (InputFileError, UnicodeDecodeError):
            return "?", ""
        pid, _, token = text.strip().partition(" ")
        return pid or "?", token

    def _free(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
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
