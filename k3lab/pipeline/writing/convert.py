"""Convert one output file: the unit of work every runner (one process, ``--jobs``, Dask) executes.

For output file k of a plan: write the GGUF header and tensor infos, then for each planned tensor
acquire the source files it reads that are not here yet (``PlannedInputs``: each file's header
checked against the plan's; the next file prefetched), let its transform's stream read the sources
in bounded pieces (``Reader``: read with O_DIRECT, or from the page cache) and stream the output bytes to
``NAME.partial``, hashed and written on background threads, and release the files no later tensor
reads; fsync, rename, record the hashes (``state.record``, written by ``state.records``). Memory is bounded by
what the streams hold at once, which the plan forecasts per file; disk by the files one tensor reads.
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

from k3lab.formats.direct_io import READ_AHEAD
from k3lab.formats.gguf_stream import KV, GGUFStream, split_kvs
from k3lab.formats.safetensors import NUMPY_DTYPE, TensorEntry
from k3lab.pipeline.planning.plan import Plan, PlanError, PlannedFile, PlannedTensor
from k3lab.pipeline.progress import NO_REPORT, TaskReport
from k3lab.pipeline.sources.base import Source
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.proof import header_sha256, identity
from k3lab.pipeline.state.record import Record, SourceRef, TensorRecord
from k3lab.pipeline.streams import load_streams
from k3lab.pipeline.writing.sources_read import SourceHashes, hashed_again

# bytes hinted at a task's start, read while the header is written and numba loads: what a source
# reads ahead at most (a larger hint would be refused whole)
READ_FIRST = READ_AHEAD


class Reader:
    """Source tensors by name, in bounded pieces: each read-only, in a buffer of its own (see
    ``Source.read_piece``; it goes back when the piece's last user drops it: the stream, or the
    writer once it has hashed and written it), reported to ``report`` (which stops the task once its run
    stopped). ``files``: the source file holding each tensor, as a record names it (default: the
    entry's); ``hashes``: where the pieces read are hashed (a conversion's proof of what it read)."""

    def __init__(
        self,
        source: Source,
        entries: dict[str, TensorEntry],
        report: TaskReport = NO_REPORT,
        files: dict[str, str] | None = None,
        hashes: SourceHashes | None = None,
    ):
        self.source, self.entries, self.report = source, entries, report
        self.files = files if files is not None else {n: e.file for n, e in entries.items()}
        self.hashes = hashes

    def open_for(self, position: int, pt: PlannedTensor) -> None:
        """Before tensor ``position`` of a file is written: its sources are readable (here: they are)."""

    def done_with(self, position: int, pt: PlannedTensor) -> None:
        """After it is written (here: nothing to let go of)."""

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
        buf = self.source.read_piece(e, offset, n)
        if self.hashes is not None:
            self.hashes.seen(self.files[name], name, e.nbytes, offset, buf)
        self.report.read(n)
        shape = (stop - row_start, *e.shape[1:]) if e.shape else ()
        return buf.view(NUMPY_DTYPE[e.dtype]).reshape(shape)


class PlannedInputs(Reader):
    """The source files one planned output file reads, acquired as its tensors need them: before a
    tensor, the files it reads that are not here (each file's header checked against the plan's, so
    a file changed since planning is one line, never converted); after it, released the files no
    later tensor reads. While one file converts the next this output reads downloads
    (``prefetch``), and at the end the first of ``then``'s (the next task's files: kept on
    ``release`` for it). ``acquired`` runs once the first tensor's files are here."""

    def __init__(
        self,
        source: Source,
        pf: PlannedFile,
        report: TaskReport = NO_REPORT,
        acquired: Callable[[], None] | None = None,
        then: tuple[str, ...] = (),
    ):
        super().__init__(source, {}, report, {}, SourceHashes())
        self.pf, self.acquired, self.then = pf, acquired, then
        self.last = pf.last_use()
        self.held: list[int] = []

    def first(self) -> None:
        """The first tensor's files, before the output file is opened: a runner's ``acquired`` hook
        takes its slots for converting then, so no output is begun while a task waits for them."""
        if self.pf.tensors:
            for i in self.pf.tensors[0].files:
                if i not in self.held:
                    self._acquire(i)
        if self.acquired is not None:
            hook, self.acquired = self.acquired, None
            hook()
        # numba's kernel loads (its files asked for at the run's start) and the disk starts on what
        # follows while the header is written
        load_streams(t.transform_fn for t in self.pf.tensors)
        self.start(n for t in self.pf.tensors for n in t.sources if n in self.entries)

    def open_for(self, position: int, pt: PlannedTensor) -> None:
        for i in pt.files:
            if i not in self.held:
                self._acquire(i)
        later = [i for t in self.pf.tensors[position:] for i in t.files if i not in self.held]
        upcoming = [self.pf.sources[later[0]].file] if later else [f for f in self.then[:1]]
        for file in upcoming:
            self.source.prefetch(file, self.report)

    def _acquire(self, i: int) -> None:
        planned = self.pf.sources[i]
        self.source.acquire(planned.file, self.report)
        self.held.append(i)
        assert self.hashes is not None
        self.hashes.began(planned.file, self.source.content_identity(planned.file))
        entries, sha = self.source.file_header(planned.file)
        if sha != planned.header_sha256:
            # the plan read this header by other means (ranges, perhaps cached): this copy is the
            # checked one, so what was read before is forgotten and a rerun plans from the file's own
            self.source.distrust(planned.file)
            raise PlanError(
                f"{self.source.where(planned.file)}: header differs from the one the plan was made from "
                "(the source changed since planning, or its header was read wrong: run the command "
                "again to re-plan)"
            )
        self.entries.update(entries)
        self.files.update(dict.fromkeys(entries, planned.file))

    def done_with(self, position: int, pt: PlannedTensor) -> None:
        for i in pt.files:
            if self.last.get(i) == position and i in self.held:
                self._release(i)

    def _release(self, i: int) -> None:
        self.held.remove(i)
        file = self.pf.sources[i].file
        self.source.release(file, keep=file in self.then)

    def close(self) -> None:
        """Let go of whatever is still held (a task that failed or stopped part way)."""
        for i in list(self.held):
            self._release(i)


