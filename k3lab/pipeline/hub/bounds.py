"""Every transfer bounded, both ways: an answer's body cut at its limit (after decoding: k3lab
decodes gzip and deflate itself, within the bound), an API answer's JSON shape checked before anything
parses it, and the minimum rate held over a window on answers (``WatchedBody``) and on request
bodies (``PacedStream``, on the client's connections: an upload to a trickling uplink fails in one
window). ``transport`` puts them on huggingface_hub's client."""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterator
from typing import Any

import httpx2

from k3lab.errors import K3LabError
from k3lab.pipeline.hub.clock import CLOCK

SPEED_ENV = "K3LAB_SPEED_LIMIT"
SPEED_LIMIT, SPEED_TIME = 16 * 1024, 60.0  # below 16 KiB/s for a minute: a stalled transfer
TIMEOUTS = {"connect": 30.0, "read": 60.0, "write": 60.0, "pool": 60.0}  # where a request sets none
API_LIMIT = 16 << 20  # the Hub's JSON answers, decoded (a repo's file list: tens of KB for Kimi-K3)
# and their shape, checked before huggingface_hub parses them (Kimi-K3's listing: ~200 objects)
API_ITEMS, API_OBJECTS = 1_000_000, 100_000
DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
ERROR_LIMIT = 1 << 20  # an error answer's body


class TooSlow(httpx2.ReadTimeout):
    """A transfer below the minimum rate for a whole window: a timeout (the retry budget rides it out)."""


class WrongAnswer(K3LabError):
    """The server answered with something other than what was asked (more bytes than asked, a web
    page for a file, another range): one line, not retried."""


def speed_limit() -> tuple[float, float]:
    """(bytes per second, seconds): ``K3LAB_SPEED_LIMIT=BYTES/SECONDS`` or the default."""
    value = os.environ.get(SPEED_ENV, "").strip()
    if not value:
        return float(SPEED_LIMIT), SPEED_TIME
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)/([0-9]+(?:\.[0-9]+)?)", value)
    if not m or float(m[2]) <= 0:
        raise K3LabError(f"{SPEED_ENV}={value!r}: give BYTES/SECONDS, e.g. 16384/60")
    return float(m[1]), float(m[2])


def progress_that_counts() -> int:
    """Bytes a transfer must bring to count as progress (a window's worth at the minimum rate): a
    trickle never does, so it never starts the retry budget's clock again."""
    rate, window = speed_limit()
    return max(1, int(rate * window))


class WatchedBody(httpx2.SyncByteStream):
    """An answer's body, cut at ``limit`` bytes and failed when slower than the minimum rate. An API
    answer is decoded here (``wbits``), its decoded bytes bounded as they come (a gzip bomb ends at
    the limit, never after), and a JSON one held whole (``hold``) until its shape is checked."""

    def __init__(self, inner: Any, limit: int | None, url: str, hold: bool = False, wbits: int | None = None):
        self.inner, self.limit, self.url, self.hold = inner, limit, url, hold
        self.decoder = zlib.decompressobj(wbits) if wbits is not None else None
        self.rate, self.window = speed_limit()

    def __iter__(self) -> Iterator[bytes]:
        if not self.hold:
            yield from self._bounded(self._decoded())
            return
        body = b"".join(self._bounded(self._decoded()))
        check_shape(body, self.url)
        yield body

    def _decoded(self) -> Iterator[bytes]:
        if self.decoder is None:
            yield from self.inner
            return
        room = (self.limit or API_LIMIT) + 1
        for chunk in self.inner:
            data = chunk
            while data:
                out = self.decoder.decompress(data, room)
                room -= len(out)
                if room <= 0:
                    raise WrongAnswer(f"{self.url}: the answer decodes to more than {self.limit} bytes")
                yield out
                data = self.decoder.unconsumed_tail
        yield self.decoder.flush()

    def _bounded(self, chunks: Any) -> Iterator[bytes]:
        total = 0
        start, at_start = CLOCK.now(), 0
        for chunk in chunks:
            total += len(chunk)
            if self.limit is not None and total > self.limit:
                raise WrongAnswer(f"{self.url}: the answer is longer than the {self.limit} bytes it may be")
            now = CLOCK.now()
            if now - start >= self.window:
                if total - at_start < self.rate * self.window:
                    raise TooSlow(
                        f"{self.url}: {total - at_start} bytes in {now - start:.0f} s, below the minimum "
                        f"rate of {self.rate:.0f} bytes/s ({SPEED_ENV})"
                    )
                start, at_start = now, total
            yield chunk

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def check_shape(body: bytes, url: str) -> None:
    """An API answer's JSON bounded in depth, values and objects before anything parses it."""
    from k3lab.formats.files import MAX_DEPTH, json_shape

    depth, commas, objects = json_shape(body)
    if depth > MAX_DEPTH or commas >= API_ITEMS or objects > API_OBJECTS:
        raise WrongAnswer(
            f"{url}: an answer of {commas + 1} values and {objects} objects nested {depth} deep; "
            f"k3lab reads at most {API_ITEMS}, {API_OBJECTS} and {MAX_DEPTH}"
        )


