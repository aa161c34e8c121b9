"""Files through O_DIRECT: a file's tail written, a file's ranges read. The kernel copies nothing
into the page cache (on a 2-core machine the write's copy costs as much CPU as the SHA-256 of the
same bytes, and a conversion of 1.4 TiB has no use for its input or output in the page cache).
O_DIRECT wants file offsets, lengths and memory aligned to the disk's block. ``DirectTail`` keeps
that promise for a stream of arbitrary pieces written one after another, and lets a producer make a
piece right where it will be sent from (``aligned`` memory, at the piece's offset within its first
block); ``FileReads`` reads any range from the blocks around it into reused buffers, the next one
ahead on a thread (plain reads where the page cache holds the file). Nothing here knows GGUF or safetensors."""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import mmap
import os
import threading
import weakref
from concurrent.futures import Future
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


# --- reading ---------------------------------------------------------------------------------------
# Reading a file once through the page cache costs the kernel a page's allocation, insertion, mapping
# and eviction per 4 KiB: 10.3 s of system time for a 17 GB shard on this project's 2-core benchmark
# machine, against 0.9 s read with O_DIRECT into reused buffers (the disk's DMA lands in them).

READ_AHEAD = 24 << 20  # bytes read ahead at most at once (a 16 MiB slab, or an expert's two pieces)
READ_KEEP = 24 << 20  # bytes of free buffers kept for the next reads (beyond: given back)
READ_HELD = READ_AHEAD + READ_KEEP  # what a source's buffers hold that no stream holds, at most
GRAIN = 64 << 10  # buffer sizes are multiples of it (a slab a block longer fits a buffer again)
STALE_READS = 8  # a range read ahead and not asked for within this many reads is dropped
MERGED_READ = 16 << 20  # bytes one read ahead may grow to from hints side by side (``FileReads.ahead``)


def in_page_cache(fd: int, samples: int = 4) -> bool:
    """Whether the file's pages are in the page cache, sampled at ``samples`` pages of its second half
    (its header is read by other means): a file just written or read is read from there, a file on
    disk only with O_DIRECT. Asked with ``mincore`` of a mapping never touched, so the asking reads
    nothing (a read told not to wait, ``RWF_NOWAIT``, still starts the kernel's readahead, and of a
    sparse file's holes it finishes it)."""
    size = os.fstat(fd).st_size
    mincore = getattr(_LIBC, "mincore", None)
    if size == 0 or mincore is None:
        return False
    resident = ctypes.c_ubyte()
    for k in range(samples):
        at = size - 1 - size * k // (2 * samples)
        base = at - at % mmap.ALLOCATIONGRANULARITY
        try:
            with mmap.mmap(fd, at + 1 - base, access=mmap.ACCESS_READ, offset=base) as m:
                view = np.frombuffer(m, dtype=np.uint8)
                page = view.ctypes.data + (at - base) // mmap.PAGESIZE * mmap.PAGESIZE
                failed = mincore(ctypes.c_void_p(page), ctypes.c_size_t(1), ctypes.byref(resident))
                del view
        except (OSError, ValueError):  # (a file that cannot be mapped, or shrank meanwhile: read direct)
            return False
        if failed or not resident.value & 1:
            return False
    return True


_LIBC = ctypes.CDLL(None, use_errno=True)


class ShortFile(OSError):
    """The file ends before the range asked for (it shrank since its header was read)."""


