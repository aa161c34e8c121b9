"""Convert one output file: the unit of work every runner (one process, ``--jobs``, Dask) executes.

For output file k of a plan: acquire its source shard, check the shard's header is the one the
plan was made from, write the GGUF header and tensor infos, then for each planned tensor let its
transform's stream read the source in bounded pieces (``Reader``: mapped pages, no copy) and
stream the output bytes to ``NAME.partial``, hashed and written on background threads; fsync,
rename, record the hashes (``record``, written by ``folder``), release the shard. Memory is bounded
by what the streams hold at once, which the plan forecasts per file.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.formats.gguf_stream import KV, GGUFStream, split_kvs
from k3lab.formats.safetensors import NUMPY_DTYPE, TensorEntry
from k3lab.pipeline.planning.plan import Plan, PlanError, PlannedTensor
from k3lab.pipeline.progress import NO_REPORT, TaskReport
from k3lab.pipeline.sources.base import Source
from k3lab.pipeline.writing.folder import OutputFolder, header_sha256
from k3lab.pipeline.writing.proof import identity
from k3lab.pipeline.writing.record import Record, SourceRef, TensorRecord

READ_FIRST = 256 << 20  # bytes read ahead at a task's start: more than the disk reads while numba loads


class Reader:
    """Source tensors by name, in bounded pieces: each a read-only view of the shard's mapped pages
    (no copy; the mapping goes when the piece's last user drops it: the stream, or the writer once it
    has hashed and written it), reported to ``report`` (which stops the task once its run stopped)."""

    def __init__(self, source: Source, entries: dict[str, TensorEntry], report: TaskReport = NO_REPORT):
        self.source, self.entries, self.report = source, entries, report

    def _range(self, name: str, row_start: int, row_stop: int | None) -> tuple[TensorEntry, int, int, int]:
        e = self.entries[name]
        rows = e.shape[0] if e.shape else 1
        stop = rows if row_stop is None else row_stop
        row_bytes = e.nbytes // rows if rows else 0
        return e, stop, row_start * row_bytes, (stop - row_start) * row_bytes

    def start(self, names: Iterable[str], nbytes: int = READ_FIRST) -> None:
        """Start reading the first ``nbytes`` of these tensors from disk now: the disk reads them
        while the task writes the header and loads the compiled code its streams use (numba's
        kernel, ~0.4 s, on the first MXFP4 tensor), rather than after."""
        for name in names:
            if nbytes <= 0:
                break
            e = self.entries[name]
            self.source.will_need(e, 0, min(e.nbytes, nbytes))
            nbytes -= e.nbytes

    def ahead(self, name: str, row_start: int = 0, row_stop: int | None = None) -> None:
        """Start reading those rows from disk now (the stream reads them next)."""
        e, _, offset, n = self._range(name, row_start, row_stop)
        self.source.will_need(e, offset, n)

    def __call__(self, name: str, row_start: int = 0, row_stop: int | None = None) -> np.ndarray:
        e, stop, offset, n = self._range(name, row_start, row_stop)
        buf = self.source.map(e, offset, n)
        self.report.read(n)
        shape = (stop - row_start, *e.shape[1:]) if e.shape else ()
        return buf.view(NUMPY_DTYPE[e.dtype]).reshape(shape)


def tensor_pieces(
    pt: PlannedTensor, reader: Reader, buffer: Callable[[int], np.ndarray] | None = None
) -> Iterator[np.ndarray]:
    """The output bytes of one planned tensor, in the bounded pieces its transform's stream makes
    (those it makes anew, in ``buffer``'s memory when given: the writer's, so no copy follows)."""
    return pt.job([reader.entries[n] for n in pt.sources], reader, buffer).pieces()


def write_tensors(
    path: Path,
    arch: str,
    kvs: list[KV],
    tensors: list[PlannedTensor],
    reader: Reader,
    source_files: dict[str, str],
    before_commit: Callable[[], None] | None = None,
    file_sha256: bool = False,
) -> tuple[list[TensorRecord], int, str | None]:
    """Stream planned tensors into one GGUF file; returns their manifest entries and the data start.
    ``source_files`` names the file each source tensor came from (for the record); ``before_commit``
    may still refuse the finished file (its run stopped): it is then removed, never renamed. With
    ``file_sha256``, the whole file's SHA-256 too (made as the bytes go out: an upload needs it)."""
    records = []
    with GGUFStream(path, arch, kvs, [t.info for t in tensors], before_commit, file_sha256) as g:
        for pt in tensors:
            offset = g.data_offset_next()
            sha = g.write(pt.name, tensor_pieces(pt, reader, g.buffer))
            records.append(
                TensorRecord(
                    pt.name,
                    pt.info.type.name,
                    tuple(pt.info.ne),
                    pt.nbytes,
                    offset,
                    sha,
                    pt.transform,
                    tuple(SourceRef(n, source_files[n]) for n in pt.sources),
                )
            )
    return records, g.data_start, g.file_sha256


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class FileResult:
    number: int
    filename: str
    skipped: bool
    seconds: float
    nbytes: int
    worker: str = field(default_factory=worker_name)  # host:pid of the process that did it
    record: Record | None = None  # published: the file's record (the client keeps it)
    upload: Any = None  # published: the uploaded file's operation, for the client's commit
    pending: Any = None  # published in the background: a future that is done when it is uploaded


