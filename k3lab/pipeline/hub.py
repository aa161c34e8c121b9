"""The Hugging Face Hub as a source: shards downloaded one at a time (plus one prefetched).

``HubSource`` is a ``sources.Source``. The metadata files (config, index, tokenizer) are fetched
into ``meta`` when missing; the safetensors headers of every shard are read with ranged GETs (a
few MB for the whole model), so the plan needs no shard on disk, and a shard's ETag (the SHA-256
of its contents) fingerprints it for the plan. A conversion task then ``acquire``s its shard:
huggingface_hub downloads it into ``scratch`` (resumable; the token and endpoint come with the
``SourceSpec``), and ``release`` deletes it. The runner's one loop does this in one process, in
``--jobs`` processes, or on every Dask worker alike. Transient failures (connection drop, timeout,
5xx) are retried with backoff and the download resumes where it stopped; 401/403/404 are one clear
error naming repo and file.
"""

from __future__ import annotations

import contextlib
import shutil
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.safetensors import MAX_HEADER
from k3lab.pipeline.sources import Source, SourceError, SourceSpec

PREFETCH_AHEAD = 1  # shards downloaded ahead of the one converting: at most two on disk per worker
HEADER_PROBE = 1 << 20  # the first ranged read; most headers fit in it


class HubError(K3LabError):
    """The Hub refused (401/403/404) or kept failing; the message names repo and file."""


def _is_fatal(e: Exception) -> bool:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
        return True
    status = getattr(getattr(e, "response", None), "status_code", None)
    return isinstance(e, HfHubHTTPError) and status in (400, 401, 403, 404)


