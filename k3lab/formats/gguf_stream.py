"""Streaming GGUF writing: header, KV and tensor infos through gguf-py's GGUFWriter, then tensor
data one tensor (or one piece of a tensor) at a time, hashed as it goes. Nothing model-specific.

gguf-py's ``add_tensor`` keeps every tensor in memory until the write; here tensor infos are
declared first and the data is streamed in declared order, so memory stays bounded by the
largest piece a caller hands over. The file is written as ``NAME.partial``, fsynced, then
renamed: a final path only ever holds a complete file, and a failure leaves nothing there. A
``before_commit`` callback may still refuse the finished file (the writer's run has stopped): it is
deleted, never renamed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError, MachineError
from k3lab.formats import hashing
from k3lab.formats.direct_io import DirectTail, aligned
from k3lab.formats.files import fsync_dir, partial_path, remove_regular
from k3lab.formats.gguf_data import (  # noqa: F401 (KV and the rest: imported from here by the pipeline)
    ALIGNMENT,
    KV,
    TensorInfo,
    _writer,
    file_size,
    kvs_from_json,
    kvs_to_json,
    split_kvs,
)

PIECES_IN_FLIGHT = 2  # pieces the writer may still be hashing or writing while the producer makes the next
WRITEBACK_STEP = 64 * 1024 * 1024  # bytes written between writeback requests


def _claim(partial: Path) -> None:
    """Create ``partial`` new (``O_EXCL | O_NOFOLLOW``) before gguf-py opens it, so that the file is
    never written through a symlink or over a file k3lab did not make. A regular file of this very
    name is an earlier, killed write of the same file: it goes first."""
    remove_regular(partial)
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    except FileExistsError:
        raise K3LabError(
            f"{partial}: exists and is not a file k3lab made (a symlink?); k3lab will not write through it"
        ) from None


class GGUFStream:
    """Write one GGUF file: ``with GGUFStream(path, arch, kvs, infos) as g: g.write(name, pieces)``.
    ``arch``: general.architecture, written first; None: exactly the keys ``kvs`` lists, in order.
    ``infos``: anything with a name, a GGML type (its number), a shape (numpy order) and its bytes."""

    def __init__(
        self,
        path: str | os.PathLike,
        arch: str | None,
        kvs: Sequence[KV],
        infos: Sequence[TensorInfo],
        before_commit: Callable[[], None] | None = None,
        file_sha256: bool = False,
    ):
        self.path = Path(path)
        # the whole file's SHA-256, made as its bytes go out (on the hashing thread, in file order),
        # when asked for: what an upload needs, so that nothing reads the finished file to hash it
        self._whole = hashing.sha256() if file_sha256 else None
        self.file_sha256: str | None = None
        self.before_commit = before_commit  # may refuse the finished file: then it is deleted
        self.partial = partial_path(self.path)
        self.infos = list(infos)
        self._next = 0
        self._flushed = self._dropped = 0  # file offsets handed to the kernel's writeback
        self._writeback: ThreadPoolExecutor | None = None
        self._writeback_requests: list[Future] = []
        self._io: ThreadPoolExecutor | None = None
        self._direct: DirectTail | None = None
        self._ring: list[np.ndarray | None] = [None] * (PIECES_IN_FLIGHT + 1)  # buffers `buffer` lends
        self._turn = 0
        self._lent: tuple[np.ndarray, np.ndarray, int] | None = None  # (piece, its block, lead) last lent
        self.hashes: dict[str, str] = {}
        self._writer = _writer(self.partial, arch, kvs, self.infos)

    def __enter__(self) -> GGUFStream:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        _claim(self.partial)
        try:
            self._writer.write_header_to_file(self.partial)
            self._writer.write_kv_data_to_file()
            self._writer.write_ti_data_to_file()
            self._fh = self._writer.fout[0]
            self._pos = self._fh.tell()  # bytes handed to the I/O thread so far
            if self._whole is not None:  # the header, as written (small: the only bytes read back)
                self._fh.flush()
                with open(self.partial, "rb") as fh:
                    self._whole.update(fh.read(self._pos))
            self.data_start = self.data_offset_next()
            self._direct = DirectTail.open(self._fh, self.partial) if self.infos else None
        except BaseException as e:
            fout = self._writer.fout
            for fh in fout or []:
                with contextlib.suppress(OSError):
                    fh.close()
            self._writer.fout = None
            self.partial.unlink(missing_ok=True)
            raise _explained(e, self.path, "the header and metadata", self._expected_size()) from None
        return self

    def _expected_size(self) -> int:
        """The finished file's size: header (as far as known) plus aligned tensor data."""
        pos = getattr(self, "data_start", 0)
        for ti in self.infos:
            pos += -pos % ALIGNMENT + ti.nbytes
        return pos + (-pos % ALIGNMENT if self.infos else 0)

    def data_offset_next(self) -> int:
        """Absolute file offset where the next tensor's data will start."""
        return self._pos + (-self._pos % ALIGNMENT)

    def _submit_write(self, data: bytes | memoryview, what: str) -> None:
        """Write on the I/O thread, in order: a write the kernel throttles to the disk's speed then
        overlaps the producer's reading and repacking. Queued with the hashes (``hashing.track``)."""
        self._pos += len(data)
        if self._whole is not None:
            hashing.update(self._whole, data)
        self._queue(self._write_now, data, what)

    def _submit_placed(self, block: np.ndarray, lead: int, nbytes: int, what: str) -> None:
        """Like ``_submit_write`` for a piece made in ``block[lead:lead + nbytes]`` (see ``buffer``)."""
        self._pos += nbytes
        if self._whole is not None:
            hashing.update(self._whole, block[lead : lead + nbytes])
        self._queue(self._write_placed_now, block, lead, nbytes, what)

    def _queue(self, fn: Callable[..., None], *args: Any) -> None:
        if self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="k3lab-write")
        hashing.track(self._io.submit(fn, *args))

    def _write_placed_now(self, block: np.ndarray, lead: int, nbytes: int, what: str) -> None:
        try:
            assert self._direct is not None
            self._direct.write_placed(block, lead, nbytes)
        except OSError as e:
            raise _explained(e, self.path, what, self._expected_size()) from None

    def _write_now(self, data: bytes | memoryview, what: str) -> None:
        try:
            if self._direct is not None:
                self._direct.write(data)
            else:
                self._fh.write(data)
                self._start_writeback()
        except OSError as e:
            raise _explained(e, self.path, what, self._expected_size()) from None

    def buffer(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` for the next piece of the tensor being written (asked
        for by the producer of ``write``'s pieces, one piece at a time). A piece made in it and handed
        to ``write`` reaches the disk without a copy: it already lies in aligned memory at the offset
        its file position has within a disk block, so the direct writer sends it as it is (a repacked
        MXFP4 expert would otherwise be copied once more, ~7 s of a core per 17 GB shard). A buffer
        asked for at another moment (ahead of its piece, before ``write`` began) is written right, by
        the copying path. The buffers rotate like a producer's own: one stays valid until
        PIECES_IN_FLIGHT more pieces are handed over."""
        lead = self._pos % DirectTail.BLOCK if self._direct is not None else 0
        slot = self._turn % len(self._ring)
        self._turn += 1
        need = lead + nbytes + -(lead + nbytes) % DirectTail.BLOCK
        block = self._ring[slot]
        if block is None or block.size < need:
            block = self._ring[slot] = aligned(need)
        piece = block[lead : lead + nbytes]
        self._lent = (piece, block, lead)
        return piece

    def write(self, name: str, pieces: Iterable[bytes | bytearray | memoryview | np.ndarray]) -> str:
        """Stream tensor ``name`` (the next declared one) from byte pieces; returns its SHA-256."""
        ti = self.infos[self._next]
        if ti.name != name:
            raise ValueError(f"{self.path.name}: expected tensor {ti.name}, got {name}")
        pad = -self._pos % ALIGNMENT
        if pad:
            self._submit_write(b"\0" * pad, f"tensor {name}")
        h, n, marks = hashing.sha256(), 0, []
        for piece in pieces:
            mv = hashing.as_bytes(piece)
            hashing.update(h, mv)  # on the other core, while this one makes the next piece
            lent, self._lent = self._lent, None
            # placed only where it was lent for this very offset (a producer that asked ahead of
            # its pieces gets the ordinary, copying path: right bytes, one copy more)
            if (
                lent is not None
                and piece is lent[0]
                and self._direct is not None
                and lent[2] == self._pos % DirectTail.BLOCK
            ):
                self._submit_placed(lent[1], lent[2], mv.nbytes, f"tensor {name}")
            else:
                self._submit_write(mv, f"tensor {name}")
            n += mv.nbytes
            # PIECES_IN_FLIGHT pieces may still be hashing or writing while the producer makes the
            # next one, so a producer reusing buffers must rotate PIECES_IN_FLIGHT + 1 of them.
            marks.append(hashing.mark())
            if len(marks) > PIECES_IN_FLIGHT:
                hashing.wait(upto=marks.pop(0))
        hashing.wait()
        if n != ti.nbytes:
            raise ValueError(f"{self.path.name}: tensor {name}: wrote {n} bytes, declared {ti.nbytes}")
        self._next += 1
        self.hashes[name] = h.hexdigest()
        return self.hashes[name]

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing out what we have written so far, on a helper thread
        (the request itself can take milliseconds), so that the closing fsync waits for the last
        stretch only, not the whole file."""
        pos = self._fh.tell()
        if pos - self._flushed < WRITEBACK_STEP or not hasattr(os, "posix_fadvise"):
            return
        self._fh.flush()
        if self._writeback is None:
            self._writeback = ThreadPoolExecutor(1, thread_name_prefix="k3lab-writeback")
        # DONTNEED starts writeback of the dirty range and drops the pages already clean (a
        # conversion of 1.4 TiB has no use for its output in the page cache). The range starts
        # one step back: those pages were still being written at the last request.
        start = self._dropped
        self._writeback_requests.append(
            self._writeback.submit(
                os.posix_fadvise, self._fh.fileno(), start, pos - start, os.POSIX_FADV_DONTNEED
            )
        )
        self._dropped, self._flushed = self._flushed, pos

    def _stop_writeback(self) -> None:
        if self._writeback is not None:
            self._writeback.shutdown(wait=True)  # before the file descriptor is closed
            self._writeback = None
        requests, self._writeback_requests = self._writeback_requests, []
        for r in requests:
            r.result()  # a request that failed is a bug here: say so

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Success: pad, fsync, close, rename into place. Any failure, here or in the block: close and
        delete the .partial (a failing close, e.g. ENOSPC again, must not skip the delete)."""
        fh = self._fh
        error: BaseException | None = None
        try:  # every queued write must be done (or failed) before the file is closed
            hashing.wait()
        except BaseException as e:
            error = e
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        try:
            self._stop_writeback()
            if error is not None:
                raise error
            if exc_type is None:
                if self._next != len(self.infos):
                    raise ValueError(
                        f"{self.path.name}: {len(self.infos) - self._next} declared tensors not written"
                    )
                pad = -self._pos % ALIGNMENT
                if pad and self.infos:
                    self._write_now(b"\0" * pad, "the end of the file")
                    if self._whole is not None:
                        self._whole.update(b"\0" * pad)
                if self._whole is not None:
                    self.file_sha256 = self._whole.hexdigest()
                if self._direct is not None:
                    self._direct.finish()
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException as e:
            error = e
        finally:
            if self._direct is not None:
                self._direct.close()
            try:
                fh.close()
            except OSError as e:
                error = error or e
            self._writer.fout = None
        if exc_type is None and error is None:
            try:
                if self.before_commit is not None:
                    self.before_commit()
            except BaseException:
                self.partial.unlink(missing_ok=True)
                raise
            os.replace(self.partial, self.path)
            fsync_dir(self.path.parent)
            return
        self.partial.unlink(missing_ok=True)
        if error is not None:
            raise _explained(error, self.path, "the end of the file", self._expected_size()) from None


def _explained(e: BaseException, path: Path, what: str, size: int) -> BaseException:
    """A full disk as one line naming the file, what was being written and the space it needs."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = 0
        return MachineError(
            f"{path}: no space left on the device while writing {what} (the file needs {size:,} bytes; "
            f"{free:,} free); nothing was kept of it"
        )
    return e


def write_metadata_only(path: str | os.PathLike, arch: str, kvs: Sequence[KV]) -> Path:
    """A GGUF with KV metadata and no tensors (the standalone tokenizer file)."""
    with GGUFStream(path, arch, kvs, []) as g:
        written = g.path  # the header and the metadata are the whole file
    return written
