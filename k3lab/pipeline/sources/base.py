"""The source interface: the checkpoint's files, wherever they are (a kind of source subclasses it).

The planner asks a source for the index and every source file's header; a conversion task asks it
for the files its output file reads, one after another as its tensors need them: ``acquire(file)``
(local: nothing; Hub: download into scratch, resuming), bounded ``read_piece`` calls for that file's
bytes (each hinted first by ``will_need``: read ahead on a thread), then ``release(file)`` (closed;
Hub: deleted, unless ``keep``: the next task reads it too). ``prefetch``
hints the next file (Hub: its download starts while this one converts; at most one ahead).

A checkpoint is any layout transformers or Moonshot write: an index naming the files (any names,
tensors of one layer in several files), or one ``model.safetensors`` and no index (its header is the
index). Nothing here knows which tensors belong together: the plan says which file holds what.

A ``SourceSpec`` is the picklable recipe for a source: every worker (a ``--jobs`` process, a Dask
worker on another machine) opens its own from it (``sources.open_source``), so the same task runs
anywhere.

The index must agree with the files (every file it names exists, every tensor it names is in that
file's header and every tensor in a header is in the index); headers are validated by
``formats.safetensors`` (offsets inside the file, dtype x shape = byte length).
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import operator
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.direct_io import FileReads, ReadBuffers, in_page_cache
from k3lab.formats.files import open_regular
from k3lab.formats.safetensors import (
    INDEX_NAME,
    SINGLE_NAME,
    TensorEntry,
    find_index,
    parse_header,
    read_index,
    read_raw_header,
    read_tensor,
)
from k3lab.pipeline.progress import NO_REPORT, TaskReport
from k3lab.pipeline.sources.spec import META_LIMIT, SourceFile, SourceSpec, meta_fingerprint, sha256_file

_NAME_OF, _FILE_OF = operator.itemgetter(0), operator.itemgetter(1)  # (of an index's (name, file) pair)

__all__ = [
    "META_LIMIT",
    "Source",
    "SourceError",
    "SourceFile",
    "SourceSpec",
    "meta_fingerprint",
    "sha256_file",
]


class SourceError(K3LabError):
    """The index and the files disagree, or a file is missing."""


class Source(abc.ABC):
    """What the planner and the converter use. Subclasses say where a shard's bytes are
    (``local_path``), how its header is read before it is acquired (``_fetch_raw_header``), and how the
    inputs are fingerprinted."""

    meta_dir: Path
    DIRECT_READS = False  # O_DIRECT for a file not in the page cache (a download just written is in it)

    def __init__(self) -> None:
        self._index: tuple[Path | str, dict[str, str]] | None = None
        self._by_file: dict[str, set[str]] | None = None
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._header_sha: dict[str, str] = {}
        self._open: dict[str, FileReads] = {}  # files being read, by the path their entries name
        self._holds: dict[str, int] = {}  # file -> acquires not released yet
        self._buffers = ReadBuffers()
        self._acquired: dict[str, dict[str, TensorEntry]] = {}  # shards read whole by ``array``
        self._lock = threading.Lock()

    # --- the index (parsed only by the planner: a task never needs it) ---
    @property
    def index_path(self) -> Path | str:
        """Where the map of tensors to files comes from (the index, or the one file's header)."""
        return self._load_index()[0]

    @property
    def weight_map(self) -> dict[str, str]:
        return self._load_index()[1]

    def _load_index(self) -> tuple[Path | str, dict[str, str]]:
        if self._index is None:
            path = find_index(*self._index_dirs())
            self._index = (path, read_index(path)) if path is not None else self._single_file_index()
        return self._index

    def _single_file_index(self) -> tuple[Path | str, dict[str, str]]:
        """No index: one ``model.safetensors`` holds every tensor (what transformers saves below its
        shard size), and its header is the index."""
        if not self.has_file(SINGLE_NAME):
            dirs = ", ".join(dict.fromkeys(str(d) for d in self._index_dirs()))
            raise SourceError(f"{dirs}: no {INDEX_NAME} and no {SINGLE_NAME} (not a safetensors checkpoint)")
        entries = self._parse(SINGLE_NAME)
        self._by_file = {SINGLE_NAME: set(entries)}
        self._headers[SINGLE_NAME] = entries
        return self.where(SINGLE_NAME), dict.fromkeys(entries, SINGLE_NAME)

    def _index_dirs(self) -> list[Path]:
        return [self.meta_dir]

    def has_file(self, file: str) -> bool:
        """Whether the checkpoint has ``file`` (local: in its folder; the Hub: at the commit)."""
        return self.readable(file)

    @property
    def name(self) -> str:
        """The checkpoint's own name (its folder's; a repo's): what upstream's file names start from."""
        return self.meta_dir.name

    def files(self) -> list[str]:
        return sorted(self._listed())

    def _listed(self) -> dict[str, set[str]]:
        """Tensor names by file, as the index lists them."""
        if self._by_file is None:
            self._by_file = {}
            # (a file's names mostly follow each other in the index: a run at a time, at C speed)
            for file, run in itertools.groupby(self.weight_map.items(), key=_FILE_OF):
                self._by_file.setdefault(file, set()).update(map(_NAME_OF, run))
        return self._by_file

    def release_listing(self) -> None:
        """Forget the names by file (made again from the index when asked): once a plan is made, what
        holds the real model's 500,000 names twice over is not kept while its vocabulary is built."""
        self._by_file = None

    def entry(self, name: str) -> TensorEntry:
        return self.entries((name,))[0]

    def entries(self, names: Sequence[str]) -> list[TensorEntry]:
        """The entries of ``names`` (each file's header looked up once, not once a name: an expert
        stack is 5,376 names)."""
        weight_map = self.weight_map
        files = set(map(weight_map.get, names))
        if len(files) == 1 and None not in files:  # (a stack's names, one file: looked up at C speed)
            return list(map(self.header(files.pop()).__getitem__, names))
        headers, out = {}, []
        for name in names:
            file = weight_map.get(name)
            if file is None:
                raise SourceError(f"{self.index_path}: no tensor {name}")
            header = headers.get(file)
            if header is None:
                header = headers[file] = self.header(file)
            out.append(header[name])
        return out

    # --- headers ---
    def header(self, file: str) -> dict[str, TensorEntry]:
        """A shard's validated header, checked against the index."""
        entries = self._headers.get(file)  # one lookup: another thread may release it meanwhile
        if entries is None:
            entries = self._parse(file)
            listed = self._listed().get(file, set())
            missing = sorted(listed - entries.keys())
            where = self.where(file)
            if missing:
                raise SourceError(f"{where}: tensor {missing[0]} is in the index but not in this file")
            extra = sorted(entries.keys() - listed)
            if extra:
                raise SourceError(
                    f"{where}: tensor {extra[0]} is in this file but the index does not list it here"
                )
            self._headers[file] = entries
        return entries

    def file_header(self, file: str) -> tuple[dict[str, TensorEntry], str]:
        """A file's header as a conversion task reads it (no index needed): entries and header SHA-256."""
        entries = self._parse(file)
        return entries, self._header_sha[file]

    def _parse(self, file: str) -> dict[str, TensorEntry]:
        path = self.local_path(file)
        local = self.readable(file)
        raw, size = read_raw_header(path) if local else self._fetch_raw_header(file)
        self._header_sha[file] = hashlib.sha256(raw).hexdigest()
        entries, _ = parse_header(raw, str(path) if local else self.where(file), size)
        return entries

    def header_sha256(self, file: str) -> str:
        if file not in self._header_sha:
            self._parse(file)
        return self._header_sha[file]

    def content_identity(self, file: str) -> dict[str, Any] | None:
        """What says the file's bytes are those read before, without reading them (a plan records it
        beside the header's SHA-256, and a later run reads the header again only when it changed);
        None when nothing can say so."""
        return None

    def distrust(self, file: str) -> None:
        """``file``'s own bytes contradict what was read of it earlier by other means (a header a plan
        was made from): forget those (local: the file is the only copy, nothing to forget)."""
        return None

    def release_header(self, file: str) -> None:
        """Forget a parsed header (read again when needed): bounded memory while planning."""
        self._headers.pop(file, None)

    def fetch_meta(self) -> None:
        """Make the metadata files readable in ``meta_dir`` (local: they are)."""
        return None  # a local folder holds them already

    def close(self) -> None:
        """The run is over: stop background work and remove what it left (local: nothing)."""
        return None  # nothing in flight

    # --- a file's bytes ---
    def acquire(self, file: str, report: TaskReport = NO_REPORT) -> None:
        """Make ``file``'s bytes readable until as many ``release``s (local: they are); downloads
        report to ``report``."""
        with self._lock:
            self._holds[file] = self._holds.get(file, 0) + 1

    def prefetch(self, file: str, report: TaskReport = NO_REPORT) -> None:
        """A hint: ``file`` is acquired next (local: nothing to do)."""
        return None  # nothing to fetch ahead

    def pin(self) -> dict[str, Any]:
        """The spec options that make every later open read exactly what this one read (the Hub:
        the commit); the plan records them and every task opens its source with them."""
        return {}

    def release(self, file: str, keep: bool = False) -> bool:
        """Done with ``file`` (once per ``acquire``): once nobody holds it, close it (the Hub source
        also deletes it, unless ``keep``: a task after this one reads it too). True when it was the
        last hold."""
        with self._lock:
            left = self._holds.get(file, 0) - 1
            if left > 0:
                self._holds[file] = left
                return False
            self._holds.pop(file, None)
            reads = self._open.pop(str(self.local_path(file)), None)
        self._acquired.pop(file, None)
        if reads is not None:
            reads.close()
        return True

    def read_piece(self, entry: TensorEntry, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of a tensor from byte ``offset`` of its data, read-only, in a buffer of its own
        (``FileReads``: with O_DIRECT from a file the page cache does not hold, else copied from the
        cache). The buffer lives as long as the array: read bounded pieces and drop them, and RSS
        stays bounded."""
        if offset + nbytes > entry.nbytes:
            raise SourceError(f"{entry.file}: tensor {entry.name}: read past its {entry.nbytes} bytes")
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        start = entry.start + offset
        try:
            return self._reads(entry.file).read(start, nbytes)
        except OSError as e:
            raise SourceError(
                f"{entry.file}: tensor {entry.name}: cannot read bytes {start}+{nbytes} ({e})"
            ) from None

    def will_need(self, entry: TensorEntry, offset: int, nbytes: int) -> None:
        """A hint: those bytes are read next; they are read ahead now, while the current piece is
        repacked and hashed."""
        if nbytes and offset + nbytes <= entry.nbytes:
            self._reads(entry.file).ahead(entry.start + offset, nbytes)

    def _reads(self, file: str) -> FileReads:
        """The open file's reads (opened on first use: with O_DIRECT when ``DIRECT_READS`` and the
        page cache does not hold it)."""
        with self._lock:
            reads = self._open.get(file)
            if reads is None:
                fd, _ = open_regular(file, "safetensors file")
                direct = self.DIRECT_READS and not in_page_cache(fd)
                reads = self._open[file] = FileReads(fd, self._buffers, direct)
        return reads

    def warm(self, names: list[str]) -> None:
        """A hint: these tensors are read next (the Hub fetches them side by side; here: nothing)."""
        return None  # a local file needs no warming

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of a tensor (its first axis), read-only: what a view shows of it.
        The Hub source reads only those bytes (``hub``); here they are mapped. Rows are counted from
        0, never from the end (as the Hub source counts them)."""
        _row_range(self.entry(name), start, stop)  # (the check: a negative row is one line)
        return self.array(name)[start:stop]

    def array(self, name: str) -> np.ndarray:
        """A whole tensor as a read-only memory map (the reference and the notebooks; never the
        converter). Its shard is acquired first (the Hub: downloaded) and kept until released."""
        file = self.weight_map.get(name)
        if file is None:
            raise SourceError(f"{self.index_path}: no tensor {name}")
        entries = self._acquired.get(file)
        if entries is None:
            self.acquire(file)
            entries = self._acquired[file] = self.file_header(file)[0]
        return read_tensor(entries[name])

    # --- for subclasses ---
    @abc.abstractmethod
    def local_path(self, file: str) -> Path:
        """Where the shard's bytes are (or will be, once acquired)."""

    def readable(self, file: str) -> bool:
        """Whether the shard's bytes are on this machine now (else its header is fetched remotely)."""
        path = self.local_path(file)
        return path.exists() or path.is_symlink()

    def _fetch_raw_header(self, file: str) -> tuple[bytes, int]:
        raise SourceError(f"{self.where(file)}: not found")

    def where(self, file: str) -> str:
        return str(self.local_path(file))

    def file_fingerprints(self, files: list[str]) -> dict[str, dict[str, Any]]:
        """What identifies each file's contents, cheaply (local: size and header SHA-256)."""
        out = {}
        for f in files:
            path = self.local_path(f)
            if not path.exists() and not path.is_symlink():
                raise SourceError(f"{self.index_path}: names {f}, which is not in {path.parent}")
            raw, size = read_raw_header(path)
            out[f] = {"size": size, "header_sha256": hashlib.sha256(raw).hexdigest()}
        return out

    def source_file(self, file: str) -> SourceFile:
        """What the plan records of a file it reads."""
        data = sum(e.nbytes for e in self.header(file).values())
        facts = self.file_fingerprints([file])[file]
        return SourceFile(file, facts["size"], facts["header_sha256"], data, facts.get("sha256"))


def _row_range(e: TensorEntry, start: int, stop: int | None) -> tuple[int, int]:
    """The byte range (within a tensor's data) of rows ``[start, stop)``: never wrapped around (a
    negative row would read the bytes before the tensor: another tensor's), past the end cut short."""
    for value in (start, stop):
        if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__") or value < 0):
            raise SourceError(f"{e.file}: tensor {e.name}: rows [{start}, {stop}): give rows from 0 on")
    rows = e.shape[0] if e.shape else 1
    stop = rows if stop is None else min(stop, rows)
    start = min(max(start, 0), stop)
    row = e.nbytes // rows if rows else 0
    return start * row, stop * row
