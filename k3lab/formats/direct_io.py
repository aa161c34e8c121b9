"""Writing a file's tail with O_DIRECT: the kernel copies nothing into the page cache (on a 2-core
machine that copy costs as much CPU as the SHA-256 of the same bytes, and a conversion of 1.4 TiB
has no use for its output in the page cache). O_DIRECT wants file offsets, lengths and memory
aligned to the disk's block; ``DirectTail`` keeps that promise for a stream of arbitrary pieces
written one after another, and lets a producer make a piece right where it will be sent from
(``aligned`` memory, at the piece's offset within its first block). Nothing here knows GGUF."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np


class DirectTail:
    """A file's data from byte ``start`` on, written with O_DIRECT. Bytes gather in an aligned
    staging buffer that starts at the block boundary at or before the data; each full buffer is one
    aligned direct write (its first one rewrites the last block of what was written before with the same bytes); the
    unaligned remainder goes through the ordinary descriptor at the end. Where the filesystem has no
    O_DIRECT (tmpfs), ``open`` returns None and the writer stays buffered."""

    BLOCK = 4096
    STAGE = 8 << 20

    def __init__(self, fd: int, plain: int, start: int, partial: Path):
        self.fd, self.plain = fd, plain
        self.base = start - start % self.BLOCK  # file offset of stage[0]
        self.stage = mmap.mmap(-1, self.STAGE)  # page-aligned
        self.fill = start - self.base
        with open(partial, "rb") as fh:  # the header's last block (the writer's descriptor is write-only)
            fh.seek(self.base)
            self.stage[: self.fill] = fh.read(self.fill)

    @classmethod
    def open(cls, fh: Any, partial: Path) -> DirectTail | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        fh.flush()
        try:
            fd = os.open(partial, os.O_WRONLY | flag)
        except OSError:
            return None
        try:
            return cls(fd, fh.fileno(), fh.tell(), partial)
        except OSError:
            os.close(fd)
            return None

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = min(len(view), self.STAGE - self.fill)
            self.stage[self.fill : self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]
            if self.fill == self.STAGE:
                self._put(self.fd, self.STAGE)
                self.base += self.STAGE
                self.fill = 0

    def write_placed(self, block: np.ndarray, lead: int, nbytes: int) -> None:
        """A piece made in ``block[lead:lead + nbytes]``: ``block`` is aligned and ``lead`` is the
        piece's file offset within its disk block. The bytes staged before it fill ``block[:lead]``,
        the whole blocks go out from ``block`` itself, and the last partial block is staged."""
        before = self.fill - lead  # staged bytes of whole blocks before the piece's first block
        if before:
            self._put(self.fd, before)
            self.base += before
        block[:lead] = np.frombuffer(self.stage, np.uint8, lead, before)
        end = lead + nbytes
        whole = end - end % self.BLOCK
        pwrite_all(self.fd, memoryview(block[:whole]), self.base)
        self.base += whole
        self.stage[: end - whole] = block[whole:end].tobytes()  # under one block
        self.fill = end - whole

    def _put(self, fd: int, n: int) -> None:
        with memoryview(self.stage) as whole:
            pwrite_all(fd, whole[:n], self.base)

    def finish(self) -> None:
        """The last, unaligned stretch through the ordinary descriptor (fsynced with the file)."""
        os.fsync(self.fd)
        self._put(self.plain, self.fill)

    def close(self) -> None:
        os.close(self.fd)
        self.stage.close()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    try:
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
    except BaseException:
        # a traceback keeps its frames' locals: a view of the staging buffer kept alive here would
        # stop it from being closed (BufferError) while the write's own error is being reported
        del data
        raise


def aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of memory starting on a disk block boundary (what O_DIRECT writes from)."""
    raw = np.empty(nbytes + DirectTail.BLOCK, dtype=np.uint8)
    start = -raw.ctypes.data % DirectTail.BLOCK
    return raw[start : start + nbytes]
