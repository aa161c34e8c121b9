"""The Hugging Face Hub as a source: one pinned commit, shards downloaded one at a time (plus one
prefetched), each checked against its SHA-256 before it is converted.

``HubSource`` is a ``sources.Source``.

- **One commit.** ``resolve`` asks the Hub once (``model_info(files_metadata=True)``) for the commit
  ``--revision`` names (a branch, a tag or a commit) and every file's size, git blob id and LFS
  SHA-256. The plan records the commit (``pin``) and every task reads at that commit, so a set never
  mixes revisions; each shard's SHA-256 is in the plan and in its output file's digest, so a shard
  changed on the Hub redoes exactly its file.
- **Metadata** (config, index, tokenizer) is fetched into ``meta`` at that commit, where missing or
  where a file k3lab fetched earlier is not the commit's (``meta/.k3lab-fetched.json`` lists what it
  fetched; a file it did not fetch is never replaced: one line instead).
- **Headers** are read with ranged GETs at the commit (a few MB for the whole model), so the plan
  needs no shard on disk.
- **Files.** A task ``acquire``s the files its output file reads, as its tensors need them:
  ``http.download`` fetches each by ranged GETs into a download slot k3lab owns (``slots``:
  ``SCRATCH/k3lab-dl-KEY/``, locked by the process using it), hashing as the bytes arrive; a cut
  download continues from its last byte (in this run or the next: the key is the file's name and
  SHA-256); other slots of dead tasks are removed. The SHA-256 is checked against the Hub's before
  the file takes its name. Two tasks of one process that need one file share one download;
  ``release`` deletes the slot once nobody holds it, unless the next task reads it too (``keep``:
  at most ``KEPT`` such files wait). Disk budget per process: the files the tensor being converted
  reads (one, two where a stack of experts straddles two files), one prefetched, one kept.
- **Outages** (``retry``): transient failures are retried with backoff until the Hub has failed for
  ``retry_budget`` seconds in a row: then ``HubUnreachable``, exit 1. 401/403/404 are ``HubError``,
  one line, exit 2.

Nothing is printed here: download bytes and retries go to the task's ``TaskReport`` and so into the
run's one progress bar.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.formats.files import (
    partial_path,
    remove_regular,
)
from k3lab.formats.safetensors import INDEX_NAME, MAX_HEADER, NUMPY_DTYPE, TensorEntry
from k3lab.pipeline.progress import NO_REPORT, Cancelled, TaskReport
from k3lab.pipeline.sources import http
from k3lab.pipeline.sources.base import (
    META_LIMIT,
    Source,
    SourceError,
    SourceFile,
    SourceSpec,
    _row_range,
    _row_shape,
)
from k3lab.pipeline.sources.ranges import RangeCache
from k3lab.pipeline.sources.remote_files import FETCHED, RemoteFile, download, read_fetched, write_fetched
from k3lab.pipeline.sources.retry import (
    RETRY_BUDGET,
    HubError,
    HubUnreachable,
    fold_hf_logging,
    with_retries,
)
from k3lab.pipeline.sources.slots import Slot, sweep_scratch

__all__ = ["HubError", "HubSource", "HubUnreachable", "RETRY_BUDGET", "hub_spec", "with_retries"]

WARM_THREADS = 8  # ranged reads in flight at once when a view asks for many tensors
WINDOW = 16 << 20  # a ranged read of a tensor reads this much of it at once (bounded memory)
PREFETCH_AHEAD = 1  # files downloaded ahead of the ones converting
KEPT = 1  # files kept after their last task because the next one reads them too


# --- the source ---------------------------------------------------------------------------------------


def hub_spec(
    meta_dir: str | Path,
    repo: str,
    revision: str | None = None,
    scratch: str | Path | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    keep_source: bool = False,
    meta_files: tuple[str, ...] = (),
    optional_meta: tuple[str, ...] = (),
    retry_budget: float | None = None,
) -> SourceSpec:
    """The spec of a Hub repo (``token`` is never written anywhere, nor shown)."""
    options = (
        ("revision", revision),
        ("scratch", str(scratch) if scratch else None),
        ("endpoint", endpoint),
        ("keep_source", keep_source),
        ("retry_budget", retry_budget),
    )
    return SourceSpec("hub", str(meta_dir), repo, options, token, meta_files, optional_meta)


def open_source(spec: SourceSpec) -> Source:
    return HubSource(spec)


class HubSource(Source):
    """A checkpoint on the Hub at one commit: headers by ranged reads, a shard's bytes once acquired."""

    def __init__(self, spec: SourceSpec):
        super().__init__()
        self.repo, self.token = spec.location, spec.token
        self.requested = spec.option("revision") or "main"
        self.commit: str | None = spec.option("commit")  # a pinned spec's (a task's)
        self.endpoint, self.keep = spec.option("endpoint"), bool(spec.option("keep_source"))
        budget = spec.option("retry_budget")
        self.budget = RETRY_BUDGET if budget is None else float(budget)
        self.meta_dir = Path(spec.meta_dir)
        scratch = spec.option("scratch")  # (the front always gives one: see ``request``)
        self.scratch = Path(scratch) if scratch else None
        self.meta_files, self.optional_meta = spec.meta_files, spec.optional_meta
        self._remote: dict[str, RemoteFile] | None = None
        self._slots: dict[str, Slot] = {}  # file -> its download, held by this process
        self._pending: dict[str, Future] = {}  # file -> its download in flight (a prefetch, or a task's)
        self._prefetching: set[str] = set()
        self._kept: list[str] = []  # files nobody holds, kept for a next task, oldest first
        self._pool: ThreadPoolExecutor | None = None
        self._closing = threading.Event()
        self._state = threading.Lock()
        self.cache = RangeCache()
        self._labels: dict[str, str] = {}  # how entries name their file -> the file
        self._window: dict[str, tuple[int, bytes]] = {}  # file -> (offset, bytes) last read by map
        self.counts = self.cache.counts  # bytes fetched by ranges (and served from the cache)
        fold_hf_logging()
        http.install()

    @property
    def revision(self) -> str:
        return self.commit or self.requested

    def where(self, file: str) -> str:
        return f"{self.repo}@{self.revision[:12]}: {file}"

    def local_path(self, file: str) -> Path:
        slot = self._slots.get(file)
        return (slot.folder if slot else self.scratch or self.meta_dir) / file

    def readable(self, file: str) -> bool:
        return file in self._slots  # only what this source downloaded and checked

    def has_file(self, file: str) -> bool:
        return file in self.resolve()

    def _index_dirs(self) -> list[Path]:
        """The index is the commit's, fetched into ``meta`` (none at the commit: one file, no index)."""
        return [self.meta_dir] if INDEX_NAME in self.resolve() else []

    # --- the commit ---
    def resolve(self) -> dict[str, RemoteFile]:
        """The commit and its files, from one call (every later read is at that commit)."""
        if self._remote is None:
            from huggingface_hub import HfApi

            api = HfApi(endpoint=self.endpoint, token=self.token)
            info = with_retries(
                f"{self.repo}@{self.revision}",
                lambda: api.model_info(self.repo, revision=self.revision, files_metadata=True),
                self.budget,
            )
            if not info.sha or (self.commit and info.sha != self.commit):
                raise HubError(f"{self.repo}@{self.revision}: the Hub answered for commit {info.sha}")
            files = {}
            for s in info.siblings or []:
                sha = s.lfs.sha256 if s.lfs is not None else None
                files[s.rfilename] = RemoteFile(s.rfilename, int(s.size or 0), sha, s.blob_id)
            self.commit, self._remote = info.sha, files
        return self._remote

    def pin(self) -> dict[str, Any]:
        """The spec options that fix what was read: the commit (and, for the record, the repo)."""
        self.resolve()
        return {"commit": self.commit, "repo": self.repo}

    def remote(self, file: str) -> RemoteFile:
        found = self.resolve().get(file)
        if found is None:
            raise HubError(f"{self.where(file)}: 404 not in the repo at this commit")
        return found

    # --- metadata ---
    def fetch_meta(self) -> None:
        """Make ``meta`` hold the commit's metadata files (the planner's first step)."""
        self.resolve()
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        fetched_path = self.meta_dir / FETCHED
        fetched = read_fetched(fetched_path)
        for name in self.meta_files + self.optional_meta:
            remote = self._remote.get(name) if self._remote else None
            local = self.meta_dir / name
            if remote is None:
                if name not in self.optional_meta:
                    raise HubError(f"{self.where(name)}: 404 not in the repo at this commit")
                if name in fetched:  # k3lab's copy from another commit, which had it: not this one's
                    remove_regular(local)
                    del fetched[name]
                    write_fetched(fetched_path, fetched)
                continue
            if remote.matches(local):
                continue
            if (local.exists() or local.is_symlink()) and fetched.get(name) != remote.local_oid(
                local, META_LIMIT
            ):
                raise HubError(
                    f"{local}: is not {self.where(name)} and k3lab did not fetch it; move it away or "
                    "give another --meta (k3lab never replaces a file it did not make)"
                )
            partial = partial_path(local, os.getpid())
            remove_regular(partial)  # (a killed fetch of this process id's)
            try:
                if self._download(remote, partial, NO_REPORT) != remote.oid:
                    raise HubError(f"{self.where(name)}: the downloaded bytes are not the ones the Hub lists")
                if local.is_symlink():
                    raise HubError(f"{local}: is a symlink; k3lab never writes through one (remove it)")
                os.replace(partial, local)
            finally:
                remove_regular(partial)
            fetched[name] = remote.oid
            write_fetched(fetched_path, fetched)

    # --- files ---
    def file_fingerprints(self, files: list[str]) -> dict[str, dict[str, Any]]:
        """Size and SHA-256 of each file at the pinned commit (from the one metadata call)."""
        return {f: {"size": self.remote(f).size, "sha256": self.remote(f).oid} for f in files}

    def source_file(self, file: str) -> SourceFile:
        data = sum(e.nbytes for e in self.header(file).values())
        remote = self.remote(file)
        return SourceFile(file, remote.size, self.header_sha256(file), data, remote.oid)

    def acquire(self, file: str, report: TaskReport = NO_REPORT) -> None:
        """Download ``file`` (or wait for the download of it in flight: a prefetch, another task's)
        and check its SHA-256, ready to map until as many ``release``s."""
        with self._state:
            if file in self._slots:
                self._hold(file)
                return
            pending = self._pending.get(file)
            if pending is None:
                pending = self._pending[file] = Future()
                pending.set_running_or_notify_cancel()
                mine = True
            else:
                mine = False
        if mine:
            try:
                slot = self._fetch(file, report)
            except BaseException as e:
                with self._state:
                    self._pending.pop(file, None)
                pending.set_exception(e)
                raise
            pending.set_result(slot)
        else:
            while True:  # the download runs in another thread: hear a stop meanwhile
                try:
                    slot = pending.result(timeout=0.25)
                    break
                except FutureTimeout:
                    report.check()
        with self._state:
            self._pending.pop(file, None)
            self._prefetching.discard(file)
            self._slots.setdefault(file, slot)
            self._hold(file)

    def _hold(self, file: str) -> None:
        """(under ``_state``) one more hold of a file that is here."""
        with self._lock:
            self._holds[file] = self._holds.get(file, 0) + 1
        if file in self._kept:
            self._kept.remove(file)

    def prefetch(self, file: str, report: TaskReport = NO_REPORT) -> None:
        with self._state:
            if file in self._pending or file in self._slots or len(self._prefetching) >= PREFETCH_AHEAD:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="k3lab-prefetch")
            self._prefetching.add(file)
            self._pending[file] = self._pool.submit(self._fetch, file, report)

    def _fetch(self, file: str, report: TaskReport) -> Slot:
        """Download ``file`` at the pinned commit into its slot and check its bytes; returns the slot,
        held. A cut download continues from its last byte, in this run or the next (the slot's key
        is the file's name and SHA-256, so only the same bytes ever resume it); other bytes than the
        Hub lists, or a stop, remove the slot."""
        remote = self.remote(file)
        if self.scratch is None:
            raise HubError(f"{self.where(file)}: no scratch folder to download it into (give --scratch)")
        self.scratch.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha256(f"{file}\0{remote.oid}".encode()).hexdigest()[:32]
        sweep_scratch(self.scratch, keep=key)
        slot = Slot(self.scratch, key)
        slot.take(block=True)
        path = slot.folder / file
        try:
            if slot.kept_path.exists() and remote.matches(path):
                report.downloaded(remote.size)
                return slot
            slot.kept_path.unlink(missing_ok=True)
            partial = path.with_name(path.name + ".incomplete")
            digest = self._download(remote, partial, report)
            if digest != remote.oid:
                raise HubError(
                    f"{self.where(file)}: the downloaded bytes are not the ones the Hub lists "
                    f"(SHA-256 {remote.oid[:16]}..., {remote.size} bytes); the download was discarded"
                )
            os.replace(partial, path)  # (the final name only ever holds the checked bytes)
            if self.keep:
                slot.kept_path.touch()
            return slot
        except (Cancelled, HubUnreachable, KeyboardInterrupt):
            slot.release()  # (kept for the next attempt: its bytes are the Hub's, so far)
            raise
        except BaseException:
            slot.remove()
            raise

    def _download(self, remote: RemoteFile, path: Path, report: TaskReport) -> str:
        """The rest of ``remote``'s bytes into ``path`` (see ``remote_files.download``)."""
        url = http.file_url(self.repo, remote.name, self.commit or self.revision, self.endpoint)
        return download(
            url, remote, path, self.token, self.where(remote.name), report, self._closing, self.budget
        )

    def release(self, file: str, keep: bool = False) -> bool:
        """Done with ``file`` (once per ``acquire``): once nobody holds it, close it and delete its
        download (``--keep-source``: keep it on disk), unless ``keep``: a next task reads it too, so
        it stays, one of at most ``KEPT`` (the oldest goes first)."""
        if not super().release(file):
            return False
        gone = []
        with self._state:
            if file not in self._slots:
                return True
            if keep and not self._closing.is_set():
                self._kept.append(file)
                while len(self._kept) > KEPT:
                    gone.append(self._kept.pop(0))
            else:
                gone.append(file)
            slots = [self._slots.pop(f) for f in gone]
        for slot in slots:
            if self.keep and slot.kept_path.exists():
                slot.release()
            else:
                slot.remove()
        return True

    def close(self) -> None:
        """Stop prefetches and delete what they and whole-tensor reads left (a run that stops early)."""
        self._closing.set()
        with self._state, self._lock:
            self._holds.clear()
            self._kept.clear()
        for file in list(self._acquired) + list(self._slots):
            self.release(file)
        with self._state:
            pending, self._pending = dict(self._pending), {}
        for fut in pending.values():
            with contextlib.suppress(BaseException):  # the download's own error is not this run's
                fut.result().remove()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._closing.clear()

    # --- byte ranges (looking inside without downloading) ---
    def fetch(self, file: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of ``file`` at the pinned commit, by a ranged GET (not kept)."""
        remote = self.remote(file)
        url = http.file_url(self.repo, file, self.commit or self.revision, self.endpoint)
        where = self.where(file)
        return with_retries(
            where, lambda: http.fetch_range(url, start, stop, remote.size, self.token, where), self.budget
        )

    def cached(self, file: str, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of ``file`` through the range cache (fetched at most once)."""
        return self.cache.read(self.remote(file).oid, start, stop, lambda a, b: self.fetch(file, a, b))

    def map(self, entry: TensorEntry, offset: int, nbytes: int) -> np.ndarray:
        """A piece of a tensor: from the downloaded shard when this source holds it (converting),
        else by a ranged GET, never stored (``verify`` streaming a whole set through)."""
        file = self._labels.get(entry.file, entry.file)
        if file in self._slots:
            return super().map(entry, offset, nbytes)
        if offset + nbytes > entry.nbytes:
            raise SourceError(f"{entry.file}: tensor {entry.name}: read past its {entry.nbytes} bytes")
        start, stop = entry.start + offset, entry.start + offset + nbytes
        with self._state:
            held = self._window.get(file)
        if held is None or not held[0] <= start or stop > held[0] + len(held[1]):
            # a window of the tensor from here (the streams read a tensor front to back, in pieces)
            end = min(entry.start + entry.nbytes, max(stop, start + WINDOW))
            held = (start, self.fetch(file, start, end))
            self.counts.add(fetched=len(held[1]), requests=1)
            with self._state:
                self._window[file] = held
        return np.frombuffer(held[1], dtype=np.uint8, count=nbytes, offset=start - held[0])

    def will_need(self, entry: TensorEntry, offset: int, nbytes: int) -> None:
        if self._labels.get(entry.file, entry.file) in self._slots:
            super().will_need(entry, offset, nbytes)

    def warm(self, names: list[str]) -> None:
        """Fetch these tensors into the range cache side by side (``WARM_THREADS`` ranged reads at
        once: the Hub's round trips overlap); those a downloaded shard holds need nothing."""
        jobs = []
        for name in names:
            e, file = self.entry(name), self.weight_map[name]
            if file not in self._slots:
                jobs.append((file, e.start, e.start + e.nbytes))
        if len(jobs) > 1:
            with ThreadPoolExecutor(WARM_THREADS, thread_name_prefix="k3lab-warm") as pool:
                for done in [pool.submit(self.cached, *job) for job in jobs]:
                    done.result()

    def array(self, name: str) -> np.ndarray:
        """A whole tensor, by ranges through the cache (a downloaded shard's when this source holds it)."""
        return self.rows(name)

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        e, file = self.entry(name), self.weight_map[name]
        if file in self._slots:
            return super().rows(name, start, stop)
        first, last = _row_range(e, start, stop)
        data = self.cached(file, e.start + first, e.start + last)
        return data.view(NUMPY_DTYPE[e.dtype]).reshape(_row_shape(e, start, stop))

    def _parse(self, file: str) -> dict[str, TensorEntry]:
        entries = super()._parse(file)
        for e in entries.values():  # (an entry names its file as errors should: the repo, the commit)
            self._labels[e.file] = file
            break
        return entries

    def _fetch_raw_header(self, file: str) -> tuple[bytes, int]:
        """The shard's header by ranged reads at the commit, through the cache (exactly the bytes asked)."""
        size = self.remote(file).size
        if size < 8:
            raise SourceError(f"{self.where(file)}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", bytes(self.cached(file, 0, 8)))
        if n > MAX_HEADER or 8 + n > size:
            raise SourceError(f"{self.where(file)}: header length {n} does not fit the file ({size} bytes)")
        head = bytes(self.cached(file, 0, 8 + n))  # (exactly the header: its length, then its JSON)
        return head[8 : 8 + n], size