def file_kvs(plan: Plan, number: int, folder: OutputFolder) -> list[KV]:
    """Split keys in every file; the first also carries the planned metadata and the tokenizer."""
    kvs = split_kvs(number - 1, len(plan.files), plan.n_tensors)
    return folder.load_kvs(plan) + kvs if number == 1 else kvs


def shard_entries(plan: Plan, number: int, source: Source) -> dict[str, TensorEntry]:
    """The acquired shard's header, which must be the one the plan was made from."""
    pf = plan.file(number)
    entries, sha = source.shard_header(pf.source_file)
    if sha != pf.shard["header_sha256"]:
        raise PlanError(
            f"{source.where(pf.source_file)}: header differs from the one the plan was made from "
            "(the source changed since planning: run the command again to re-plan)"
        )
    return entries


def convert_file(
    plan: Plan,
    number: int,
    source: Source,
    out_dir: str | Path,
    force: bool = False,
    report: TaskReport = NO_REPORT,
    *,
    before_commit: Callable[[], None] | None = None,
    file_sha256: bool = False,
    acquired: Callable[[], None] | None = None,
) -> FileResult:
    """Write output file ``number`` (1-based) unless a complete, matching one is already there.
    The runner's hooks: ``acquired`` runs once the source shard is here (a runner starts the next
    shard's download then); ``before_commit`` before the finished file is renamed into place and its
    record written (a task checks there that its run still holds the folder); ``file_sha256``: hash
    the whole file as it is written (an upload takes that hash instead of reading the file again)."""
    folder = OutputFolder(out_dir)
    pf = plan.file(number)
    t0 = time.perf_counter()
    if not force and folder.is_complete(number, pf.filename, pf.digest):
        report.read(pf.source_bytes)
        return FileResult(number, pf.filename, True, 0.0, pf.nbytes)
    kvs = file_kvs(plan, number, folder)
    path = folder.output(pf.filename)
    source.acquire(pf.source_file, report)
    try:
        if acquired is not None:
            acquired()
        entries = shard_entries(plan, number, source)
        reader = Reader(source, entries, report)
        reader.start(n for t in pf.tensors for n in t.sources)
        records, data_start, whole = write_tensors(
            path,
            plan.model.name,
            kvs,
            pf.tensors,
            reader,
            dict.fromkeys(entries, pf.source_file),
            before_commit,
            file_sha256,
        )
    finally:
        source.release(pf.source_file)
    if before_commit is not None:
        before_commit()  # the file is there, but no record says it is complete: a rerun redoes it
    folder.write_record(
        Record(
            kind="text",
            file=pf.filename,
            number=number,
            size=path.stat().st_size,
            data_start=data_start,
            header_sha256=header_sha256(path, data_start),
            tensors=records,
            split_count=len(plan.files),
            split_tensors=plan.n_tensors,
            plan_digest=pf.digest,
            basename=plan.basename,
            outtype=plan.outtype,
            source={"file": pf.source_file, **pf.shard},
            identity=identity(path) or {},
            sha256=whole or "",
        )
    )
    return FileResult(number, pf.filename, False, time.perf_counter() - t0, pf.nbytes)