class TooSlowUp(httpx2.TransportError):
    """A request body (an upload) sent below the minimum rate for a whole window. Not one of httpx's
    timeouts on purpose: huggingface_hub retries those itself (five times, ~23 s of waits, outside any
    budget); k3lab's retry budget rides this one out (``retry.is_transient``)."""


class NoAnswer(httpx2.TransportError):
    """An upload whose body went out (into the socket's buffers) but whose answer did not come in the
    time the minimum rate allows for the bytes the buffers may still hold, plus a window."""


IN_FLIGHT = (
    16 << 20
)  # bytes an upload may have in the kernel's buffers (send and receive) when the last write returns


def answer_wait(body_bytes: int) -> float:
    """Seconds an upload of ``body_bytes`` may wait for its answer after its last write: the bytes the
    buffers may hold, taken at the minimum rate, and one window (the server's own work)."""
    rate, window = speed_limit()
    return window + min(body_bytes, IN_FLIGHT) / rate


class PacedStream:
    """A connection whose writes (request bodies: uploads) are held to the minimum rate, as
    ``_Watched`` holds answers: the socket's wait is cut at the end of each window, and a window
    that carried less than the rate's worth fails with ``TooSlowUp``. A trickling uplink then ends a
    PUT in bounded time (a plain write waits as long as any byte still moves). Only time spent
    writing counts: a connection idle between requests is never slow. Reads go to the stream it wraps."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.rate, self.window = speed_limit()
        self.spent, self.sent = 0.0, 0  # writing time and bytes of the current window

    def write(self, buffer: bytes, timeout: float | None = None) -> None:

        # only a stream that writes to its socket itself (plain TCP, or TLS on it): a proxy's TLS in
        # TLS writes through another TLS layer, which its socket would bypass
        kind = type(self.inner)  # (httpx2's own plain stream, known by name: httpcore2 is httpx2's to import)
        plain = (kind.__module__, kind.__name__) == ("httpcore2._backends.sync", "SyncStream")
        sock = self.inner.get_extra_info("socket") if plain else None
        if sock is None:
            return self.inner.write(buffer, timeout)
        view = memoryview(buffer)
        while view:
            left = self.window - self.spent
            start = CLOCK.now()
            try:
                sock.settimeout(max(0.05, min(left, timeout if timeout is not None else left)))
                n = sock.send(view)
            except (TimeoutError, BlockingIOError):
                n = 0
                if timeout is not None and CLOCK.now() - start >= timeout and timeout < left:
                    raise httpx2.WriteTimeout(f"no byte sent in {timeout:.0f} s") from None
            except OSError as e:
                raise httpx2.WriteError(str(e)) from None
            view = view[n:]
            self.spent += CLOCK.now() - start
            self.sent += n
            if self.spent >= self.window:
                if self.sent < self.rate * self.window:
                    raise TooSlowUp(
                        f"{self.sent} bytes sent in {self.spent:.0f} s, below the minimum rate of "
                        f"{self.rate:.0f} bytes/s ({SPEED_ENV})"
                    )
                self.spent, self.sent = 0.0, 0

    def start_tls(self, *args: Any, **kwargs: Any) -> Any:
        return PacedStream(self.inner.start_tls(*args, **kwargs))  # (the Hub's HTTPS: paced too)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class PacedBackend:
    """The network backend of huggingface_hub's client, its connections' writes paced."""

    def __init__(self, inner: Any):
        self.inner = inner

    def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        return PacedStream(self.inner.connect_tcp(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def pace_uploads(transport: Any) -> bool:
    """Give the transport's connections paced writes (``PacedStream``); whether it could (an HTTP
    transport whose connection pool has a network backend: httpx2's own)."""
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if backend is None:
        return False
    if not isinstance(backend, PacedBackend):
        pool._network_backend = PacedBackend(backend)
    return True
