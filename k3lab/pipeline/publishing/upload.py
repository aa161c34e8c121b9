"""Where a set is published (``PushTarget``), and one finished file's bytes sent to that repo's LFS
storage (no commit): huggingface_hub's ``preupload_lfs_files``, retried within the run's budget, with
the file's SHA-256 handed over (made as the file was written) and every byte it reads reported to the
run's bar."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.pipeline.hub import transport
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


def upload(target: PushTarget, path: Path, report: TaskReport = NO_REPORT, sha256: str = "") -> Any:
    """Send one finished file's bytes to the repo's LFS storage (no commit); returns the operation
    to commit (its SHA-256 in ``upload_info``). ``sha256``: the file's, made as it was written, so
    the upload is the only read of the finished file: huggingface_hub 2.4 hashes a file lazily,
    only when its ``UploadInfo.sha256`` is read unset (``huggingface_hub/lfs.py``, ``UploadInfo``),
    so setting it first saves a whole read of 17 GB. The bytes sent are reported as they go."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # k3lab's one bar shows the run; huggingface_hub's would write over it
    api = target.api()
    op = _counted_add(path, report)
    if sha256:
        op.upload_info.sha256 = bytes.fromhex(sha256)

    def send() -> None:
        report.check()
        current.report = report  # (huggingface_hub's retry lines fold into the report)
        try:
            api.preupload_lfs_files(target.repo, additions=[op], revision=target.branch, free_memory=True)
        finally:
            current.report = None

    with_retries(target.where(path.name), send, target.retry_budget, report)
    report.check(now=True)
    return op


def _counted_add(path: Path, report: TaskReport) -> Any:
    """huggingface_hub's ``CommitOperationAdd`` of ``path`` whose file object reports the bytes the
    upload reads (to the run's bar, and to the tests that count them)."""
    op = __getattr__("_CountedAdd")(path.name, str(path))
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
