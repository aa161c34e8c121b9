"""What the Hub lists of a pinned commit (``RemoteFile``), how one of its files is downloaded
(resuming, hashed as it arrives, within the retry budget), and the list of metadata files k3lab
fetched into ``meta`` (so that it replaces only its own)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.files import parse_json, read_bounded, read_chunks, write_atomically
from k3lab.formats.hashing import git_blob_hash
from k3lab.pipeline.hub import transport
from k3lab.pipeline.hub.retry import HubError, with_retries
from k3lab.pipeline.progress import Cancelled, TaskReport

FETCHED = ".k3lab-fetched.json"  # in meta: the metadata files k3lab fetched, and their hashes


@dataclass(frozen=True)
class RemoteFile:
    """A file of the pinned commit, as the Hub lists it."""

    name: str
    size: int
    sha256: str | None  # the LFS oid (every safetensors shard has one)
    blob_id: str | None  # the git blob id (small files kept in git)

    @property
    def oid(self) -> str:
        return self.sha256 or f"git-{self.blob_id}"

    def local_oid(self, path: Path, limit: int | None = None) -> str | None:
        """The file at ``path`` hashed the way the Hub identifies this file (SHA-256, or git blob id),
        in ``oid``'s form; None when it is not a regular file of at most ``limit`` bytes."""
        try:
            size = os.lstat(path).st_size
            h = hashlib.sha256() if self.sha256 else git_blob_hash(size)
            for chunk in read_chunks(path, self.size if limit is None else limit, "file", follow=False):
                h.update(chunk)
        except (OSError, K3LabError):
            return None
        return h.hexdigest() if self.sha256 else f"git-{h.hexdigest()}"

    def matches(self, path: Path) -> bool:
        """Whether the file at ``path`` has exactly these bytes (size, then SHA-256 or git blob id)."""
        return self.local_oid(path) == self.oid


@dataclass(frozen=True)
class PinnedFile:
    """One file a user named as ``ORG/NAME:PATH[@REVISION]`` (an imatrix, a calibration text), found
    at the revision's commit: where, what the Hub lists of it, and the Hub it is on (never who: the
    token is carried, not shown)."""

    repo: str
    path: str
    commit: str
    file: RemoteFile
    endpoint: str
    token: str | None = field(repr=False)
    budget: float
    where: str  # the flag and the file, to name it in a message

    def url(self) -> str:
        return transport.file_url(self.repo, self.path, self.commit, self.endpoint)


def pinned_file(repo: str, path: str, revision: str | None, flag: str, limit: int, what: str) -> PinnedFile:
    """``repo``'s file ``path`` at ``revision`` (default main), through k3lab's bounded transport: one
    line for a name that is not one, a file that is not there, or one larger than ``limit`` bytes
    (``what`` it would be)."""
    from huggingface_hub import HfApi

    from k3lab import values
    from k3lab.pipeline.hub.env import hub_env

    values.repo_id(repo, flag)
    if revision is not None:
        values.revision(revision, flag)
    transport.install()  # (every request bounded in bytes and time, as every other Hub read)
    env = hub_env()
    where = f"{flag} {repo}:{path}"
    api = HfApi(endpoint=env.endpoint, token=env.token)
    info = with_retries(
        where, lambda: api.model_info(repo, revision=revision or "main", files_metadata=True), env.budget
    )
    remote = next((s for s in info.siblings or [] if s.rfilename == path), None)
    if remote is None or not info.sha:
        raise K3LabError(f"{where}: no such file at {revision or 'main'}")
    size = int(remote.size or 0)
    if size > limit:
        raise K3LabError(f"{where}: {size:,} bytes: larger than any {what} k3lab reads")
    found = RemoteFile(path, size, remote.lfs.sha256 if remote.lfs is not None else None, remote.blob_id)
    return PinnedFile(repo, path, info.sha, found, env.endpoint, env.token, env.budget, where)


def download(
    url: str,
    remote: RemoteFile,
    path: Path,
    token: str | None,
    where: str,
    report: TaskReport,
    closing: threading.Event,
    budget: float,
) -> str:
    """The rest of ``remote``'s bytes into ``path``, retried within ``budget`` (each attempt
    continues from the last byte that arrived); returns their hash in ``RemoteFile.oid``'s form.
    ``closing`` set (the source closes): the download stops at its next piece."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise HubError(f"{path}: is not a file k3lab downloaded; remove it")

    counted = _Closing(report, closing)

    def one() -> Any:
        if closing.is_set():
            raise Cancelled(f"{remote.name}: the source was closed")
        report.check()
        return transport.download(
            url,
            path,
            remote.size,
            token,
            where,
            counted,
            lambda: transport.file_hash(remote.sha256, remote.size),
        )

    # (each attempt continues from the last byte: what arrived is progress this download keeps)
    h = with_retries(where, one, budget, report, progress=lambda: counted.got)
    return h.hexdigest() if remote.sha256 else f"git-{h.hexdigest()}"


class _Closing(TaskReport):
    """A task's report that also stops the download when its source closes."""

    def __init__(self, report: TaskReport, closing: threading.Event):
        super().__init__(report.number, None, None)
        self.report, self.closing = report, closing
        self.got = 0  # bytes of this download that arrived, over every attempt

    def downloaded(self, n: int) -> None:
        self.got += n
        self.report.downloaded(n)
        if self.closing.is_set():
            raise Cancelled("the source was closed")


def read_fetched(path: Path) -> dict[str, str]:
    try:
        data = parse_json(read_bounded(path, 1 << 20, "k3lab's list of fetched files"), str(path))
    except (OSError, K3LabError):
        return {}
    return (
        {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(data, dict)
        else {}
    )


def write_fetched(path: Path, fetched: dict[str, str]) -> None:
    data = json.dumps(fetched, indent=1, sort_keys=True).encode()
    write_atomically(path, lambda fh: fh.write(data))
