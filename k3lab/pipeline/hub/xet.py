"""Uploads through Xet, the Hub's storage, held to the bounds every other transfer is held to.

huggingface_hub hands a Xet upload to ``hf_xet``, whose own Rust HTTP client talks to the CAS: none of
it passes k3lab's transport (``transport.install``), so nothing there counts, paces or stops it. k3lab
therefore drives hf_xet itself, through the session API hf_xet 1.8 gives Python, and holds the
transfer to the same guarantees from the outside:

- **Counted.** The commit's progress (``XetUploadCommit.progress``: file bytes taken in, bytes sent
  to the CAS, shard bytes) is read every ``POLL`` seconds and each new byte sent is reported to the
  run's bar (``TaskReport.uploaded``).
- **A minimum rate.** A window (``K3LAB_SPEED_LIMIT``) in which neither the file was read further
  nor bytes went out at the minimum rate ends the transfer (``XetStalled``): a trickling or silent
  CAS fails in one window, whatever hf_xet's own timeouts are.
- **Inside the retry budget.** hf_xet's own retries and timeouts are set (``xet_config``) so that
  one attempt stays well inside k3lab's budget; ``retry.with_retries`` spends the budget on the
  attempts, as for LFS.
- **Stopped.** The upload runs in hf_xet's threads while this one polls: Ctrl-C, SIGTERM (``Stopped``)
  or the run's cancel (``TaskReport.check``) aborts the commit (``XetUploadCommit.abort``) and shuts
  the session down (``sigint_abort``: each upload has its own), so nothing is sent after.
- **Its token fetched by k3lab.** hf_xet is never given the Hub's token URL (it would read the answer
  whole, with its own client): k3lab fetches the token through its bounded transport and seeds the
  commit with it, and hf_xet's refreshes go to a loopback route of k3lab's that fetches each the same
  way (``xet_token.TokenRoute``). No answer hf_xet gets from the Hub exceeds k3lab's bound.
- **Errors classified.** hf_xet raises ``RuntimeError``/``ConnectionError``/``OSError`` kinds; a
  refusal (its authentication error, a 401/403/404 it names) is one line, the rest transient.

Deduplication is hf_xet's: content-defined chunks (~64 KiB) already in the CAS, or in this machine's
shard cache (``HF_HOME/xet``), are not sent again, so republishing after one tensor changed sends
about the changed chunks.
"""

from __future__ import annotations

import datetime
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.pipeline.hub.bounds import SPEED_ENV, speed_limit
from k3lab.pipeline.hub.clock import CLOCK
from k3lab.pipeline.hub.xet_token import TokenRoute, XetToken, fetch_token
from k3lab.pipeline.progress import NO_REPORT, TaskReport

POLL = 0.1  # seconds between two looks at the transfer's progress (and at a stop)
ABORT_WAIT = 1.0  # seconds the waiting thread may take to see its aborted commit end
NEEDED = {"XetSession": ("new_upload_commit",), "XetUploadCommit": ("progress", "abort", "wait_to_finish")}


class XetStalled(ConnectionError):
    """A Xet transfer below the minimum rate for a whole window: transient (the budget rides it out)."""


class XetRefused(K3LabError):
    """The CAS refused (authentication, a 401/403/404): one line, not retried."""


def unusable() -> str | None:
    """Why uploads cannot go through Xet in this process, or None when they can: hf_xet not installed
    or turned off (``HF_HUB_DISABLE_XET``), or one without the session API k3lab watches it through."""
    from huggingface_hub.utils._runtime import is_xet_available

    if not is_xet_available():
        return "hf_xet is not installed or HF_HUB_DISABLE_XET is set"
    import hf_xet

    for cls, methods in NEEDED.items():
        kind = getattr(hf_xet, cls, None)
        if kind is None or not all(hasattr(kind, m) for m in methods):
            version = getattr(hf_xet, "__version__", "?")
            return f"hf_xet {version} lacks {cls}.{'/'.join(methods)}, which k3lab needs to bound its uploads"
    return None


def xet_config(budget: float) -> Any:
    """hf_xet's settings for one attempt of a k3lab upload: its read timeout one rate window (k3lab's
    watchdog cuts a stall at that too), its own retries few and short enough that an attempt ends
    well inside the retry budget (k3lab's budget counts the attempts), no telemetry sent."""
    import hf_xet

    _, window = speed_limit()
    seconds = datetime.timedelta
    inner = max(1.0, min(budget / 4, 120.0))  # hf_xet's own retrying, at most a quarter of the budget
    return hf_xet.XetConfig().with_config(
        {
            "client.connect_timeout": seconds(seconds=min(30.0, window)),
            "client.read_timeout": seconds(seconds=window),
            "client.retry_max_attempts": 3,
            "client.retry_base_delay": seconds(seconds=min(1.0, inner / 4)),
            "client.retry_max_duration": seconds(seconds=inner),
            "telemetry.enabled": False,
        }
    )


