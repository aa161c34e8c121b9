"""The Hub over HTTP, bounded in bytes and in time: every request k3lab or huggingface_hub makes.

- **Time.** huggingface_hub's shared client makes some requests with no timeout at all
  (``model_info``: a server that accepts and never answers hangs the run). ``install`` gives it a
  transport that fills in a timeout wherever a request has none (``TIMEOUTS``) and watches every
  answer's body (``bounds.WatchedBody``): a transfer slower than a minimum rate over a window (curl's ``--speed-limit``
  and ``--speed-time``: ``SPEED_LIMIT`` bytes/s over ``SPEED_TIME`` s, or ``K3LAB_SPEED_LIMIT=
  BYTES/SECONDS``) fails with ``TooSlow``, a timeout: a trickling server ends a transfer in bounded
  time, and ``retry.with_retries`` spends the retry budget on it like any outage.
- **Uploads.** A request body is held to the same minimum rate (``bounds.PacedStream``, on the client's
  connections): a PUT to an uplink that trickles fails with ``TooSlowUp`` in bounded time. A body the
  socket's buffers take whole (a small file) has its answer's wait bounded instead (``NoAnswer``,
  ``bounds.answer_wait``): a server that reads it too slowly fails in a window plus the time the
  buffered bytes need at the minimum rate. Neither is a timeout huggingface_hub retries by itself: the
  retry budget covers a dead uplink as it covers a dead downlink, counting every attempt.
- **Bytes.** A body longer than its ``Content-Length``, an API answer over ``API_LIMIT`` and a
  ranged answer longer than the range asked for are cut and refused (``WrongAnswer``), as is an
  answer of the wrong kind (a web page where a file was asked, a range the server did not give).
  These are the server's fault, not the network's: one line, no retries.

``fetch_range`` reads one byte range of a file at a commit (a shard's header, a tensor); ``download``
fetches a whole file into a path k3lab owns, resuming from the bytes already there (across
attempts and across runs) and hashing as the bytes arrive, so the finished file is never read back
to be checked.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2

from k3lab.errors import MachineError
from k3lab.pipeline.hub.bounds import (  # (re-exported: what a transfer may raise, and its limits)
    API_LIMIT,
    DECODERS,
    ERROR_LIMIT,
    SPEED_ENV,
    TIMEOUTS,
    NoAnswer,
    TooSlow,
    TooSlowUp,
    WatchedBody,
    WrongAnswer,
    answer_wait,
    pace_uploads,
    progress_that_counts,
    speed_limit,
)

__all__ = [  # what callers take from here (the bounds live in ``bounds``)
    "SPEED_ENV",
    "TooSlow",
    "TooSlowUp",
    "WrongAnswer",
    "download",
    "fetch_range",
    "file_hash",
    "file_url",
    "install",
    "progress_that_counts",
    "speed_limit",
]
from k3lab.pipeline.progress import NO_REPORT, TaskReport

CHUNK = 1 << 20


ANSWERED: set[str] = (
    set()
)  # the hosts that have answered this process (a failure to reach one since: the network's)


class BoundedTransport(httpx2.BaseTransport):
    """huggingface_hub's transport with a timeout on every request and every body watched."""

    def __init__(self, inner: httpx2.BaseTransport | None = None):
        self.inner = inner or httpx2.HTTPTransport()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        timeout = dict(request.extensions.get("timeout") or {})
        for key, value in TIMEOUTS.items():
            if timeout.get(key) is None:
                timeout[key] = value
        body = _upload_bytes(request)
        if body:  # (the socket may take a small body whole: the answer's wait holds the rate instead)
            timeout["read"] = min(timeout["read"], answer_wait(body))
        request.extensions = {**request.extensions, "timeout": timeout}
        try:
            response = self.inner.handle_request(request)
        except httpx2.ReadTimeout:
            if not body:
                raise
            raise NoAnswer(
                f"{request.url.copy_with(query=None)}: {body} bytes sent, no answer in "
                f"{timeout['read']:.0f} s (below the minimum rate, {SPEED_ENV})"
            ) from None
        ANSWERED.add(request.url.host)
        url = str(request.url.copy_with(query=None))
        api = "/api/" in request.url.path
        limit = _length(response)
        wbits = None
        if api:  # decoded here, within the bound (huggingface_hub would decode it whole)
            limit = API_LIMIT if limit is None else min(limit, API_LIMIT)
            encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
            if encoding not in ("identity", "", *DECODERS):
                response.close()
                raise WrongAnswer(
                    f"{url}: the answer is encoded as {encoding!r}, which k3lab does not decode"
                )
            if encoding in DECODERS:
                wbits = DECODERS[encoding]
                del response.headers["Content-Encoding"]
        if response.status_code >= 400:  # an error's text: read whole by huggingface_hub to raise it
            limit = min(limit if limit is not None else ERROR_LIMIT, ERROR_LIMIT)
        json_answer = "json" in response.headers.get("Content-Type", "") and response.status_code < 400
        response.stream = WatchedBody(response.stream, limit, url, api and json_answer, wbits)
        return response

    def close(self) -> None:
        self.inner.close()


