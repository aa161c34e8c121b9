"""A loopback server speaking the part of the Hugging Face Hub's file protocol huggingface_hub uses:
HEAD and GET (with Range) on /{repo}/resolve/{revision}/{path}, with the commit and ETag headers.

It serves one folder as one repo. Fault mode cuts the first whole-file download of each large file
part way through (so the client must resume with a ranged request) and answers every seventh GET
with a 503; it can also require a token. Everything stays
on 127.0.0.1 and the server stops when the test ends.
"""

from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(
        self, root: Path, repo: str = "moonshotai/Kimi-K3", faults: bool = False, token: str | None = None
    ):
        self.root, self.repo, self.faults, self.token = Path(root), repo, faults, token
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, range)
        self.cut: set[str] = set()
        self.count = 0
        self.etags: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server.handle(self, head=True)

            def do_GET(self) -> None:
                server.handle(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def etag(self, path: Path) -> str:
        key = str(path)
        if key not in self.etags:
            self.etags[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self.etags[key]

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        body = message.encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        rng = h.headers.get("Range", "")
        with self.lock:
            self.requests.append(("HEAD" if head else "GET", h.path, rng))
            self.count += 1
            n = self.count
        m = re.fullmatch(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", h.path.split("?")[0])
        if not m or m["repo"] != self.repo:
            return self._error(h, 404, "RepoNotFound", f"Repository {m['repo'] if m else h.path} not found")
        if self.token and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(h, 401, "RepoNotFound", "Invalid credentials in Authorization header")
        if m["rev"] not in ("main", COMMIT):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {m['rev']}")
        path = self.root / m["file"]
        if not path.is_file():
            return self._error(h, 404, "EntryNotFound", f"{m['file']} does not exist on {m['rev']}")
        if self.faults and not head and n % 7 == 0:
            return self._error(h, 503, "", "Service Unavailable")
        size = path.stat().st_size
        start, end = 0, size - 1
        status = 200
        r = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
        if r:
            start = int(r[1])
            end = min(int(r[2]) if r[2] else size - 1, size - 1)
            status = 206
            if start >= size:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{size}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
        h.send_response(status)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{self.etag(path)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.end_headers()
        if head:
            return
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start + 1)
        cut = False
        with self.lock:
            # cut the first whole-file transfer of each large file (a client's fresh download)
            if self.faults and not rng and size > 100_000 and m["file"] not in self.cut:
                self.cut.add(m["file"])
                cut = True
        if cut:  # send part of the body, then drop the connection
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(data)
