"""One file of a variant, made from the finished lossless file it comes from: the unit of work of the
variant stage (``k3lab quantize``, or ``convert --variants`` right after file k is converted, on the
same worker, while its bytes are on that worker's disk).

For each tensor, in the variant's order: its bytes are read from the lossless file where that file's
record puts them, a slab of rows at a time (within one expert: each expert has its own imatrix
row), hashed and checked against the record's SHA-256 (a lossless file changed since it was proven is
one line, never quantised); a tensor whose type stays is copied; any other is widened to float32 by
ggml (``to_float``: what llama-quantize does) and quantised by ggml's kernel on every core, rows
split between threads (rows are independent: the bytes do not depend on the split), straight into the
writer's buffer. Memory: three float32 slabs of ``SLAB_VALUES`` (two queued, one being widened) and the pieces the
writer still holds.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3lab.errors import K3LabError, MachineError
from k3lab.formats.files import open_regular
from k3lab.formats.ggml import GGML, TYPE_IDS, ggml
from k3lab.formats.gguf_stream import PIECES_IN_FLIGHT, GGUFStream
from k3lab.formats.imatrix import vector
from k3lab.pipeline.progress import NO_REPORT, TaskReport
from k3lab.pipeline.quantizing.variant import VariantFile, VariantPlan, VariantTensor
from k3lab.pipeline.sources.spec import SourceFile
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.proof import header_sha256, identity
from k3lab.pipeline.state.record import Record, SourceRef, TensorRecord
from k3lab.pipeline.state.records import content_digest
from k3lab.pipeline.writing.convert import FileResult

SLAB_VALUES = 4 << 20  # float32 values widened at once (16 MiB); two in flight
COPY_PIECE = 16 << 20  # bytes of a tensor copied at once
ROWS_PER_JOB = 16  # rows one thread quantises per call, at least (a K-quant row of 7168: ~1 ms)
QUEUED = 2  # slabs queued for the threads at once (the next one is read and widened meanwhile)


class SourceChanged(K3LabError):
    """The lossless file is not the one its record describes any more."""


@dataclass(frozen=True)
class Threads:
    """The threads quantising rows: one pool per process, sized to its cores (or ``--threads``)."""

    n: int

    @functools.cached_property
    def pool(self) -> cf.ThreadPoolExecutor:
        return cf.ThreadPoolExecutor(self.n, thread_name_prefix="k3lab-quantize")


@functools.cache
def threads(n: int | None = None) -> Threads:
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Threads(max(1, n))


class LosslessFile:
    """The finished lossless file a variant file is made from, read by offset (pread), its record
    saying where each tensor lies and what its bytes hash to."""

    def __init__(self, folder: OutputFolder, number: int, filename: str, digest: str):
        rec = folder.records.text(number)
        if (
            rec is None
            or rec.file != filename
            or rec.plan_digest != digest
            or not folder.records.is_complete(number, filename, digest)
        ):
            raise K3LabError(
                f"{folder.output(filename)}: not a finished file of the set (convert it first: a variant "
                "is made from the lossless file)"
            )
        self.path, self.record = folder.output(filename), rec
        self.tensors = {t.name: t for t in rec.tensors}
        self.fd, size = open_regular(self.path, "GGUF file")
        if size != rec.size:
            os.close(self.fd)
            raise SourceChanged(f"{self.path}: {size} bytes, its record says {rec.size}")

    def read(self, offset: int, n: int, into: np.ndarray | None = None) -> np.ndarray:
        buf = into if into is not None else np.empty(n, dtype=np.uint8)
        got = os.preadv(self.fd, [memoryview(buf)[:n]], offset)
        if got != n:
            raise SourceChanged(
                f"{self.path}: ends at {offset + got}, inside a tensor (cut short since it was written?)"
            )
        return buf[:n]

    def close(self) -> None:
        os.close(self.fd)

    def source_file(self) -> SourceFile:
        rec = self.record
        return SourceFile(
            rec.file, rec.size, rec.header_sha256, sum(t.nbytes for t in rec.tensors), rec.sha256 or None
        )


def _check_hash(h: hashlib._Hash, want: str, path: Path, name: str) -> None:
    if h.hexdigest() != want:
        raise SourceChanged(
            f"{path}: tensor {name}: its bytes are not the ones its record hashed (changed since?)"
        )


def copy_pieces(src: LosslessFile, vt: VariantTensor, report: TaskReport) -> Iterator[np.ndarray]:
    """A tensor whose type stays: its bytes as they are, checked against its record."""
    t = src.tensors[vt.name]
    h = hashlib.sha256()
    for at in range(0, t.nbytes, COPY_PIECE):
        report.check()
        piece = src.read(t.offset + at, min(COPY_PIECE, t.nbytes - at))
        h.update(piece)
        report.read(piece.nbytes)
        yield piece
    _check_hash(h, t.sha256, src.path, vt.name)


def quantized_pieces(
    lib: GGML,
    src: LosslessFile,
    vt: VariantTensor,
    imatrix: np.ndarray | None,
    pool: Threads,
    report: TaskReport,
) -> Iterator[np.ndarray]:
    """A tensor quantised: slabs of rows widened by ggml, quantised by ggml on ``pool``'s threads. Two
    slabs are queued at once, so that a thread that ends its part of one finds the next one's waiting
    (no thread idles at a slab's end), and the slab after them is read and widened meanwhile. Each
    piece yielded stays untouched until ``PIECES_IN_FLIGHT`` more are (the writer's contract)."""
    t = src.tensors[vt.name]
    src_id, dst_id = TYPE_IDS[vt.source_type], TYPE_IDS[vt.type]
    n = vt.ne[0]
    rows = int(np.prod(vt.ne[1:2] or (1,)))
    experts = int(np.prod(vt.ne[2:] or (1,)))
    src_row, dst_row = lib.traits(src_id).row_bytes(n), lib.traits(dst_id).row_bytes(n)
    if src_row * rows * experts != t.nbytes:
        raise SourceChanged(
            f"{src.path}: tensor {vt.name}: {t.nbytes} bytes, not {rows * experts} rows of {vt.source_type}"
        )
    step = max(1, min(rows, SLAB_VALUES // n))
    slabs = [(e, r, min(step, rows - r)) for e in range(experts) for r in range(0, rows, step)]
    ahead = min(QUEUED, len(slabs))
    wide = [np.empty((step, n), dtype=np.float32) for _ in range(ahead + 1)]
    # slab k + ahead is quantised into a buffer while pieces up to k - 1 have been handed over, and the
    # writer may still hold the last PIECES_IN_FLIGHT of them: the ring must not reach those
    ring = min(len(slabs), ahead + PIECES_IN_FLIGHT + 1)
    outs = [np.empty(step * dst_row, dtype=np.uint8) for _ in range(ring)]
    raw = np.empty(step * src_row, dtype=np.uint8)
    h = hashlib.sha256()

    def submit(k: int) -> tuple[list[cf.Future], np.ndarray]:
        """Slab ``k`` read, hashed, widened, checked, and its rows handed to the threads."""
        e, r, m = slabs[k]
        piece = src.read(t.offset + (e * rows + r) * src_row, m * src_row, raw)
        h.update(piece)
        x = wide[k % len(wide)][:m]
        lib.to_float(src_id, piece, x)
        report.read(piece.nbytes)
        big = large[k % len(large)] = _largest(x, src.path, vt, e, r, experts) > LARGE
        out = outs[k % len(outs)][: m * dst_row]
        im = imatrix[e * n : (e + 1) * n] if imatrix is not None else None
        spans = _spans(m, pool.n)
        return [
            # (a slab that large is checked here first: ggml's own check would print its line)
            pool.pool.submit(lib.quantize, dst_id, x[a:b], out[a * dst_row : b * dst_row], im, not big)
            for a, b in spans
        ], out

    large = [False] * (ahead + 1)  # whether each queued slab holds values past LARGE
    queued = [submit(k) for k in range(ahead)]
    try:
        for k in range(len(slabs)):
            report.check()
            jobs, out = queued.pop(0)
            for j in jobs:
                try:
                    j.result()
                except K3LabError as err:  # (ggml's check of the rows: said with the file and tensor)
                    raise K3LabError(f"{src.path}: tensor {vt.name}: {err}") from None
            if large[k % len(large)]:
                _check_scales(lib, dst_id, out, slabs[k][2], n, src.path, vt)
            if k + ahead < len(slabs):
                queued.append(submit(k + ahead))  # (the threads are on slab k + 1 meanwhile)
            yield out
    finally:  # (stopped part way: the queued slabs finish before their buffers go)
        for jobs, _ in queued:
            for j in jobs:
                j.cancel() or j.exception()
    _check_hash(h, t.sha256, src.path, vt.name)


LARGE = 1e3  # a magnitude past which a type's scales may overflow (a model's weights are far below it)


def _largest(x: np.ndarray, path: Path, vt: VariantTensor, expert: int, row: int, experts: int) -> float:
    """The largest magnitude in a widened slab; a value that is not finite is one line naming the file,
    the tensor and where (ggml's check refuses it, and llama-quantize with it, in a line of ggml's)."""
    lo, hi = float(x.min()), float(x.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        where = f"expert {expert}, " if experts > 1 else ""
        bad = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0]) + row
        raise K3LabError(
            f"{path}: tensor {vt.name}: {where}row {bad} holds a value that is not finite: it cannot be "
            f"quantised to {vt.type} (llama-quantize refuses it too)"
        )
    return max(-lo, hi)


def _check_scales(
    lib: GGML, dst_id: int, out: np.ndarray, m: int, n: int, path: Path, vt: VariantTensor
) -> None:
    """A slab of values that large, quantised: its rows widened back; a scale that overflowed (an
    infinity ggml's check would refuse, in a line of its own) is one line naming the file and tensor;
    then ggml's check, as for every slab."""
    back = np.empty((m, n), dtype=np.float32)
    lib.to_float(dst_id, out, back)
    if not np.isfinite(back).all() or not lib.validate(dst_id, out):
        raise K3LabError(
            f"{path}: tensor {vt.name}: its values overflow {vt.type}'s scales: it cannot be quantised to "
            f"{vt.type} (llama-quantize refuses it too)"
        )


def _spans(m: int, n_threads: int) -> list[tuple[int, int]]:
    """Rows [0, m) cut for ``n_threads`` threads: a few spans each (so they end together), each at
    least ``ROWS_PER_JOB`` rows."""
    pieces = max(1, min(m // ROWS_PER_JOB, 4 * n_threads))
    bounds = [m * i // pieces for i in range(pieces + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def quantize_file(
    plan: VariantPlan,
    number: int,
    set_dir: str | Path,
    force: bool = False,
    report: TaskReport = NO_REPORT,
    *,
    before_commit: Callable[[], None] | None = None,
    file_sha256: bool = False,
    n_threads: int | None = None,
    hub_token: str | None = None,
) -> FileResult:
    """Write file ``number`` of the variant (into ``set_dir/LABEL/``) from the set's finished file
    of the same number, unless a complete, matching one is there already."""
    vf: VariantFile = plan.file(number)
    folder = OutputFolder(set_dir).variant(plan.label)
    folder.create()  # (a real directory inside the set: one line for a link, before anything is read)
    t0 = time.perf_counter()
    if not force and OutputFolder(set_dir).variant_file_complete(plan.label, number, vf.filename, vf.digest):
        report.read(vf.source_bytes)
        return FileResult(number, vf.filename, True, 0.0, vf.nbytes)
    lib = ggml()
    if lib.version != plan.ggml:
        raise MachineError(
            f"the variant {plan.label} was planned with ggml {plan.ggml}, this machine has {lib.version}: "
            "its bytes would differ (run the same llama-cpp-python everywhere)"
        )
    src = LosslessFile(OutputFolder(set_dir), vf.source_number, vf.source, vf.source_digest)
    pool = threads(n_threads)
    path = folder.output(vf.filename)
    records = []
    try:
        with GGUFStream(path, None, plan.file_kvs(number), [_info(vt) for vt in vf.tensors], before_commit,
                        file_sha256) as g:  # fmt: skip
            for vt in vf.tensors:
                offset = g.data_offset_next()
                if vt.quantized:
                    im = imatrix_rows(plan, vt, hub_token)
                    pieces = quantized_pieces(lib, src, vt, im, pool, report)
                else:
                    pieces = copy_pieces(src, vt, report)
                sha = g.write(vt.name, pieces)
                records.append(
                    TensorRecord(vt.name, vt.type, vt.ne, vt.nbytes, offset, sha,
                                 "quantize" if vt.quantized else "copy", (SourceRef(vt.name, vf.source),), vt.why)
                )  # fmt: skip
    finally:
        src.close()
    if before_commit is not None:
        before_commit()
    folder.records.write(
        Record(
            kind="text",
            file=vf.filename,
            number=number,
            size=path.stat().st_size,
            data_start=g.data_start,
            header_sha256=header_sha256(path, g.data_start),
            tensors=records,
            split_count=len(plan.files),
            split_tensors=plan.n_tensors,
            plan_digest=vf.digest,
            basename=plan.basename,
            outtype=plan.label,
            sources=[src.source_file()],
            identity=identity(path) or {},
            sha256=g.file_sha256 or "",
            read={vf.source: {"identity": None, "sha256": content_digest(src.record)}},
        )
    )
    return FileResult(number, vf.filename, False, time.perf_counter() - t0, vf.nbytes)


@dataclass(frozen=True)
class _Info:
    name: str
    type: int
    shape: tuple[int, ...]
    nbytes: int


def _info(vt: VariantTensor) -> _Info:
    return _Info(vt.name, TYPE_IDS[vt.type], vt.shape, vt.nbytes)


def imatrix_rows(plan: VariantPlan, vt: VariantTensor, token: str | None = None) -> np.ndarray | None:
    """This tensor's imatrix rows, read from the imatrix file by range (None: it has none)."""
    if plan.imatrix is None:
        return None
    entry = plan.imatrix.index.entries.get(vt.name)
    if entry is None:
        return None
    experts = int(np.prod(vt.ne[2:] or (1,)))
    if entry.n * entry.m != vt.ne[0] * experts:  # (token_embd: llama-quantize goes without)
        return None
    from k3lab.pipeline.quantizing.imatrix_files import reader

    return vector(entry, reader(plan.imatrix, token), plan.imatrix.location)