def _upload_bytes(request: httpx2.Request) -> int:
    """The body's size of an upload (a PUT, or a POST of file bytes, not an API call), else 0."""
    if request.method not in ("PUT", "POST") or "/api/" in request.url.path:
        return 0
    try:
        return max(0, int(request.headers.get("Content-Length", "0")))
    except ValueError:
        return 0


def _length(response: httpx2.Response) -> int | None:
    value = response.headers.get("Content-Length")
    if value is None or response.headers.get("Content-Encoding"):
        return None  # (a compressed body's length is not the decoded one's)
    try:
        return int(value)
    except ValueError:
        return None


_installed = threading.Lock()
_done = False


def install() -> None:
    """Give huggingface_hub's shared client the bounded transport (once per process)."""
    global _done
    if _done:
        return
    with _installed:
        if _done:
            return
        from huggingface_hub.utils import _http, set_client_factory

        def factory() -> httpx2.Client:
            client = _http.default_client_factory()
            pace_uploads(client._transport)
            client._transport = BoundedTransport(client._transport)
            return client

        set_client_factory(factory)
        _done = True


# --- reading a file of a commit ---------------------------------------------------------------------


def file_url(repo: str, file: str, commit: str, endpoint: str | None) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo, file, revision=commit, endpoint=endpoint)


def _headers(token: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**_hf_headers(token), **(extra or {})}


@functools.lru_cache(maxsize=4)
def _hf_headers(token: str | None) -> dict[str, str]:
    """huggingface_hub's headers (user agent, authorization): built once per token (a view makes
    hundreds of ranged reads)."""
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(token=token)


def _check_kind(response: httpx2.Response, what: str) -> None:
    kind = response.headers.get("Content-Type", "")
    if kind.split(";")[0].strip().lower() in ("text/html", "application/xhtml+xml"):
        raise WrongAnswer(f"{what}: the Hub answered with a web page ({kind}), not the file's bytes")


def _content_range(response: httpx2.Response, what: str) -> tuple[int, int, int | None]:
    """(first, last, total) of a 206 answer's ``Content-Range``."""
    value = response.headers.get("Content-Range", "")
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", value.strip())
    if not m:
        raise WrongAnswer(f"{what}: a partial answer without a valid Content-Range ({value!r})")
    return int(m[1]), int(m[2]), None if m[3] == "*" else int(m[3])