def with_retries(what: str, fn: Any, attempts: int = 8, base_delay: float = 0.25) -> Any:
    """fn() retried with exponential backoff on transient errors; fatal ones become one HubError line."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if _is_fatal(e):
                status = getattr(getattr(e, "response", None), "status_code", "")
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise HubError(f"{what}: {status} {reason}".replace("  ", " ")) from None
            if attempt + 1 == attempts:
                raise HubError(
                    f"{what}: still failing after {attempts} attempts ({type(e).__name__}: {e})"
                ) from None
            time.sleep(base_delay * 2**attempt)
    raise AssertionError("unreachable")  # pragma: no cover


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
) -> SourceSpec:
    """The spec of a Hub repo (``token`` is never written anywhere, nor shown)."""
    options = (("revision", revision), ("scratch", str(scratch) if scratch else None), ("endpoint", endpoint))
    return SourceSpec(
        "hub", str(meta_dir), repo, (*options, ("keep_source", keep_source)), token, meta_files, optional_meta
    )


def open_source(spec: SourceSpec) -> Source:
    return HubSource(spec)


class HubSource(Source):
    """A checkpoint on the Hub: headers by ranged reads, a shard's bytes once acquired into scratch."""

    def __init__(self, spec: SourceSpec):
        super().__init__()
        self.repo, self.revision, self.token = spec.location, spec.option("revision") or "main", spec.token
        self.endpoint, self.keep = spec.option("endpoint"), bool(spec.option("keep_source"))
        self.meta_dir = Path(spec.meta_dir)
        self.scratch = Path(spec.option("scratch") or self.meta_dir / "scratch")
        self.meta_files, self.optional_meta = spec.meta_files, spec.optional_meta
        self._pending: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._downloaded: set[str] = set()  # what this source put in scratch: all it may delete

    def fetch_meta(self) -> None:
        """Download the metadata files into ``meta`` where missing (the planner's first step)."""
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        for name in self.meta_files + self.optional_meta:
            if not (self.meta_dir / name).exists():
                try:
                    self._download(name, self.meta_dir)
                except HubError:
                    if name not in self.optional_meta:
                        raise

    def where(self, file: str) -> str:
        return f"{self.repo}/{file}"

    def local_path(self, file: str) -> Path:
        return self.scratch / file

    # --- fetching ---
    def _download(self, filename: str, local_dir: Path) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(
            with_retries(
                f"{self.repo}@{self.revision}: {filename}",
                lambda: hf_hub_download(
                    self.repo,
                    filename,
                    revision=self.revision,
                    local_dir=local_dir,
                    token=self.token,
                    endpoint=self.endpoint,
                ),
            )
        )

    def _download_shard(self, file: str) -> None:
        self._downloaded.add(file)  # before: a download cut half way is ours to remove too
        self._download(file, self.scratch)

    def acquire(self, file: str) -> None:
        """Download ``file`` into scratch (resuming a partial download), or wait for its prefetch."""
        pending = self._pending.pop(file, None)
        if pending is not None:
            pending.result()
        elif not self.local_path(file).exists():
            self.scratch.mkdir(parents=True, exist_ok=True)
            self._download_shard(file)

    def prefetch(self, file: str) -> None:
        if file in self._pending or len(self._pending) >= PREFETCH_AHEAD or self.local_path(file).exists():
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="k3lab-prefetch")
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._pending[file] = self._pool.submit(self._download_shard, file)

    def release(self, file: str) -> None:
        """Delete a converted shard from scratch (and huggingface_hub's bookkeeping of it): only a
        file this source downloaded there, never one it found."""
        super().release(file)
        if self.keep or file not in self._downloaded:
            return
        self._downloaded.discard(file)
        path = self.local_path(file)
        if path.is_symlink() or not path.resolve().is_relative_to(self.scratch.resolve()):
            return
        path.unlink(missing_ok=True)
        meta = self.scratch / ".cache" / "huggingface" / "download"
        for leftover in (meta / (file + ".metadata"), meta / (file + ".lock")):
            leftover.unlink(missing_ok=True)

    def close(self) -> None:
        """Cancel prefetches and delete what they and whole-tensor reads left (a run that stops early)."""
        for file in list(self._acquired):
            self.release(file)
        for file, fut in list(self._pending.items()):
            fut.cancel()
            with contextlib.suppress(Exception):  # the download's own error is not this run's
                fut.result()
            self.release(file)
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        shutil.rmtree(self.scratch / ".cache", ignore_errors=True)

    def shard_fingerprint(self, files: list[str]) -> dict[str, dict[str, Any]]:
        """Size and ETag (the SHA-256 of an LFS file) of each shard, from HEAD requests in parallel."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        def one(f: str) -> tuple[str, dict[str, Any]]:
            url = hf_hub_url(self.repo, f, revision=self.revision, endpoint=self.endpoint)
            m = with_retries(
                f"{self.repo}@{self.revision}: {f}", lambda: get_hf_file_metadata(url, token=self.token)
            )
            return f, {"size": m.size, "etag": m.etag}

        with ThreadPoolExecutor(8) as pool:
            return dict(pool.map(one, files))

    def planned_shard(self, file: str) -> dict[str, Any]:
        size = sum(e.nbytes for e in self.header(file).values())
        return {
            "data_bytes": size,
            "header_sha256": self.header_sha256(file),
            **self.shard_fingerprint([file])[file],
        }

    def _fetch_raw_header(self, file: str) -> tuple[bytes, int]:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo, file, revision=self.revision, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token)

        def ranged(start: int, end: int) -> tuple[bytes, int]:
            def get() -> tuple[bytes, int]:
                r = get_session().get(
                    url,
                    headers={**headers, "Range": f"bytes={start}-{end}"},
                    follow_redirects=True,
                    timeout=60,
                )
                hf_raise_for_status(r)
                total = int(r.headers.get("Content-Range", "/0").rsplit("/", 1)[-1] or 0)
                return r.content, total

            return with_retries(f"{self.repo}@{self.revision}: {file} (header)", get)

        head, size = ranged(0, HEADER_PROBE - 1)
        if len(head) < 8:
            raise SourceError(f"{self.repo}: {file}: {len(head)} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER or (size and 8 + n > size):
            raise SourceError(f"{self.repo}: {file}: header length {n} does not fit the file ({size} bytes)")
        if 8 + n > len(head):
            head += ranged(len(head), 8 + n - 1)[0]
        return head[8 : 8 + n], size
