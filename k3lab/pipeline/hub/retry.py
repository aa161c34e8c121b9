"""Riding out the Hub's bad moments: which failures are transient (refused or reset connections,
timeouts, 408/429/5xx, "the Hub cannot be reached", Xet's network errors) and which are refusals
(401/403/404), and ``with_retries``: backoff within a time budget, the clock started again whenever
an attempt brought real progress. huggingface_hub's own retry warnings (its uploads and commits)
are folded into the task's report here too, so the run shows one bar."""

from __future__ import annotations

import logging
import math
import random
import re
import threading
from collections.abc import Callable
from typing import Any

from k3lab.errors import K3LabError, MachineError
from k3lab.pipeline.hub.clock import CLOCK, Clock
from k3lab.pipeline.progress import NO_REPORT, Cancelled, TaskReport

RETRY_BUDGET = 900.0  # seconds the Hub may keep failing (in a row) before a file is given up
MAX_DELAY = 10.0  # the longest pause between two attempts (each also holds huggingface_hub's own retries)


class HubError(K3LabError):
    """The Hub refused (401/403/404), or served other bytes than it lists: one line, exit 2."""


class HubUnreachable(MachineError):
    """The Hub kept failing for the whole retry budget: one line, exit 1; run again to resume."""


# --- failures: which to ride out -----------------------------------------------------------------------


def _status(e: BaseException) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def is_transient(e: BaseException) -> bool:
    """Whether trying again later may succeed: the network or the Hub's load, not the request. An
    error huggingface_hub wraps (an upload's ``RuntimeError("Error while uploading ...")``) is
    judged by what it wraps."""
    seen = 0
    while e.__cause__ is not None and seen < 8 and not _status(e):
        if _one_transient(e):
            return True
        e, seen = e.__cause__, seen + 1
    return _one_transient(e)


def _one_transient(e: BaseException) -> bool:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if isinstance(e, LocalEntryNotFoundError):  # "cannot reach the Hub and no local copy"
        return True
    status = _status(e)
    if isinstance(e, HfHubHTTPError) and status is not None:
        return status in (408, 429) or status >= 500
    # hf_xet (Xet storage) reports a refusal as a ConnectionError naming the HTTP status
    refused = re.search(r"status client error \((\d{3})", str(e))
    if refused and int(refused[1]) not in (408, 429):
        return False
    if isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)):
        return True
    return isinstance(e, OSError) and "Consistency check failed" in str(e)  # a transfer cut short


NEVER_THERE = re.compile(
    r"Name or service not known|Temporary failure in name resolution|nodename nor servname|"
    r"getaddrinfo failed|No address associated with hostname|Connection refused|Errno 111\b"
)


def never_reached(e: BaseException) -> bool:
    """A failure to find or reach a host that has not answered this process once: a misspelt
    endpoint, no network, nothing listening. Not worth a budget of retries: said at once."""
    from k3lab.pipeline.hub.transport import ANSWERED

    chain, seen = [e], 0
    while chain[-1].__cause__ is not None and seen < 8:
        chain.append(chain[-1].__cause__)
        seen += 1
    if not any(NEVER_THERE.search(str(x)[:2000]) for x in chain):
        return False
    request = getattr(e, "request", None)
    host = getattr(getattr(request, "url", None), "host", None) if request is not None else None
    return not ANSWERED if host is None else host not in ANSWERED


def _is_http(e: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(e, HfHubHTTPError)


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    status = _status(e)
    reason = text[0] if text else type(e).__name__
    cause = e.__cause__
    if status is None and cause is not None and isinstance(e, RuntimeError):  # (huggingface_hub's wrapper
        reason = f"{reason.rstrip('.')}: {_reason(cause)}"  # of an upload's error: say what it wraps)
    return f"{status} {reason}" if status and str(status) not in reason else reason


def _retry_after(e: BaseException) -> float | None:
    response = getattr(e, "response", None)
    value = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def with_retries(
    what: str,
    fn: Any,
    budget: float = RETRY_BUDGET,
    report: TaskReport = NO_REPORT,
    base_delay: float = 0.5,
    clock: Clock | None = None,
    progress: Callable[[], int] | None = None,
) -> Any:
    """fn() until it succeeds, riding out transient failures for up to ``budget`` seconds in a row
    (counted from the start of the first attempt that failed: the retries huggingface_hub makes
    inside one are in the budget too); refusals are one line. ``progress()``: the bytes this very
    transfer has got further (a download's, kept across attempts); the clock starts again when an
    attempt brought a window's worth of them at the minimum rate (``transport.progress_that_counts``),
    never for a trickle. None: nothing carries over between attempts (an upload starts again), so
    nothing else moving in the same task (a prefetch downloading fine) restarts the clock."""
    from k3lab.pipeline.hub.transport import progress_that_counts

    clock = clock or CLOCK
    if not (budget >= 0 and math.isfinite(budget)):
        raise K3LabError(f"retry budget {budget!r}: give a number of seconds, 0 or more")
    counts = progress_that_counts()
    moved = progress or (lambda: 0)
    first_failure: float | None = None
    attempt, seen = 0, moved()
    while True:
        started = clock.now()
        try:
            return fn()
        except (Cancelled, K3LabError):
            raise
        except Exception as e:
            if never_reached(e):
                raise HubUnreachable(
                    f"{what}: no Hub reachable ({_reason(e)[:160]}); check the network and HF_ENDPOINT"
                ) from None
            if not is_transient(e):
                if isinstance(e, OSError) and _status(e) is None and not _is_http(e):
                    raise MachineError(f"{what}: {_reason(e)}") from None  # the machine's: a disk, a folder
                raise HubError(f"{what}: {_reason(e)}") from None
            now = clock.now()
            if moved() - seen >= counts:  # it got further this time: a new run of failures from now
                first_failure, attempt, started = None, 0, now
            seen = moved()
            first_failure = first_failure if first_failure is not None else started
            if now - first_failure >= budget:
                raise HubUnreachable(
                    f"{what}: the Hub kept failing for {now - first_failure:.0f} s (retry budget "
                    f"{budget:.0f} s; last: {_reason(e)}); finished files are kept: run the command again"
                ) from None
            delay = min(MAX_DELAY, base_delay * 2**attempt) * random.uniform(0.8, 1.2)
            delay = max(delay, min(_retry_after(e) or 0.0, MAX_DELAY * 4))
            delay = min(delay, max(0.1, budget - (now - first_failure)))
            report.retried(
                f"{what}: {_reason(e)}: the Hub failing for {now - first_failure:.0f} s, "
                f"{budget - (now - first_failure):.0f} s of the budget left"
            )
            attempt += 1
            end = clock.now() + delay
            while (left := end - clock.now()) > 0:
                report.check()
                clock.sleep(min(left, 0.25))


# --- huggingface_hub's own output, folded into the task's report ------------------------------------

current = threading.local()  # the report of the download running in this thread


class _Folded(logging.Filter):
    """huggingface_hub's retry warnings ("Retrying in 1s", "Trying to resume") are k3lab's to count
    and say: a retry in the report of the transfer that raised them, never a line on the terminal
    (k3lab's own retries, and the budget, are in the one bar); errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True
        report = getattr(current, "report", None)
        if report is not None and record.levelno == logging.WARNING:
            report.retried(record.getMessage().splitlines()[0])
        return False


_FOLDED = _Folded()


def fold_hf_logging() -> None:
    for name in ("huggingface_hub.file_download", "huggingface_hub.utils._http", "huggingface_hub.lfs"):
        logger = logging.getLogger(name)
        if _FOLDED not in logger.filters:
            logger.addFilter(_FOLDED)