def fetch_range(
    url: str, start: int, stop: int, size: int, token: str | None, what: str, into: bytearray | None = None
) -> bytes:
    """Bytes ``[start, stop)`` of a file of ``size`` bytes: exactly those, or an error. The answer
    must be that range (206 and its ``Content-Range``; or, for the whole file, 200 with ``size``
    bytes); a longer or other answer is ``WrongAnswer``, a shorter one a transient error."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    if not 0 <= start <= stop <= size:
        raise WrongAnswer(f"{what}: bytes [{start}, {stop}) are not within its {size} bytes")
    want = stop - start
    if want == 0:
        return b""
    out = into if into is not None else bytearray()
    base = len(out)
    headers = _headers(token, {"Range": f"bytes={start}-{stop - 1}", "Accept-Encoding": "identity"})
    with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r:
        hf_raise_for_status(r)
        _check_kind(r, what)
        if r.status_code == 206:
            first, last, total = _content_range(r, what)
            if (first, last) != (start, stop - 1) or (total is not None and total != size):
                raise WrongAnswer(
                    f"{what}: asked for bytes {start}-{stop - 1} of {size}, the Hub answered "
                    f"{first}-{last} of {total}"
                )
        elif r.status_code != 200 or start != 0 or stop != size:
            raise WrongAnswer(
                f"{what}: asked for bytes {start}-{stop - 1} of {size}, the Hub answered {r.status_code} "
                "without that range"
            )
        for chunk in r.iter_raw():
            if len(out) - base + len(chunk) > want:
                raise WrongAnswer(f"{what}: the Hub sent more than the {want} bytes asked for")
            out += chunk
    if len(out) - base != want:
        raise httpx2.RemoteProtocolError(f"{what}: {len(out) - base} of {want} bytes arrived")
    return bytes(out[base:]) if into is None else b""


def file_hash(sha256: str | None, size: int) -> Any:
    """The hash the Hub identifies a file by: SHA-256 (LFS), or git's blob id (small files)."""
    if sha256:
        return hashlib.sha256()
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % size)
    return h


def download(
    url: str,
    path: Path,
    size: int,
    token: str | None,
    what: str,
    report: TaskReport = NO_REPORT,
    hashed: Callable[[], Any] | None = None,
) -> Any:
    """Fetch the rest of a file into ``path`` (a file k3lab owns: never a symlink), from the bytes
    already there: a cut transfer continues where it stopped, across attempts and across runs.
    Returns the hash (``hashed()``, e.g. ``file_hash``) of the whole file, fed as the bytes arrive
    (the bytes already on disk are hashed once, from there). A full disk is one line, exit 1."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        h = hashed() if hashed is not None else None
        have = 0
        while chunk := os.read(fd, CHUNK):
            if h is not None:
                h.update(chunk)
            have += len(chunk)
        if have > size:  # not this file's beginning: start again
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            have, h = 0, hashed() if hashed is not None else None
        if have == size:
            return h
        headers = _headers(token, {"Range": f"bytes={have}-{size - 1}", "Accept-Encoding": "identity"})
        with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r:
            hf_raise_for_status(r)
            _check_kind(r, what)
            if r.status_code == 206:
                first, _, total = _content_range(r, what)
                if first != have or (total is not None and total != size):
                    raise WrongAnswer(
                        f"{what}: asked for bytes from {have} of {size}, the Hub answered from {first} of {total}"
                    )
            elif r.status_code == 200:  # the whole file again (a server that ignores ranges)
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                have, h = 0, hashed() if hashed is not None else None
            else:
                raise WrongAnswer(f"{what}: the Hub answered {r.status_code} to a download")
            for chunk in r.iter_raw():
                if have + len(chunk) > size:
                    raise WrongAnswer(f"{what}: the Hub sent more than the file's {size} bytes")
                try:
                    _write_all(fd, chunk)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise MachineError(
                            f"{path}: no space left on the device ({what}: {size - have} more bytes needed)"
                        ) from None
                    raise
                if h is not None:
                    h.update(chunk)
                have += len(chunk)
                report.downloaded(len(chunk))
        if have != size:
            raise httpx2.RemoteProtocolError(f"{what}: {have} of {size} bytes arrived")
        return h
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
