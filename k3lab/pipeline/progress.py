"""What a task tells its run while it works, and how it hears that the run stopped.

A task (one output file, in this process, a ``--jobs`` worker or a Dask worker) gets a
``TaskReport``: it reports source bytes converted (``read``), bytes downloaded (``downloaded``) and
transient failures it rides out (``retried``), each as a small tuple handed to ``emit`` (a queue, a
pipe, Dask's event stream: the runner chooses). ``check()`` raises ``Cancelled`` once the run has
stopped (``stop`` says so: the client's Dask ``Event``, the folder's lock), so a task checks between
pieces and before it renames a finished file; the check is cheap (``stop`` is asked at most every
``CHECK_EVERY`` seconds, a final ``check(now=True)`` always asks).

On the run's side ``RunProgress`` folds every task's reports into one byte bar: source bytes
converted (total: the files to do), with the download's bytes, speed and retries shown beside it. A
task that starts a file again (a restarted Dask worker) takes back what it reported before, so the
count never passes its total.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm  # a widget bar in a notebook, a text bar on a terminal

from k3lab.util import si_bytes

CHECK_EVERY = 0.5  # seconds between two asks of ``stop`` (a Dask Event is a round trip)

Message = tuple  # ("start", number, who) | ("read", number, n) | ("down", number, n) | ("retry", number, text) | ("end", number, "")


class Cancelled(Exception):
    """The run this task belongs to has stopped (Ctrl-C, SIGTERM, its client gone): the task unwinds,
    removing what it was writing, and writes nothing more."""


class TaskReport:
    def __init__(
        self,
        number: int = 0,
        emit: Callable[[Message], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ):
        self.number, self.emit, self.stop = number, emit, stop
        self._asked = 0.0
        self.moved_bytes = 0  # bytes this task moved over the link so far, down and up (retries see progress)

    def _send(self, kind: str, value: Any) -> None:
        if self.emit is not None:
            self.emit((kind, self.number, value))

    def started(self, who: str) -> None:
        self._send("start", who)

    def ended(self) -> None:
        self._send("end", "")

    def read(self, n: int) -> None:
        self._send("read", n)
        self.check()

    def downloaded(self, n: int) -> None:
        self.moved_bytes += n
        self._send("down", n)
        self.check()

    def uploaded(self, n: int) -> None:
        self.moved_bytes += n
        self._send("up", n)
        self.check()

    def retried(self, text: str) -> None:
        self._send("retry", text)

    def check(self, now: bool = False) -> None:
        """Raise ``Cancelled`` if the run has stopped."""
        if self.stop is None:
            return
        t = time.monotonic()
        if now or t - self._asked >= CHECK_EVERY:
            self._asked = t
            if self.stop():
                raise Cancelled(f"output file {self.number}: the run stopped")


NO_REPORT = TaskReport()


class Stopped(BaseException):
    """SIGTERM (or the run's end) reached a process mid-conversion: unwind, removing .partial files."""


def stop_on_sigterm() -> None:
    """Turn SIGTERM into ``Stopped`` in the main thread, so that cleanup runs (a plain SIGTERM
    would end the process with its .partial files left)."""

    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)


def byte_bar(total: int, desc: str, disable: bool | None) -> Any:
    """A bar of bytes, as every k3lab bar is: SI units (tqdm scales a rate by 1000 whatever its
    ``unit_divisor``: the count beside it must agree), the rate and ETA over the whole run (not its
    last burst: a download before the first converted byte made an ETA of hours), cut to the
    terminal's width as it is now. ``disable``: None shows it on a terminal only."""
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        smoothing=0,
        desc=desc,
        disable=disable,
        dynamic_ncols=True,
    )


class RunProgress:
    """One byte bar for the whole run, fed with the tasks' messages (``take``)."""

    def __init__(self, bar: Any):
        self.bar = bar  # a tqdm (disabled when quiet)
        self.read: dict[int, int] = {}
        self.down = 0
        self.up = 0
        self.retries = 0
        self.last_retry = ""
        self._retried_at = 0.0
        self.running: dict[int, str] = {}  # number -> who converts it
        self.done: set[int] = set()
        self._t0 = time.monotonic()
        self._shown = 0.0

    def take(self, msg: Message) -> None:
        kind, number, value = msg
        if kind == "start":
            self.running[number] = value
            again = self.read.pop(number, 0)  # begun anew: what it reported before is redone
            if again:
                self.bar.update(-again)
        elif kind == "end":
            self.running.pop(number, None)
        elif kind == "read" and number not in self.done:
            self.read[number] = self.read.get(number, 0) + value
            self.bar.update(value)
        elif kind == "down":
            self.down += value
        elif kind == "up":
            self.up += value
        elif kind == "retry":
            self.retries += 1
            self.last_retry = str(value)
            self._retried_at = time.monotonic()
        self._postfix()

    def finished(self, number: int, nbytes: int) -> None:
        """File ``number`` is done: its whole ``nbytes`` count, whatever of its messages are still on
        their way (Dask delivers a task's events and its result by different routes)."""
        if number not in self.done:
            self.done.add(number)
            self.bar.update(nbytes - self.read.get(number, 0))
            self.read[number] = nbytes
        self._postfix(force=True)

    def _postfix(self, force: bool = False) -> None:
        """Beside the bar (source bytes converted): bytes down and up with their rates, and, while
        the Hub fails, for how long and how much of the budget is left (the last retry's words)."""
        t = time.monotonic()
        if not (self.down or self.up or self.retries) or (not force and t - self._shown < 0.5):
            return
        self._shown = t
        parts = []
        span = max(t - self._t0, 1e-6)
        if self.down:
            parts.append(f"down {si_bytes(self.down)} at {si_bytes(self.down / span)}/s")
        if self.up:
            parts.append(f"up {si_bytes(self.up)} at {si_bytes(self.up / span)}/s")
        if self.retries:
            outage = t - self._retried_at < 15 and "failing for" in self.last_retry
            parts.append(
                f"{self.retries} retries" + (f"; {self.last_retry.rsplit(': ', 1)[-1]}" if outage else "")
            )
        self.bar.set_postfix_str(", ".join(parts), refresh=False)