@dataclass
class Sent:
    """What one upload moved: file bytes taken in, chunk bytes and shard bytes sent to the CAS."""

    taken: int = 0
    chunks: int = 0
    shard: int = 0
    sha256: str = ""  # the file's, as hf_xet computed it (when it was not given)

    @property
    def sent(self) -> int:
        return self.chunks + self.shard


def _sent(progress: Any) -> Sent:
    shard = getattr(progress, "shard", None)
    return Sent(
        int(progress.total_bytes_completed or 0),
        int(progress.total_transfer_bytes_completed or 0),
        int(getattr(shard, "total_shard_bytes_upload_completed", 0) or 0) if shard is not None else 0,
    )


def send(
    path: Path,
    sha256: str,
    refresh_url: str,
    headers: dict[str, str],
    what: str,
    budget: float,
    report: TaskReport = NO_REPORT,
) -> Sent:
    """Upload one file to the CAS (no commit: the Hub's commit names it by ``sha256``). Raises
    ``XetStalled`` (a window below the minimum rate), ``XetRefused`` or hf_xet's transient error; a
    stop (``report.check``, ``Stopped``, Ctrl-C) aborts the transfer before it is raised again."""
    # hf_xet never fetches its token itself (its answer would be read unbounded): k3lab fetches it,
    # and each refresh, through its bounded transport (``xet_token``)
    token = fetch_token(
        refresh_url, headers, what, budget, retry=False
    )  # (this attempt: one of the budget's)
    extra = {k: v for k, v in headers.items() if k.lower() != "authorization"}  # (to every CAS request)
    with TokenRoute(refresh_url, headers, what, min(budget / 4, speed_limit()[1])) as route:
        return _send(path, sha256, token, route, extra, what, budget, report)


def _send(
    path: Path,
    sha256: str,
    token: XetToken,
    route: TokenRoute,
    extra: dict[str, str],
    what: str,
    budget: float,
    report: TaskReport,
) -> Sent:
    import hf_xet

    session = hf_xet.XetSession(xet_config(budget))
    commit = session.new_upload_commit(
        endpoint=token.cas_url,
        token=token.access,
        token_expiry_unix_secs=token.expires,
        token_refresh_url=route.url,
        token_refresh_headers=route.headers,
        custom_headers=extra,
    )
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            commit.wait_to_finish()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the polling thread)
            outcome.append(e)

    waiter = threading.Thread(target=wait, name=f"xet {path.name}", daemon=True)
    rate, window = speed_limit()
    reported, moved = Sent(), 0
    try:
        handle = commit.start_upload_file(str(path), sha256=sha256 or hf_xet.COMPUTE_SHA256)
        waiter.start()
        start, at_start = CLOCK.now(), 0
        while waiter.is_alive():
            waiter.join(POLL)
            now_sent = _sent(commit.progress())
            if now_sent.sent > reported.sent:
                report.uploaded(now_sent.sent - reported.sent)
            moved += max(0, now_sent.taken - reported.taken) + max(0, now_sent.sent - reported.sent)
            reported = now_sent
            report.check()
            now = CLOCK.now()
            if now - start >= window:
                if moved - at_start < rate * window:
                    raise XetStalled(
                        f"{what}: {moved - at_start} bytes moved in {now - start:.0f} s through Xet, "
                        f"below the minimum rate of {rate:.0f} bytes/s ({SPEED_ENV})"
                    )
                start, at_start = now, moved
    except BaseException:
        _abort(commit, session, waiter)
        raise
    error = outcome[0] if outcome else None
    if error is not None:
        raise classify(error, what) from None
    final = _sent(commit.progress())
    if final.sent > reported.sent:
        report.uploaded(final.sent - reported.sent)
    final.sha256 = sha256 or str(handle.result().xet_info.sha256)
    return final


def _abort(commit: Any, session: Any, waiter: threading.Thread) -> None:
    """End the transfer now: the commit aborted, then the whole session shut down (it is this upload's
    alone), so that no request of it is left running, nor waited for when the process exits."""
    for stop in (commit.abort, session.sigint_abort):
        try:
            stop()
        except Exception:  # noqa: BLE001 (already failed or finished: nothing left to stop)
            pass
    waiter.join(ABORT_WAIT)


# a refusal as hf_xet words it: an HTTP status it names (not digits inside a hash), or the status's name
REFUSED = re.compile(r"(?<![0-9a-fA-F])(?:401|403|404)(?![0-9a-fA-F])|Unauthorized|Forbidden|Not Found")


def classify(e: BaseException, what: str) -> BaseException:
    """hf_xet's error as k3lab's: a refusal is ``XetRefused`` (one line), anything else is kept as a
    ``ConnectionError`` (transient: the retry budget rides it out), its first line named."""
    import hf_xet

    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    refused_kinds = tuple(
        k
        for k in (
            getattr(hf_xet, "XetAuthenticationError", None),
            getattr(hf_xet, "XetObjectNotFoundError", None),
        )
        if k
    )
    if isinstance(e, refused_kinds) or REFUSED.search(text):
        return XetRefused(f"{what}: the Xet storage refused the upload: {text}")
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        return e
    return ConnectionError(f"{what}: Xet: {text}")
