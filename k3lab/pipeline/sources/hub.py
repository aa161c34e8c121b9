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
  ``hub.transport.download`` fetches each by ranged GETs into a download slot k3lab owns (``slots``:
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

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from k3lab.formats.files import (
    partial_path,
    remove_regular,
)
from k3lab.formats.safetensors import INDEX_NAME, TensorEntry
from k3lab.pipeline.hub import transport
from k3lab.pipeline.hub.files import FETCHED, RemoteFile, read_fetched, write_fetched
from k3lab.pipeline.hub.ranges import RangeCache
from k3lab.pipeline.hub.retry import (
    RETRY_BUDGET,
    HubError,
    HubUnreachable,
    fold_hf_logging,
    with_retries,
)
from k3lab.pipeline.progress import NO_REPORT
from k3lab.pipeline.sources.base import (
    META_LIMIT,
    Source,
    SourceFile,
    SourceSpec,
)
from k3lab.pipeline.sources.hub_downloads import Downloads
from k3lab.pipeline.sources.hub_ranges import RangedReads
from k3lab.pipeline.sources.slots import Slot

__all__ = ["HubError", "HubSource", "HubUnreachable", "RETRY_BUDGET", "hub_spec", "with_retries"]


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


class HubSource(Downloads, RangedReads, Source):
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
        transport.install()

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

    @property
    def name(self) -> str:
        return self.repo.rsplit("/", 1)[-1]

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

    def _parse(self, file: str) -> dict[str, TensorEntry]:
        entries = super()._parse(file)
        for e in entries.values():  # (an entry names its file as errors should: the repo, the commit)
            self._labels[e.file] = file
            break
        return entries
