"""Which Hub failures are ridden out and for how long: the classification against huggingface_hub's
and httpx's own exception types, and the time budget of ``with_retries``."""

from __future__ import annotations

import math

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from k3lab.errors import K3LabError
from k3lab.pipeline.hub.clock import Clock
from k3lab.pipeline.hub.retry import HubError, HubUnreachable, is_transient, with_retries
from k3lab.pipeline.hub.transport import TooSlow, progress_that_counts
from k3lab.pipeline.progress import TaskReport


def _http(status: int, headers: dict[str, str] | None = None) -> HfHubHTTPError:
    response = httpx2.Response(status, headers=headers, request=httpx2.Request("GET", "http://hub.test/x"))
    return HfHubHTTPError(f"{status} from the Hub", response=response)


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (httpx2.ConnectError("refused"), True),
        (httpx2.ReadTimeout("slow"), True),
        (httpx2.RemoteProtocolError("reset"), True),
        (TooSlow("a trickle"), True),
        (LocalEntryNotFoundError("cannot find the requested files in the local cache"), True),
        (_http(500), True),
        (_http(503), True),
        (_http(429), True),
        (_http(408), True),
        (OSError("Consistency check failed: file should be of size 10 but has size 5"), True),
        (ConnectionError("Network error: Request error: HTTP status server error (502 Bad Gateway)"), True),
        (_http(401), False),
        (_http(403), False),
        (_http(404), False),
        (
            ConnectionError(
                "Network error: Request error: HTTP status client error (404 Not Found), domain: x"
            ),
            False,
        ),
        (ValueError("a bug"), False),
    ],
)
def test_what_is_transient(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def test_a_refusal_is_one_line_at_once() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        raise _http(404)

    with pytest.raises(HubError, match=r"^repo@main: file: 404 from the Hub$"):
        with_retries("repo@main: file", fn, budget=60)
    assert len(calls) == 1


class FakeClock(Clock):
    """A clock that moves only when slept on (or told to): an outage of any length takes no time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_the_budget_gives_up_with_exit_1_and_progress_starts_its_clock_again() -> None:
    clock = FakeClock()
    with pytest.raises(
        HubUnreachable, match=r"kept failing for \d+ s \(retry budget 900 s; last: refused\)"
    ) as e:
        with_retries(
            "f", lambda: (_ for _ in ()).throw(httpx2.ConnectError("refused")), budget=900, clock=clock
        )
    assert 900 <= clock.t - 1000 < 920 and e.value.exit_code == 1  # 15 minutes of outage, in no time
    # a failure after real progress (a window's worth of bytes at the minimum rate) is a new run of
    # failures: 5 failures 300 s apart pass a 600 s budget
    got = [0]  # the transfer's own bytes (a download keeps them across attempts)
    attempts = []

    def flaky(step: int) -> str:
        attempts.append(1)
        if len(attempts) <= 5:
            got[0] += step  # it got further each time
            clock.sleep(300)
            raise httpx2.ReadTimeout("cut")
        return "done"

    progress = lambda: got[0]  # noqa: E731
    assert (
        with_retries("f", lambda: flaky(progress_that_counts()), budget=600, clock=clock, progress=progress)
        == "done"
    )
    # a trickle (a byte per attempt) is no progress: the budget runs out all the same
    attempts.clear()
    with pytest.raises(HubUnreachable, match="retry budget 600 s; last: cut"):
        with_retries("f", lambda: flaky(1), budget=600, clock=clock, progress=progress)
    assert len(attempts) <= 3


def test_what_else_a_task_moves_never_restarts_an_uploads_clock() -> None:
    """A dead uplink while the task's prefetch downloads fine: the upload (no progress of its own,
    each attempt starts again) gives up within its budget, counted from its first failed attempt
    (huggingface_hub's own retries inside it included)."""
    clock, report = FakeClock(), TaskReport()

    def put() -> None:
        report.downloaded(1 << 30)  # the prefetch of the next file, at full speed meanwhile
        clock.sleep(40)  # huggingface_hub retrying the PUT inside this attempt
        raise httpx2.WriteError("connection reset by peer")

    with pytest.raises(HubUnreachable, match="retry budget 100 s"):
        with_retries("f.gguf", put, budget=100, report=report, clock=clock)
    assert clock.t - 1000 <= 100 + 40 + 10


@pytest.mark.parametrize("budget", [math.nan, math.inf, -1.0])
def test_a_budget_that_never_runs_out_is_refused(budget: float) -> None:
    with pytest.raises(K3LabError, match="retry budget"):
        with_retries("f", lambda: "ok", budget=budget)


def test_a_zero_budget_means_no_retry() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        raise httpx2.ConnectError("refused")

    with pytest.raises(HubUnreachable):
        with_retries("f", fn, budget=0)
    assert len(calls) == 1


def test_retry_after_is_honoured() -> None:
    answers = [_http(429, {"Retry-After": "1"})]

    def fn() -> str:
        if answers:
            raise answers.pop()
        return "ok"

    clock = FakeClock()
    assert with_retries("f", fn, budget=60, base_delay=0.01, clock=clock) == "ok"
    assert clock.t - 1000 >= 1.0
