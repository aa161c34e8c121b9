"""A loopback server speaking the part of the Hugging Face Hub's protocol huggingface_hub uses to read a
repo: ``GET /api/models/{repo}/revision/{rev}?blobs=true`` (the commit and every file's size, git blob
id and LFS SHA-256), and HEAD and GET (with Range) on ``/{repo}/resolve/{rev}/{path}``, with the
commit and ETag headers.

The repo keeps commits: it starts with one holding the files of a folder, ``commit(changes)`` makes
a new one (a new id; ``main`` moves to it) and every older commit is still served by its id. Faults:
``faults=True`` cuts the first whole-file download of each large file part way through (the client
must resume with a ranged request) and answers every seventh GET with a 503; ``outage(seconds)``
drops every connection unanswered for a while (the Hub unreachable); ``throttle`` caps each
download's rate (bytes/s); ``corrupt`` serves a file with a byte flipped; ``token`` requires one. Everything stays on 127.0.0.1 and the server stops
when the test ends.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".model")  # stored in LFS on the real Hub: these have a SHA-256 oid


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    def __init__(
        self, root: Path, repo: str = "moonshotai/Kimi-K3", faults: bool = False, token: str | None = None
    ):
        self.repo, self.faults, self.token = repo, faults, token
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, range)
        self.cut: set[str] = set()
        self.count = 0
        self.throttle: float | None = None  # bytes per second per download
        self._down_until = 0.0
        self.dropped = 0  # connections dropped by an outage
        self.corrupt: set[str] = set()  # paths served with one byte flipped (their listing unchanged)
        files = {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(Path(root).rglob("*"))
            if p.is_file()
        }
        self.commits: dict[str, dict[str, bytes]] = {}
        self.branches: dict[str, str] = {}
        self.first = self._new_commit(files, "initial commit")
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

    # --- the repo ---
    def _new_commit(self, files: dict[str, bytes], message: str) -> str:
        with self.lock:
            parent = self.branches.get("main", "")
            sha = hashlib.sha1(f"{parent}\n{message}\n{len(self.commits)}".encode()).hexdigest()
            self.commits[sha] = dict(files)
            self.branches["main"] = sha
        return sha

    def commit(self, changes: dict[str, bytes | None], message: str = "update") -> str:
        """A new commit on main: each path set to its bytes (None deletes it). Returns its id."""
        files = dict(self.commits[self.head])
        for path, data in changes.items():
            if data is None:
                files.pop(path, None)
            else:
                files[path] = data
        return self._new_commit(files, message)

    @property
    def head(self) -> str:
        return self.branches["main"]

    def file(self, path: str, rev: str = "main") -> bytes:
        return self.commits[self.branches.get(rev, rev)][path]

    def outage(self, seconds: float) -> None:
        """From now on, for ``seconds``, every request is dropped unanswered (the Hub unreachable)."""
        self._down_until = time.monotonic() + seconds

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- the protocol ---
    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        body = message.encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _drop(self, h: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.dropped += 1
        h.close_connection = True
        try:
            h.connection.shutdown(2)
        except OSError:
            pass

    def _resolve(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> str | None:
        """The commit id of ``rev`` (a branch or a commit), or None with the Hub's 404 sent."""
        if repo != self.repo:
            self._error(h, 404, "RepoNotFound", f"Repository {repo} not found")
            return None
        if self.token and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 401, "RepoNotFound", "Invalid credentials in Authorization header")
            return None
        commit = self.branches.get(rev, rev if rev in self.commits else None)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _info(self, h: BaseHTTPRequestHandler, head: bool, repo: str, rev: str) -> None:
        commit = self._resolve(h, repo, rev)
        if commit is None:
            return
        siblings = []
        for path, data in sorted(self.commits[commit].items()):
            s = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
            if path.endswith(LFS_SUFFIXES):
                s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(s)
        body = json.dumps(
            {"id": repo, "modelId": repo, "sha": commit, "private": False, "siblings": siblings}
        ).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        rng = h.headers.get("Range", "")
        with self.lock:
            self.requests.append(("HEAD" if head else "GET", h.path, rng))
            self.count += 1
            n = self.count
        if time.monotonic() < self._down_until:
            return self._drop(h)
        path = urllib.parse.unquote(h.path.split("?")[0])
        api = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>.+))?", path)
        if api:
            return self._info(h, head, api["repo"], api["rev"] or "main")
        m = re.fullmatch(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        if not m:
            return self._error(h, 404, "RepoNotFound", f"Repository {h.path} not found")
        commit = self._resolve(h, m["repo"], m["rev"])
        if commit is None:
            return
        data = self.commits[commit].get(m["file"])
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{m['file']} does not exist on {m['rev']}")
        if self.faults and not head and n % 7 == 0:
            return self._error(h, 503, "", "Service Unavailable")
        size = len(data)
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
        lfs = m["file"].endswith(LFS_SUFFIXES)
        h.send_response(status)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.end_headers()
        if head:
            return
        if m["file"] in self.corrupt:
            flipped = bytearray(data)
            flipped[-1] ^= 0x01
            data = bytes(flipped)
        body = memoryview(data)[start : end + 1]
        cut = False
        with self.lock:
            # cut the first whole-file transfer of each large file (a client's fresh download)
            if self.faults and not rng and size > 100_000 and m["file"] not in self.cut:
                self.cut.add(m["file"])
                cut = True
        if cut:  # send part of the body, then drop the connection
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        step = 65536
        for i in range(0, len(body), step):
            if time.monotonic() < self._down_until:  # an outage cuts transfers in flight too
                return self._drop(h)
            try:
                h.wfile.write(body[i : i + step])
            except OSError:  # the client went away (a cancelled download)
                return
            if self.throttle:
                time.sleep(min(len(body) - i, step) / self.throttle)
