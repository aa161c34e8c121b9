"""Streaming from the Hugging Face Hub: one source shard on disk at a time (plus one prefetched).

``HubSource`` has LocalSource's interface. The metadata files (config, index, tokenizer) are
fetched into ``meta`` when missing; the safetensors headers of every shard are read with ranged
GETs (a few MB for the whole model), so the plan needs no shard on disk. ``stream_convert`` then
walks the shards: download shard k into ``scratch`` with huggingface_hub (resumable; ``HF_TOKEN``
and ``HF_ENDPOINT`` honoured), prefetch k+1 while converting k, delete k (unless
``keep_source``). Transient failures (connection drop, timeout, 5xx) are retried with backoff and
the download resumes where it stopped; 401/403/404 are one clear error naming repo and file.
"""

from __future__ import annotations

import shutil
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import K3LabError
from .safetensors_format import MAX_HEADER, TensorEntry, parse_header, read_header, read_tensor
from .source import INDEX_NAME, SourceBase, SourceError, read_index

META_FILES = ("config.json", INDEX_NAME, "tiktoken.model", "tokenizer_config.json")
OPTIONAL_META = ("preprocessor_config.json",)
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


@dataclass
class Transfer:
    """Download and conversion throughput, measured apart."""

    downloaded: int = 0
    download_seconds: float = 0.0
    converted: int = 0
    convert_seconds: float = 0.0
    peak_shards_on_disk: int = 0

    def summary(self) -> str:
        def rate(n: int, s: float) -> str:
            return f"{n / s / 1e6:.1f} MB/s" if s > 0 else "-"

        return (
            f"downloaded {self.downloaded / 1e6:.1f} MB in {self.download_seconds:.1f} s "
            f"({rate(self.downloaded, self.download_seconds)}); converted {self.converted / 1e6:.1f} MB in "
            f"{self.convert_seconds:.1f} s ({rate(self.converted, self.convert_seconds)}); at most "
            f"{self.peak_shards_on_disk} source shards on disk"
        )


class HubSource(SourceBase):
    """A checkpoint on the Hub, read like LocalSource: headers remotely, tensor bytes once fetched."""

    def __init__(
        self,
        repo: str,
        meta_dir: str | Path,
        scratch: str | Path,
        revision: str | None = None,
        token: str | None = None,
    ):
        self.repo, self.revision, self.token = repo, revision or "main", token
        self.meta_dir, self.scratch = Path(meta_dir), Path(scratch)
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(parents=True, exist_ok=True)
        for name in META_FILES + OPTIONAL_META:
            if not (self.meta_dir / name).exists():
                self._download_meta(name, optional=name in OPTIONAL_META)
        self.index_path, self.weight_map = read_index(self.meta_dir)
        self._headers: dict[str, dict[str, TensorEntry]] = {}  # remote headers (ranged reads)
        self._local: dict[str, dict[str, TensorEntry]] = {}

    # --- fetching ---
    def _download(self, filename: str, local_dir: Path) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(
            with_retries(
                f"{self.repo}@{self.revision}: {filename}",
                lambda: hf_hub_download(
                    self.repo, filename, revision=self.revision, local_dir=local_dir, token=self.token
                ),
            )
        )

    def _download_meta(self, name: str, optional: bool) -> None:
        try:
            self._download(name, self.meta_dir)
        except HubError:
            if not optional:
                raise

    def fetch(self, file: str) -> Path:
        """Download one shard into scratch (resuming a partial download) and validate its header."""
        path = self._download(file, self.scratch)
        entries, _ = read_header(path)
        remote = self._headers.get(file)
        if remote is not None and {n: (e.dtype, e.shape, e.nbytes) for n, e in entries.items()} != {
            n: (e.dtype, e.shape, e.nbytes) for n, e in remote.items()
        }:
            raise SourceError(f"{path}: downloaded header differs from the one the plan was made from")
        self._local[file] = entries
        return path

    def release(self, file: str) -> None:
        """Delete a converted shard from scratch (and huggingface_hub's bookkeeping of it)."""
        self._local.pop(file, None)
        (self.scratch / file).unlink(missing_ok=True)
        meta = self.scratch / ".cache" / "huggingface" / "download" / (file + ".metadata")
        meta.unlink(missing_ok=True)

    def _remote_header(self, file: str) -> dict[str, TensorEntry]:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo, file, revision=self.revision)
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
        entries, _ = parse_header(head[8 : 8 + n], f"{self.repo}/{file}", size or None)
        return entries

    # --- the SourceBase interface ---
    def header(self, file: str) -> dict[str, TensorEntry]:
        if file in self._local:
            return self._local[file]
        if file not in self._headers:
            self._headers[file] = self._remote_header(file)
        return self._headers[file]

    def array(self, name: str) -> np.ndarray:
        file = self.weight_map[name]
        if file not in self._local:
            raise SourceError(f"{self.repo}: {file} is not downloaded (fetch it first)")
        return read_tensor(self._local[file][name])