class ReadBuffers:
    """Aligned buffers (anonymous maps: page-aligned, their pages made once) lent to reads and taken
    back once nothing uses them; shared by all the files of one source. It also keeps the
    account of bytes read ahead, so that ahead and free together stay within ``READ_HELD``."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.ahead = 0  # bytes of reads ahead not yet asked for

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            fits = [m for m in self._free if len(m) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
        return mmap.mmap(-1, -(-nbytes // GRAIN) * GRAIN)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len)
            while self._free and sum(map(len, self._free)) > READ_KEEP:
                self._free.pop()  # the largest goes (unmapped once its last reference is)

    def lend(self, buf: mmap.mmap, nbytes: int) -> np.ndarray:
        """A read-only array of ``buf``'s first bytes; ``buf`` comes back when the array's memory
        has no user left (numpy keeps one memoryview under every array made from it)."""
        root = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        root.flags.writeable = False
        weakref.finalize(root.base, self.give, buf).atexit = False
        return root

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self.ahead + nbytes > READ_AHEAD:
                return False
            self.ahead += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.ahead -= nbytes


class FileReads:
    """Byte ranges of one open file read into ``ReadBuffers``: with O_DIRECT when ``direct`` (a file
    the page cache does not hold: from the disk, nothing cached), else plain reads (copied from the
    page cache, where a file just written or read is). Never mapped: a file that shrinks under a
    mapping kills the process (SIGBUS); a read says where the file ends. ``ahead`` starts a read on
    the file's thread (the next piece, while the caller works on this one), one read after another in
    the order asked (reads side by side, one a thread, made the disk slower: 31-34 s against 24-30 s
    for the dense shard); the thread ends when nothing is left to read, so none idles behind a file
    nobody releases. ``read`` takes the range from a read ahead that holds it, or reads it now. The
    file's descriptor is this object's: ``close`` waits for the thread, then closes it."""

    BLOCK = 4096

    def __init__(self, fd: int, buffers: ReadBuffers, direct: bool):
        self.fd, self.buffers = fd, buffers
        self.direct = direct and _set_direct(fd, True)
        self._queue: collections.deque[tuple[Future, int, int]] = collections.deque()
        self._thread: threading.Thread | None = None  # alive while the queue has reads
        self._ahead: dict[tuple[int, int], tuple[Future, int, int]] = {}  # range -> (read, bytes, asked at)
        self._reads = 0
        self._lock = threading.Lock()

    def _read_now(self, start: int, nbytes: int) -> np.ndarray:
        """Bytes ``[start, start + nbytes)`` of the file, from a buffer read from block boundaries
        (what O_DIRECT asks; a plain read of a few bytes more costs nothing)."""
        base = start - start % self.BLOCK
        stop = -(-(start + nbytes) // self.BLOCK) * self.BLOCK
        buf = self.buffers.take(stop - base)
        got, need = 0, start + nbytes - base
        with memoryview(buf) as whole:
            while got < need:
                try:
                    n = os.preadv(self.fd, [whole[got : stop - base]], base + got)
                except BaseException:
                    self.buffers.give(buf)
                    raise
                if n <= 0 or (n % self.BLOCK and got + n < need):
                    self.buffers.give(buf)
                    raise ShortFile(
                        f"the file ends at byte {base + got + max(n, 0)}, before byte {start + nbytes}"
                    )
                got += n
        return self.buffers.lend(buf, need)[start - base :]

    def ahead(self, start: int, nbytes: int) -> None:
        """A hint: ``[start, start + nbytes)`` is read next. Read now on the file's thread, unless the
        bytes held ahead would pass ``READ_AHEAD`` or a read ahead already holds them."""
        if nbytes <= 0:
            return
        with self._lock:
            if any(s <= start and start + nbytes <= e for s, e in self._ahead):
                return
            if not self.buffers.reserve(nbytes):
                return
            if self._queue and self._grow_last(start, nbytes):
                return
            read: Future = Future()
            self._ahead[(start, start + nbytes)] = (read, nbytes, self._reads)
            self._queue.append((read, start, nbytes))
            if self._thread is None:
                self._thread = threading.Thread(target=self._read_queued, name="k3lab-read")
                self._thread.daemon = True  # (a read is harmless: a process that ends does not wait)
                self._thread.start()

    def _grow_last(self, start: int, nbytes: int) -> bool:
        """The hint joined to the last read queued, when it begins where that one ends and that one
        has not begun: one read of both (an expert's weights and its scales lie side by side; one
        larger read keeps more of the disk busy than two, at no more memory)."""
        read, at, n = self._queue[-1]
        if at + n != start or n + nbytes > MERGED_READ or read.running():
            return False
        _, held, asked = self._ahead.pop((at, at + n))
        self._ahead[(at, start + nbytes)] = (read, held + nbytes, asked)
        self._queue[-1] = (read, at, n + nbytes)
        return True

    def _read_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                read, start, nbytes = self._queue.popleft()
            if not read.set_running_or_notify_cancel():
                continue  # (dropped before it began)
            try:
                read.set_result(self._read_now(start, nbytes))
            except BaseException as e:  # (the reader of the range raises it)
                read.set_exception(e)

    def read(self, start: int, nbytes: int) -> np.ndarray:
        """The bytes, read-only."""
        end = start + nbytes
        with self._lock:
            self._reads += 1
            held = next((r for r in self._ahead if r[0] <= start and end <= r[1]), None)
            pending = self._ahead[held][0] if held is not None else None
            for r, (read, n, at) in list(self._ahead.items()):
                # what this read finishes or runs past goes, and what was asked for long ago and
                # never read (not read at all if not begun: its budget is another hint's now)
                finished = r == held and r[1] == end
                passed = r != held and r[0] <= start < r[1] < end
                if finished or passed or (r != held and self._reads - at > STALE_READS):
                    del self._ahead[r]
                    self.buffers.unreserve(n)
                    if r != held:
                        read.cancel()
        try:
            if pending is not None:
                return pending.result()[start - held[0] : end - held[0]]
            return self._read_now(start, nbytes)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # the filesystem took O_DIRECT but refuses its reads (a block larger than ``BLOCK``):
            # plain reads from now on (a read ahead refused before that is read again here)
            if self.direct:
                _set_direct(self.fd, False)
                self.direct = False
            return self._read_now(start, nbytes)

    def close(self) -> None:
        """No read of this file runs once this returns; then its descriptor is closed."""
        with self._lock:
            self._queue.clear()  # (what is being read finishes; nothing more starts)
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            for _, n, _ in self._ahead.values():
                self.buffers.unreserve(n)
            self._ahead.clear()
        os.close(self.fd)


def _set_direct(fd: int, on: bool) -> bool:
    """O_DIRECT set on (or cleared from) an open file; False where the system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | flag if on else flags & ~flag)
    except OSError:
        return False
    return True