def tensor_reader(
    source: Source, pf: PlannedFile, pt: PlannedTensor, report: TaskReport = NO_REPORT
) -> Reader:
    """A reader of one planned tensor's sources where they are, acquiring nothing (a Hub source
    reads them by ranges): a view, or a check of one tensor."""
    entries: dict[str, TensorEntry] = {}
    files: dict[str, str] = {}
    for i in pt.files:
        file = pf.sources[i].file
        found, _ = source.file_header(file)
        entries.update(found)
        files.update(dict.fromkeys(found, file))
    return Reader(source, entries, report, files)


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
    before_commit: Callable[[], None] | None = None,
    file_sha256: bool = False,
) -> tuple[list[TensorRecord], int, str | None]:
    """Stream planned tensors into one GGUF file; returns their manifest entries and the data start.
    ``reader`` says which file each source tensor came from (for the record); ``before_commit`` may
    still refuse the finished file (its run stopped): it is then removed, never renamed. With
    ``file_sha256``, the whole file's SHA-256 too (made as the bytes go out: an upload needs it)."""
    records = []
    with GGUFStream(path, arch, kvs, [t.info for t in tensors], before_commit, file_sha256) as g:
        for position, pt in enumerate(tensors):
            reader.open_for(position, pt)
            offset = g.data_offset_next()
            sha = g.write(pt.name, tensor_pieces(pt, reader, g.buffer))
            reader.done_with(position, pt)
            records.append(
                TensorRecord(
                    pt.name,
                    pt.info.type.name,
                    tuple(pt.info.ne),
                    pt.nbytes,
                    offset,
                    sha,
                    pt.transform,
                    tuple(SourceRef(n, reader.files[n]) for n in pt.sources),
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
    variants: list[FileResult] = field(default_factory=list)  # the variants made of it, on the same worker
    label: str = ""  # a variant's: its name (its folder in the set)


def file_kvs(plan: Plan, number: int, folder: OutputFolder) -> list[KV]:
    """Split keys in every file of a split set (a set of one file has none); the first also
    carries the planned metadata and the tokenizer."""
    kvs = split_kvs(number - 1, len(plan.files), plan.n_tensors) if plan.split_keys else []
    return folder.plans.kvs(plan) + kvs if number == 1 else kvs


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
    then: tuple[str, ...] = (),
) -> FileResult:
    """Write output file ``number`` (1-based) unless a complete, matching one is already there.
    The runner's hooks: ``acquired`` runs once the first source files are here (a runner lets its
    next task start then); ``before_commit`` before the finished file is renamed into place and its
    record written (a task checks there that its run still holds the folder); ``file_sha256``: hash
    the whole file as it is written (an upload takes that hash instead of reading the file again);
    ``then``: the source files of the task after this one (prefetched, and kept when released)."""
    folder = OutputFolder(out_dir)
    pf = plan.file(number)
    t0 = time.perf_counter()
    if not force and is_converted(folder, number, pf, source):
        report.read(pf.source_bytes)
        return FileResult(number, pf.filename, True, 0.0, pf.nbytes)
    kvs = file_kvs(plan, number, folder)
    path = folder.output(pf.filename)
    inputs = PlannedInputs(source, pf, report, acquired, then)
    try:
        inputs.first()
        records, data_start, whole = write_tensors(
            path, plan.model.name, kvs, pf.tensors, inputs, before_commit, file_sha256
        )
    finally:
        inputs.close()
    assert inputs.hashes is not None
    read = inputs.hashes.read(source.content_identity)
    if before_commit is not None:
        before_commit()  # the file is there, but no record says it is complete: a rerun redoes it
    folder.records.write(
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
            sources=list(pf.sources),
            identity=identity(path) or {},
            sha256=whole or "",
            read=read,
        )
    )
    return FileResult(number, pf.filename, False, time.perf_counter() - t0, pf.nbytes)


