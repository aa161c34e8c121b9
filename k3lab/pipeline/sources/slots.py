"""Download slots: where a Hub download lives while its shard is converted.

``SCRATCH/k3lab-dl-KEY/`` (huggingface_hub downloads into it) and its lock ``SCRATCH/k3lab-dl-KEY.lock``,
``flock``ed by the process using it: the kernel releases the lock however that process ends. A slot
whose lock is free is a dead task's leftover, and the next task to download in that scratch removes
it (``sweep_scratch``). ``--keep-source`` marks a slot kept (``k3lab-dl-KEY.kept``). Only these
names are ever touched, never through a symlink."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
from pathlib import Path

from k3lab.formats.files import open_lock_file

SLOT_PREFIX = "k3lab-dl-"
_SLOT_NAME = re.compile(rf"{SLOT_PREFIX}([0-9a-f]{{32}})(\.lock|\.kept)?")


class Slot:
    """``SCRATCH/k3lab-dl-KEY/`` and its lock file ``SCRATCH/k3lab-dl-KEY.lock``: one download, held
    (``flock``) by the process using it. Only k3lab's own names, never through a symlink."""

    def __init__(self, scratch: Path, key: str):
        self.folder = scratch / f"{SLOT_PREFIX}{key}"
        self.lock_path = scratch / f"{SLOT_PREFIX}{key}.lock"
        self.kept_path = scratch / f"{SLOT_PREFIX}{key}.kept"
        self.fd: int | None = None

    def take(self, block: bool) -> bool:
        """Hold the slot's lock (waiting for it when ``block``); False if another process holds it."""
        while True:
            fd = open_lock_file(self.lock_path, "download slot's lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return False
                raise
            # the lock file may have been removed (and made anew) while we waited: lock that one
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.lock_path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    self.fd = fd
                    return True
            os.close(fd)

    def remove(self) -> None:
        """Delete the download and the lock (this process holds it)."""
        _remove_tree(self.folder)
        self.kept_path.unlink(missing_ok=True)
        self.lock_path.unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _remove_tree(path: Path) -> None:
    """A slot folder k3lab made: removed if it is a real folder (a symlink is only unlinked)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    elif stat.S_ISLNK(st.st_mode):
        path.unlink(missing_ok=True)


def sweep_scratch(scratch: Path, keep: str = "") -> list[str]:
    """Remove the download slots of tasks that died (their lock is free), except kept ones and
    ``keep`` (the slot about to be taken: its bytes so far resume the download); only k3lab's own
    names. Returns the keys removed."""
    try:
        names = os.listdir(scratch)
    except (FileNotFoundError, NotADirectoryError):
        return []
    keys = {m[1] for n in names if (m := _SLOT_NAME.fullmatch(n))}
    removed = []
    for key in sorted(keys - {keep}):
        slot = Slot(scratch, key)
        if not slot.take(block=False):
            continue  # in use by a live process
        try:
            if slot.kept_path.exists():
                continue  # --keep-source
            slot.remove()
            removed.append(key)
        finally:
            slot.release()
    return removed