def stream_convert(
    repo: str,
    meta_dir: str | Path,
    out_dir: str | Path,
    shards: str | list[int] | None = None,
    scratch: str | Path | None = None,
    revision: str | None = None,
    keep_source: bool = False,
    outtype: str = "auto",
    basename: str = "Kimi-K3",
    force: bool = False,
    token: str | None = None,
    quiet: bool = False,
) -> Transfer:
    """Convert from the Hub shard by shard: at most the current and the next source shard on disk."""
    from tqdm import tqdm

    from .config import K3Config
    from .convert import convert_file
    from .manifest import is_complete, merge
    from .plan import build_plan
    from .runner import parse_shards

    out_dir = Path(out_dir)
    scratch = Path(scratch or out_dir / ".k3lab" / "scratch")
    source = HubSource(repo, meta_dir, scratch, revision, token)
    cfg = K3Config.load(meta_dir)
    plan = build_plan(cfg, source, outtype, basename)
    numbers = parse_shards(shards, len(plan.files)) if not isinstance(shards, list) else shards
    todo = [
        k
        for k in numbers
        if force or not is_complete(out_dir, k, plan.file(k).filename, plan.file(k).digest())
    ]
    stats = Transfer()
    on_disk: set[str] = set()

    def download(k: int) -> tuple[int, Path, float]:
        t = time.perf_counter()
        path = source.fetch(plan.file(k).source_file)
        return k, path, time.perf_counter() - t

    bar = tqdm(total=len(todo), unit="shard", desc=f"{repo}", disable=True if quiet else None)
    with ThreadPoolExecutor(1, thread_name_prefix="k3lab-prefetch") as pool:
        pending: Future | None = pool.submit(download, todo[0]) if todo else None
        for i, k in enumerate(todo):
            assert pending is not None
            _, path, seconds = pending.result()
            file = plan.file(k).source_file
            on_disk.add(file)
            stats.downloaded += path.stat().st_size
            stats.download_seconds += seconds
            pending = (
                pool.submit(download, todo[i + 1]) if i + 1 < len(todo) else None
            )  # never more than one ahead
            if pending is not None:
                on_disk.add(plan.file(todo[i + 1]).source_file)
            stats.peak_shards_on_disk = max(stats.peak_shards_on_disk, len(on_disk))
            t = time.perf_counter()
            convert_file(plan, k, source, out_dir, meta_dir, force=force)
            stats.convert_seconds += time.perf_counter() - t
            stats.converted += path.stat().st_size
            if not keep_source:
                source.release(file)
                on_disk.discard(file)
            bar.update(1)
            bar.set_postfix_str(plan.file(k).filename)
    bar.close()
    merge(out_dir)
    if not keep_source:
        shutil.rmtree(scratch / ".cache", ignore_errors=True)
    return stats