def is_converted(folder: OutputFolder, number: int, pf: PlannedFile, source: Source | None) -> bool:
    """The resume test of a conversion: output file ``number`` is the one its record describes, made
    by this plan, from source files that are still as they were (``source``: None when they cannot
    have changed)."""
    return folder.records.is_complete(number, pf.filename, pf.digest) and (
        source is None or sources_unchanged(folder, number, source)
    )


def sources_unchanged(folder: OutputFolder, number: int, source: Source) -> bool:
    """Whether every source file finished output file ``number`` read is as it was then: its identity
    as recorded, or else its bytes hashed again to the recorded digest (the record then takes the new
    identity: a copied or touched checkpoint is read once). A local source file of which the record
    proves nothing (a record of an earlier k3lab, a file that changed while it was read) is not
    taken as unchanged. A source that keeps no identity (the Hub: its files are pinned and checked)
    has nothing to prove here."""
    rec = folder.records.text(number)
    if rec is None:
        return False
    proven = False
    for file in dict.fromkeys(s.file for s in rec.sources):
        now = source.content_identity(file)
        if now is None:
            continue
        seen = rec.read.get(file) or {"identity": None, "sha256": None}
        if seen["identity"] == now:
            continue
        if seen["identity"] is None or seen["sha256"] is None:
            return False
        names = sorted({s.name for t in rec.tensors for s in t.sources if s.file == file})
        source.acquire(file)
        try:
            entries, _ = source.file_header(file)
            if any(n not in entries for n in names):
                return False
            digest = hashed_again(
                names,
                lambda n, at, k, entries=entries: source.read_piece(entries[n], at, k),
                {n: entries[n].nbytes for n in names},
            )
        finally:
            source.release(file)
        if digest != seen["sha256"] or source.content_identity(file) != now:
            return False
        rec.read[file] = {"identity": now, "sha256": digest}
        proven = True
    if proven:
        folder.records.write(rec)
    return True
