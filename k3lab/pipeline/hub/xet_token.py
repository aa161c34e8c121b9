"""hf_xet's CAS token, fetched by k3lab within the bounds every Hub answer is held to.

Given the Hub's ``xet-write-token`` URL, hf_xet fetches the token itself, with its own Rust client,
and reads the answer whole: a Hub (or anything between) that answers with 200 MB, or slowly, takes
the publisher's memory and time past every bound k3lab keeps. So hf_xet is never given that URL.
k3lab fetches the token (``fetch_token``: through huggingface_hub's client and k3lab's bounded
transport, ``API_LIMIT`` bytes at most, the request timeouts, inside the retry budget), seeds hf_xet
with it, and hands hf_xet a route of its own for the refreshes a long upload needs (``TokenRoute``):
a loopback HTTP server whose one path answers each refresh with a token k3lab fetched the same way.

The route listens on 127.0.0.1 only, and answers only a request that carries its own secret (made
per upload, 256 bits, compared in constant time): another local user cannot take the token from it.
It lives as long as the upload and is shut down with it.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from k3lab.pipeline.hub.bounds import TIMEOUTS, WrongAnswer
from k3lab.pipeline.hub.retry import with_retries

TOKEN_LIMIT = 64 << 10  # bytes of a token or a CAS URL (the Hub's are a few hundred)
PATH = "/xet-token"


@dataclass(frozen=True)
class XetToken:
    """A CAS access token, when it expires (Unix seconds) and the CAS it is for."""

    access: str
    expires: int
    cas_url: str

    def answer(self) -> bytes:
        return json.dumps({"accessToken": self.access, "exp": self.expires, "casUrl": self.cas_url}).encode()


def parse_token(data: Any, what: str) -> XetToken:
    """The Hub's token answer (``{"accessToken", "exp", "casUrl"}``), every field checked."""
    if not isinstance(data, dict):
        raise WrongAnswer(f"{what}: the Hub's Xet token answer is not a JSON object")
    access, expires, cas = data.get("accessToken"), data.get("exp"), data.get("casUrl")
    if not isinstance(access, str) or not access or len(access) > TOKEN_LIMIT:
        raise WrongAnswer(f"{what}: the Hub's Xet token answer has no usable accessToken")
    if not isinstance(expires, int) or isinstance(expires, bool) or not 0 < expires < 1 << 40:
        raise WrongAnswer(f"{what}: the Hub's Xet token answer has no usable exp ({str(expires)[:40]})")
    url = urlparse(cas) if isinstance(cas, str) and len(cas) <= TOKEN_LIMIT else None
    if url is None or url.scheme not in ("http", "https") or not url.netloc:
        raise WrongAnswer(f"{what}: the Hub's Xet token answer has no http(s) casUrl")
    return XetToken(access, expires, cas)


def fetch_token(
    refresh_url: str, headers: dict[str, str], what: str, budget: float, retry: bool = True
) -> XetToken:
    """The token, fetched through k3lab's bounded transport, within ``budget`` seconds of retries
    (``retry`` False: once, the caller's retries holding it)."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    from k3lab.pipeline.hub import transport

    transport.install()

    # one request waits at most a quarter of the budget (a minute at most): a Hub that says nothing
    # is retried, or given up on, inside the budget
    wait = max(1.0, min(TIMEOUTS["read"], budget / 4))

    def once() -> XetToken:
        r = get_session().get(refresh_url, headers=headers, timeout=wait)
        hf_raise_for_status(r)
        try:
            data = r.json()
        except ValueError:
            raise WrongAnswer(f"{what}: the Hub's Xet token answer is not JSON") from None
        return parse_token(data, what)

    return with_retries(f"{what} (its Xet token)", once, budget) if retry else once()


class TokenRoute:
    """A loopback route hf_xet refreshes its token from; each refresh is ``fetch_token``'s."""

    def __init__(self, refresh_url: str, headers: dict[str, str], what: str, budget: float):
        self.secret = secrets.token_urlsafe(32)
        route = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                given = self.headers.get("Authorization", "")
                if self.path != PATH or not hmac.compare_digest(given, f"Bearer {route.secret}"):
                    self.send_error(403)
                    return
                try:
                    body = fetch_token(refresh_url, headers, what, budget).answer()
                except Exception as e:  # noqa: BLE001 (told to hf_xet as a failed refresh)
                    route.failure = e
                    self.send_error(502)
                    return
                route.refreshed += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # (nothing on the terminal)
                pass

        self.failure: BaseException | None = None
        self.refreshed = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="xet-token", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{PATH}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> TokenRoute:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
