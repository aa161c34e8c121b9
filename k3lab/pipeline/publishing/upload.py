"""Where a set is published (``PushTarget``), and one finished file's bytes sent to that repo's
storage (no commit), retried within the run's budget, with the file's SHA-256 handed over (made as the
file was written) and every byte sent reported to the run's bar. Two paths, as huggingface_hub has:

- **Xet** (hf_xet installed, as ``pip install huggingface_hub`` brings it on Linux): the Hub says the
  file goes to large-file storage (``/preupload``), then ``hub.xet.send`` moves it, watched, bounded and
  stoppable by k3lab (huggingface_hub's own Xet upload is none of these).
- **LFS** (``HF_HUB_DISABLE_XET=1``, or an hf_xet k3lab cannot watch: said in one line): huggingface_hub's
  ``preupload_lfs_files``, through k3lab's transport (``transport.install``), its reads counted here."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.pipeline.hub.retry import RETRY_BUDGET, current, fold_hf_logging, with_retries
from k3lab.pipeline.progress import NO_REPORT, TaskReport


@dataclass(frozen=True)
class PushTarget:
    """Where a set is published: plain values, sent to every worker that uploads."""

    repo: str
    branch: str = "main"
    private: bool = False
    keep_local: bool = False
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)
    retry_budget: float = RETRY_BUDGET

    def api(self) -> Any:
        from huggingface_hub import HfApi

        from k3lab.pipeline.hub import transport  # (here: a run that publishes nothing never imports it)

        transport.install()
        fold_hf_logging()
        return HfApi(endpoint=self.endpoint, token=self.token)

    def where(self, path: str = "") -> str:
        return f"{self.repo}@{self.branch}" + (f": {path}" if path else "")


def __getattr__(name: str) -> Any:
    """``_CountedAdd``, made when first asked (huggingface_hub is imported then, not at start-up), and
    found by name when an operation is unpickled on the client."""
    if name == "_CountedAdd":
        cls = globals().get("_CountedAdd") or _counted_class()
        globals()["_CountedAdd"] = cls
        return cls
    raise AttributeError(name)


def upload(
    target: PushTarget, path: Path, report: TaskReport = NO_REPORT, sha256: str = "", folder: str = ""
) -> Any:
    """Send one finished file's bytes to the repo's storage (no commit); returns the operation to
    commit (its SHA-256 in ``upload_info``). ``sha256``: the file's, made as it was written, so the
    upload is the only read of the finished file (huggingface_hub 2.4 hashes a file lazily, only when
    its ``UploadInfo.sha256`` is read unset: setting it first saves a whole read of 17 GB). The bytes
    sent are reported as they go. ``folder``: the repo's folder it goes to (a variant's), else the top."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # k3lab's one bar shows the run; huggingface_hub's would write over it
    api = target.api()
    op = _counted_add(path, report, f"{folder}/{path.name}" if folder else path.name)
    if sha256:
        op.upload_info.sha256 = bytes.fromhex(sha256)
    if xet_path():
        return _upload_xet(target, api, op, path, report)

    def send() -> None:
        report.check()
        current.report = report  # (huggingface_hub's retry lines fold into the report)
        try:
            api.preupload_lfs_files(target.repo, additions=[op], revision=target.branch, free_memory=True)
        finally:
            current.report = None

    with_retries(target.where(op.path_in_repo), send, target.retry_budget, report)
    report.check(now=True)
    return op


_said: list[str] = []


def xet_path() -> bool:
    """Whether this process uploads through Xet; when hf_xet is there but k3lab cannot watch it,
    huggingface_hub is told to use LFS instead, and that is said once, in one line."""
    from k3lab.pipeline.hub import xet

    why = xet.unusable()
    if why is None:
        return True
    from huggingface_hub import constants
    from huggingface_hub.utils._runtime import is_xet_available

    if is_xet_available():  # (installed, not turned off: huggingface_hub would take it unwatched)
        constants.HF_HUB_DISABLE_XET = True
        if not _said:
            _said.append(why)
            print(f"k3lab: uploads go by LFS, not Xet: {why}", flush=True)
    return False


def _upload_xet(target: PushTarget, api: Any, op: Any, path: Path, report: TaskReport) -> Any:
    """The Xet path: the Hub's upload mode for the file (``/preupload``), then the bytes through
    ``xet.send`` (a file the Hub keeps in git, not in large-file storage, is left to the commit)."""
    from huggingface_hub import constants
    from huggingface_hub._commit_api import _fetch_upload_modes
    from huggingface_hub.utils._xet import XetTokenType, xet_connection_info_refresh_url

    from k3lab.pipeline.hub import xet

    where = target.where(op.path_in_repo)
    headers = api._build_hf_headers(token=target.token)

    def mode() -> None:
        report.check()
        _fetch_upload_modes(
            additions=[op],
            repo_type=constants.REPO_TYPE_MODEL,
            repo_id=target.repo,
            headers=headers,
            revision=target.branch,
            endpoint=api.endpoint,
        )

    with_retries(where, mode, target.retry_budget, report)
    if op._upload_mode != "lfs" or op._should_ignore:
        return op
    refresh = xet_connection_info_refresh_url(
        token_type=XetTokenType.WRITE,
        repo_id=target.repo,
        repo_type=constants.REPO_TYPE_MODEL,
        revision=target.branch,
        endpoint=api.endpoint,
    )
    sha = op.upload_info.sha256.hex() if op.upload_info.is_hashed else ""

    def send() -> xet.Sent:
        report.check()
        return xet.send(path, sha, refresh, headers, where, target.retry_budget, report)

    sent = with_retries(where, send, target.retry_budget, report)
    if not sha:
        op.upload_info.sha256 = bytes.fromhex(sent.sha256)
    report.check(now=True)
    op._is_uploaded = True
    op.path_or_fileobj = b""  # (as huggingface_hub's free_memory: the client commits it by its SHA-256)
    return op


def _counted_add(path: Path, report: TaskReport, path_in_repo: str) -> Any:
    """huggingface_hub's ``CommitOperationAdd`` of ``path`` whose file object reports the bytes the
    upload reads (to the run's bar, and to the tests that count them)."""
    op = __getattr__("_CountedAdd")(path_in_repo, str(path))
    op.report = report
    return op


def _counted_class() -> type:
    import contextlib

    from huggingface_hub import CommitOperationAdd

    class CountedAdd(CommitOperationAdd):
        """(Sent back to the client from a worker without its report: a report holds locks.)"""

        report: TaskReport = NO_REPORT

        @contextlib.contextmanager
        def as_file(self, with_tqdm: bool = False) -> Any:
            with super().as_file(with_tqdm=False) as fh:
                yield _Reading(fh, self.report)

        def __getstate__(self) -> dict[str, Any]:
            return {k: v for k, v in self.__dict__.items() if k != "report"}

    CountedAdd.__qualname__ = CountedAdd.__name__ = "_CountedAdd"
    return CountedAdd


class _Reading(io.RawIOBase):
    """A binary file whose reads are reported as uploaded bytes (an ``io`` object, so that a retried
    PUT rewinds it: huggingface_hub's ``http_backoff`` seeks ``io.IOBase`` data back)."""

    def __init__(self, fh: Any, report: TaskReport):
        super().__init__()
        self.fh, self.report = fh, report

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.fh.readinto(buffer)
        if n:
            self.report.uploaded(n)
        return n or 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.fh.seek(offset, whence)

    def tell(self) -> int:
        return self.fh.tell()
