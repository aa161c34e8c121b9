"""The clock the Hub client waits by: how long the Hub has failed (the retry budget), how long a
transfer has trickled (the minimum rate), and the pauses between attempts. One object, so that a
test can run hours of outages in no time (``tests``: a clock that moves only when slept on)."""

from __future__ import annotations

import time


class Clock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


CLOCK = Clock()  # the one k3lab waits by (a test swaps its methods or passes its own)
