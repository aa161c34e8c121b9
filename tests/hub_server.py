"""A loopback server speaking the part of the Hugging Face Hub's protocol huggingface_hub uses to read a
repo: ``GET /api/models/{repo}/revision/{rev}?blobs=true`` (the commit and every file's size, git blob
id and LFS SHA-256), and HEAD and GET (with Range) on ``/{repo}/resolve/{rev}/{path}``, with the
commit and ETag headers.

The repo keeps commits: it starts with one holding the files of a folder, ``commit(changes)`` makes
a new one (a new id; ``main`` moves to it) and every older commit is still served by its id. Faults:
``faults=True`` cuts the first whole-file download of each large file part way through (the client
must resume with a ranged request) and answers every seventh GET with a 503; ``outage(seconds)``
drops every connection unanswered for a while (the Hub unreachable); ``throttle`` caps each
shard download's rate (bytes/s); ``corrupt`` serves a file with a byte flipped; ``token`` requires one. Everything stays on 127.0.0.1 and the server stops
when the test ends.

Storage is Xet, as on today's Hub (``xet=True``, the default): a large file's ``/resolve/`` answers a
redirect to a bridge that serves its bytes, with the ``X-Xet-Hash`` and token route that hf_xet reads,
and uploads go to a loopback CAS (``xet_cas.XetCas``, under ``/cas``). ``xet=False``: the LFS protocol
(pre-upload, LFS batch, PUT), and clients told so (``HF_HUB_DISABLE_XET=1``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".model", ".gguf")
HEADER_READ = (
    1 << 20
)  # ranged reads this short are never throttled (a header, a tensor's piece)  # stored in LFS on the real Hub: these have a SHA-256 oid


def git_blob_id(data: bytes) -> str:
    if isinstance(data, FileBlob):
        return data.git_id()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256_of(data: bytes) -> str:
    return data.sha256() if isinstance(data, FileBlob) else hashlib.sha256(data).hexdigest()


# a part of the Hub's model card rules (https://huggingface.co/docs/hub/model-cards): enough to refuse
# what a converter gets wrong (an unknown license without its name and link, a made-up relation)
LICENSES = {
    "apache-2.0",
    "mit",
    "openrail",
    "llama3",
    "gemma",
    "cc-by-4.0",
    "cc-by-nc-4.0",
    "other",
    "unknown",
}
RELATIONS = {"adapter", "merge", "quantized", "finetune"}
PIPELINE_TAGS = {"text-generation", "image-text-to-text", "feature-extraction"}


def validate_card(content: str) -> list[str]:
    import yaml

    m = re.match(r"---\n(.*?)\n---\n", content, re.S)
    if not m:
        return ["no YAML front matter"]
    data = yaml.safe_load(m[1]) or {}
    errors = []
    if data.get("license") not in LICENSES:
        errors.append(f"license {data.get('license')!r} is not a license id")
    if data.get("license") == "other" and not (data.get("license_name") and data.get("license_link")):
        errors.append("license other needs license_name and license_link")
    if "base_model_relation" in data and data["base_model_relation"] not in RELATIONS:
        errors.append(f"base_model_relation {data['base_model_relation']!r}")
    if "pipeline_tag" in data and data["pipeline_tag"] not in PIPELINE_TAGS:
        errors.append(f"pipeline_tag {data['pipeline_tag']!r}")
    return errors


class FileBlob:
    """A large file served from disk, never read whole (the real-size `full` checkpoint, sparse; a
    full-size GGUF set). Files over ``HASHED`` bytes get a stand-in oid (the test Hub does not hash
    terabytes of holes): a client that downloads one whole would see a mismatch; tests read them by
    ranges only."""

    HASHED = 256 << 20

    def __init__(self, path: Path):
        self.path, self.size = Path(path), Path(path).stat().st_size
        self._sha: str | None = None
        self._git: str | None = None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(self.size)
        with open(self.path, "rb") as fh:
            fh.seek(start)
            return fh.read(max(0, stop - start))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FileBlob):
            return self.path == other.path
        return isinstance(other, (bytes, bytearray)) and len(other) == self.size and self[:] == other

    __hash__ = object.__hash__

    def sha256(self) -> str:
        if self._sha is None:
            if self.size > self.HASHED:
                self._sha = hashlib.sha256(f"unhashed:{self.path}:{self.size}".encode()).hexdigest()
            else:
                h = hashlib.sha256()
                with open(self.path, "rb") as fh:
                    while chunk := fh.read(1 << 24):
                        h.update(chunk)
                self._sha = h.hexdigest()
        return self._sha

    def git_id(self) -> str:
        if self._git is None:  # (once: every listing of a repo asks for it)
            if self.size > self.HASHED:
                self._git = hashlib.sha1(f"unhashed blob {self.size}:{self.sha256()}".encode()).hexdigest()
            else:
                h = hashlib.sha1(b"blob %d\0" % self.size)
                with open(self.path, "rb") as fh:
                    while chunk := fh.read(1 << 24):
                        h.update(chunk)
                self._git = h.hexdigest()
        return self._git


def load_files(root: Path, large: int | None = None) -> dict[str, bytes]:
    """A folder's files by path; those over ``large`` bytes served from disk (``FileBlob``)."""
    return {
        p.relative_to(root).as_posix(): (
            FileBlob(p) if large is not None and p.stat().st_size > large else p.read_bytes()
        )
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


class HubServer:
    def __init__(
        self,
        root: Path,
        repo: str = "moonshotai/Kimi-K3",
        faults: bool = False,
        token: str | None = None,
        large: int | None = None,
        xet: bool = True,
    ):
        from xet_cas import XetCas

        self.repo, self.faults, self.token, self.xet = repo, faults, token, xet
        self.cas = XetCas(self)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, range)
        self.served: list[tuple[str, str, int]] = []  # (path, range, body bytes sent) per file answer
        self.transfers: list[tuple[str, int, int, int]] = []  # (path, first, last byte, size) per GET
        # hostile answers, by file path: "html" (a web page with 200), "endless" (200 and a body that
        # never ends), "trickle" (a byte at a time, 0.2 s apart), "long" (a ranged answer longer than asked)
        self.hostile: dict[str, str] = {}
        self.cut: set[str] = set()
        self.count = 0
        self.throttle: float | None = None  # bytes per second per download
        self.link: float | None = None  # bytes per second of every answer's body together (one link)
        self._link_free = 0.0
        self.uplink: float | None = None  # bytes per second of every request's body together (uploads)
        self.check_cards = True  # a card's metadata is validated as the Hub does (off: an older k3lab's)
        self._up_free = 0.0
        self._down_until = 0.0
        self.dropped = 0  # connections dropped by an outage
        self.corrupt: set[str] = set()  # paths served with one byte flipped (their listing unchanged)
        self.flip: dict[str, int] = {}  # paths whose ranged reads short of the end have this byte flipped
        self.info_answer: tuple[bytes, dict[str, str]] | None = None  # (body, headers) of every listing
        self.claims: dict[tuple[str, str], str] = {}  # (repo, path) -> the SHA-256 its listing claims
        files = load_files(root, large)
        self.repos: dict[str, tuple[dict[str, dict[str, bytes]], dict[str, str]]] = {repo: ({}, {})}
        self.blobs: dict[str, bytes] = {}  # LFS objects uploaded, by SHA-256
        self.uploads: list[str] = []  # oids PUT, in order
        self.commit_log: list[tuple[str, str, list[str]]] = []  # (repo, commit, paths) of pushed commits
        self.upload_faults = False  # every third PUT answers 500 (huggingface_hub retries it)
        self.token_requests: list[tuple[str, str, str]] = []  # Xet token requests: (method, path, User-Agent)
        self.uplink_dead = False  # every PUT answers 500 (downloads, the API and commits still work)
        self.private: set[str] = set()  # repos made private: unseen without the token
        self._puts = 0
        self.first = self._new_commit(files, "initial commit")
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # (else every small answer waits ~40 ms for a delayed ACK)

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server.handle(self, head=True)

            def do_GET(self) -> None:
                server.handle(self, head=False)

            def do_POST(self) -> None:
                server.handle_write(self, "POST")

            def do_PUT(self) -> None:
                server.handle_write(self, "PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # --- the repo ---
    @property
    def commits(self) -> dict[str, dict[str, bytes]]:
        return self.repos[self.repo][0]

    @property
    def branches(self) -> dict[str, str]:
        return self.repos[self.repo][1]

    def _new_commit(
        self, files: dict[str, bytes], message: str, repo: str | None = None, branch: str = "main"
    ) -> str:
        commits, branches = self.repos[repo or self.repo]
        with self.lock:
            parent = branches.get(branch, "")
            sha = hashlib.sha1(
                f"{repo}\n{parent}\n{message}\n{len(commits)}\n{time.time()}".encode()
            ).hexdigest()
            commits[sha] = dict(files)
            branches[branch] = sha
        return sha

    def files_of(self, repo: str, rev: str = "main") -> dict[str, bytes]:
        commits, branches = self.repos[repo]
        return commits[branches.get(rev, rev)]

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

    def client_env(self, tmp: Path, token: str | None = None) -> dict[str, str]:
        """The environment of a k3lab process using this Hub: its endpoint, a home of its own, the
        token (or none); no Xet when this Hub speaks only the LFS protocol."""
        import os

        env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
        env |= {
            "HF_ENDPOINT": self.url,
            "HF_HOME": str(tmp / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "K3LAB_CACHE": str(tmp / "k3lab-cache"),
        }
        if not self.xet:
            env["HF_HUB_DISABLE_XET"] = "1"
        if token:
            env["HF_TOKEN"] = token
        return env

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
        if repo not in self.repos:
            self._error(h, 404, "RepoNotFound", f"Repository {repo} not found")
            return None
        authorized = h.headers.get("Authorization") == f"Bearer {self.token}"
        if self.token and not authorized:
            self._error(h, 401, "RepoNotFound", "Invalid credentials in Authorization header")
            return None
        if repo in self.private and not (self.token and authorized):
            self._error(h, 401, "RepoNotFound", f"Repository Not Found for url: {repo} (private)")
            return None
        commits, branches = self.repos[repo]
        commit = branches.get(rev, rev if rev in commits else None)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _info(self, h: BaseHTTPRequestHandler, head: bool, repo: str, rev: str) -> None:
        commit = self._resolve(h, repo, rev)
        if commit is None:
            return
        if self.info_answer is not None:  # a hostile answer to the repo's listing
            body, headers = self.info_answer
            h.send_response(200)
            for k, v in {
                "Content-Type": "application/json",
                "Content-Length": str(len(body)),
                **headers,
            }.items():
                h.send_header(k, v)
            h.end_headers()
            if not head:
                h.wfile.write(body)
            return
        siblings = []
        for path, data in sorted(self.repos[repo][0][commit].items()):
            s = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
            if path.endswith(LFS_SUFFIXES):
                sha = self.claims.get((repo, path)) or sha256_of(data)
                s["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
            siblings.append(s)
        body = json.dumps(
            {
                "id": repo,
                "modelId": repo,
                "sha": commit,
                "private": repo in self.private,
                "siblings": siblings,
            }
        ).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _tree(self, h: BaseHTTPRequestHandler, repo: str, rev: str, under: str) -> None:
        """The repo's files at a revision, as ``list_repo_tree(recursive=True)`` reads them (what
        ``hf download`` and ``snapshot_download`` list before they fetch)."""
        commit = self._resolve(h, repo, rev)
        if commit is None:
            return
        entries = []
        for path, data in sorted(self.repos[repo][0][commit].items()):
            if under and not path.startswith(under.rstrip("/") + "/"):
                continue
            e = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if path.endswith(LFS_SUFFIXES):
                e["lfs"] = {"oid": sha256_of(data), "size": len(data), "pointerSize": 134}
            entries.append(e)
        self._json(h, entries)

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        rng = h.headers.get("Range", "")
        with self.lock:
            self.requests.append(("HEAD" if head else "GET", h.path, rng))
            self.count += 1
            n = self.count
        if time.monotonic() < self._down_until:
            return self._drop(h)
        path = urllib.parse.unquote(h.path.split("?")[0])
        if path.startswith("/cas/"):
            return self.cas.handle(h, "HEAD" if head else "GET", path, b"")
        token = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)/xet-(?:read|write)-token/(?P<rev>.+)", path)
        if token:
            self.token_requests.append(("GET", path, h.headers.get("User-Agent", "")))
            return self._resolve(h, token["repo"], "main") and self.cas.token(h)
        tree = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", path)
        if tree:
            return self._tree(h, tree["repo"], tree["rev"], tree["path"] or "")
        api = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>.+))?", path)
        if api:
            return self._info(h, head, api["repo"], api["rev"] or "main")
        m = re.fullmatch(
            r"/(?P<bridge>cas-bridge/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path
        )
        if not m:
            return self._error(h, 404, "RepoNotFound", f"Repository {h.path} not found")
        commit = self._resolve(h, m["repo"], m["rev"])
        if commit is None:
            return
        data = self.repos[m["repo"]][0][commit].get(m["file"])
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
        if self.xet and lfs and not m["bridge"]:
            return self._xet_redirect(h, m["repo"], commit, m["file"], data)
        if not head:
            with self.lock:
                self.transfers.append((m["file"], start, end, size))
        mode = self.hostile.get(m["file"])
        if mode and not head:
            return self._hostile(h, mode, m["file"], start, end, size)
        h.send_response(status)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{sha256_of(data) if lfs else git_blob_id(data)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.end_headers()
        if head:
            return
        flip = m["file"] in self.flip and end < size - 1  # (a header's read, not a download)
        if m["file"] in self.corrupt or flip:
            flipped = bytearray(data[:])
            flipped[self.flip.get(m["file"], -1)] ^= 0x01
            data = bytes(flipped)
        body = data if isinstance(data, FileBlob) else memoryview(data)
        body = _Window(body, start, end + 1)
        cut = False
        with self.lock:
            # cut a transfer of each large file that runs to its end, once, and not the file's first
            # (in a conversion that is the planner's ranged read of its header: the download follows)
            asked = sum(1 for _, p, _ in self.requests if p.split("?")[0].endswith("/" + m["file"]))
            if self.faults and end == size - 1 and size > 100_000 and m["file"] not in self.cut and asked > 1:
                self.cut.add(m["file"])
                cut = True
        if cut:  # send part of the body, then drop the connection
            half = len(body) // 2
            h.wfile.write(body[:half])
            h.wfile.flush()
            self._served(m["file"], rng, half)
            h.close_connection = True
            h.connection.shutdown(2)
            return
        step = 65536
        sent = 0
        try:
            for i in range(0, len(body), step):
                if time.monotonic() < self._down_until:  # an outage cuts transfers in flight too
                    return self._drop(h)
                chunk = body[i : i + step]
                self._pace(len(chunk))
                try:
                    h.wfile.write(chunk)
                except OSError:  # the client went away (a cancelled download)
                    return
                sent += len(chunk)
                if self.throttle and (end == size - 1 or end - start + 1 > HEADER_READ):
                    time.sleep(min(len(body) - i, step) / self.throttle)  # (headers: planning stays quick)
        finally:
            self._served(m["file"], rng, sent)

    def _xet_redirect(
        self, h: BaseHTTPRequestHandler, repo: str, commit: str, file: str, data: bytes
    ) -> None:
        """A Xet file's ``/resolve/``, as the Hub answers it: a redirect to the bridge serving its bytes,
        with the Xet hash and token route huggingface_hub hands to hf_xet, size and SHA-256 beside."""
        sha = sha256_of(data)
        # (a file served from disk, terabytes of holes, is only ever read by ranges through the bridge:
        # the CAS does not chunk it, and its Xet hash names nothing hf_xet could rebuild)
        fhash = hashlib.sha256(b"file" + sha.encode()).hexdigest()
        if not isinstance(data, FileBlob):
            fhash = self.cas.register(data, sha)
        h.send_response(302)
        h.send_header("Location", f"{self.url}/cas-bridge/{repo}/resolve/{commit}/{urllib.parse.quote(file)}")
        h.send_header("X-Repo-Commit", commit)
        h.send_header("X-Xet-Hash", fhash)
        h.send_header("Link", f'<{self.url}/api/models/{repo}/xet-read-token/{commit}>; rel="xet-auth"')
        h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("X-Linked-Etag", f'"{sha}"')
        h.send_header("ETag", f'"{sha}"')
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _read_paced(self, h: BaseHTTPRequestHandler, n: int) -> bytes:
        """A request body, taken no faster than the uplink carries it (``uplink`` bytes/s)."""
        if not self.uplink:
            return h.rfile.read(n)
        parts, left = [], n
        while left:
            chunk = h.rfile.read(min(left, 65536))
            if not chunk:
                break
            self._take("_up_free", len(chunk), self.uplink)
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def _read_trickle(self, h: BaseHTTPRequestHandler, n: int) -> bytes:
        """A request body taken at 2 kB/s (a CAS that reads an upload too slowly), given up after 60 s."""
        parts, left, until = [], n, time.monotonic() + 60
        while left and time.monotonic() < until:
            chunk = h.rfile.read(min(left, 200))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
            time.sleep(0.1)
        return b"".join(parts)

    def _pace(self, n: int) -> None:
        """Hold a chunk until the one link (``link`` bytes/s, shared by every answer) can carry it."""
        if self.link:
            self._take("_link_free", n, self.link)

    BURST = 0.05  # seconds of a link's capacity that a late chunk may make up

    def _take(self, free: str, n: int, rate: float) -> None:
        """Wait until a link (its next free moment in attribute ``free``) has carried ``n`` bytes. A
        chunk that comes a little late (this server's own overhead, a sleep's overshoot) uses the
        time the link sat idle, up to ``BURST``: the link carries ``rate`` bytes/s, not less."""
        with self.lock:
            now = time.monotonic()
            start = max(now - self.BURST, getattr(self, free))
            setattr(self, free, start + n / rate)
            until = start + n / rate
        time.sleep(max(0.0, until - now))

    def add_repo(self, repo: str, root: Path, large: int | None = 1 << 20) -> str:
        """Serve a folder (a GGUF set) as another repo; returns its commit."""
        self.repos[repo] = ({}, {})
        return self._new_commit(load_files(root, large), "a folder", repo)

    def _served(self, path: str, rng: str, n: int) -> None:
        with self.lock:
            self.served.append((path, rng, n))

    def downloads(self, suffix: str = ".safetensors", fresh: bool = False) -> list[tuple[str, int]]:
        """(path, first byte) of each GET that runs to the end of a file ending in ``suffix`` (a
        download; ``fresh``: from byte 0), never a header's ranged read, which stops short."""
        with self.lock:
            return [
                (p, a)
                for p, a, b, size in self.transfers
                if p.endswith(suffix) and b == size - 1 and (a == 0 or not fresh)
            ]

    def served_bytes(self, path: str | None = None) -> int:
        """Body bytes sent for file answers (of ``path``, or of every file)."""
        with self.lock:
            return sum(n for p, _, n in self.served if path is None or p == path)

    def _hostile(
        self, h: BaseHTTPRequestHandler, mode: str, path: str, start: int, end: int, size: int
    ) -> None:
        """Answers a client must refuse or give up on, in bounded bytes and time."""
        h.close_connection = True
        if mode == "html":
            body = b"<!doctype html><html><body>Sign in to continue</body></html>"
            h.send_response(200)
            h.send_header("Content-Type", "text/html; charset=utf-8")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        if mode == "long":  # the range asked for, as a 206, but with more bytes than it says
            n = end - start + 1 + 4096
            h.send_response(206)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            h.end_headers()
            h.wfile.write(b"\0" * n)
            return
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        sent = 0
        try:
            while sent < 1 << 30:  # (a bound for the test's own sake: 1 GiB)
                if mode == "endless":
                    h.wfile.write(b"\0" * 65536)
                    sent += 65536
                else:  # trickle
                    h.wfile.write(b"\0")
                    h.wfile.flush()
                    sent += 1
                    time.sleep(0.2)
        except OSError:
            pass
        finally:
            self._served(path, "hostile", sent)

    # --- the write side: create a repo, pre-upload, LFS batch and PUT, commit ---
    def _json(self, h: BaseHTTPRequestHandler, data: object, status: int = 200) -> None:
        body = json.dumps(data).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def handle_write(self, h: BaseHTTPRequestHandler, method: str) -> None:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while (size := int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                parts.append(self._read_paced(h, size))
                h.rfile.readline()
            h.rfile.readline()
            body = b"".join(parts)
        else:
            length = int(h.headers.get("Content-Length", "0") or 0)
            if self.cas.trickle and h.path.startswith("/cas/"):
                body = self._read_trickle(h, length)
            else:
                body = self._read_paced(h, length) if length else b""
        path = urllib.parse.unquote(h.path.split("?")[0])
        with self.lock:
            self.requests.append((method, h.path, ""))
        if time.monotonic() < self._down_until:
            return self._drop(h)
        if (
            self.token
            and h.headers.get("Authorization") != f"Bearer {self.token}"
            and not path.startswith(("/lfs-upload/", "/cas/"))
            and path != "/api/validate-yaml"
        ):
            return self._error(h, 401, "", "Invalid credentials in Authorization header")
        if path.startswith("/cas/"):
            return self.cas.handle(h, method, path, body)
        if method == "PUT" and (m := re.fullmatch(r"/lfs-upload/(?P<oid>[0-9a-f]{64})", path)):
            with self.lock:
                self._puts += 1
                fail = (self.upload_faults and self._puts % 3 == 0) or self.uplink_dead
            if fail:
                return self._error(h, 500, "", "Internal Server Error")
            if hashlib.sha256(body).hexdigest() != m["oid"]:
                return self._error(h, 400, "", "the uploaded bytes do not match their oid")
            with self.lock:
                self.blobs[m["oid"]] = body
                self.uploads.append(m["oid"])
            return self._json(h, {})
        if path == "/api/validate-yaml":
            errors = validate_card(json.loads(body).get("content", "")) if self.check_cards else []
            if errors:
                return self._error(h, 400, "", "; ".join(errors))
            return self._json(h, {"warnings": [], "errors": []})
        if path == "/api/repos/create":
            req = json.loads(body)
            name = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            if name in self.repos:
                return self._json(
                    h, {"error": "You already created this model repo", "url": f"{self.url}/{name}"}, 409
                )
            self.repos[name] = ({}, {})
            if req.get("private") or req.get("visibility") == "private":
                self.private.add(name)
            self._new_commit(
                {".gitattributes": b"*.gguf filter=lfs diff=lfs merge=lfs -text\n"}, "initial commit", name
            )
            return self._json(h, {"url": f"{self.url}/{name}", "name": name})
        m = re.fullmatch(
            r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<what>preupload|commit|branch)/(?P<rev>.+)", path
        )
        if m and m["what"] == "branch":
            commits, branches = self.repos[m["repo"]]
            branches.setdefault(m["rev"], branches["main"])
            return self._json(h, {})
        if m and m["what"] in ("preupload", "commit") and m["rev"] not in self.repos[m["repo"]][1]:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {m['rev']}")  # (make it first)
        if m and m["what"] == "preupload":
            req = json.loads(body)
            files = self.files_of(m["repo"], m["rev"])
            out = []
            for f in req["files"]:
                lfs = f["path"].endswith(LFS_SUFFIXES)
                old = files.get(f["path"])
                oid = (
                    (hashlib.sha256(old).hexdigest() if lfs else git_blob_id(old))
                    if old is not None
                    else None
                )
                out.append(
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": oid,
                    }
                )
            return self._json(h, {"files": out, "commitOid": self.repos[m["repo"]][1].get(m["rev"])})
        if m and m["what"] == "commit":
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            branch = m["rev"]
            commits, branches = self.repos[m["repo"]]
            parent = lines[0]["value"].get("parentCommit") if lines and lines[0]["key"] == "header" else None
            if parent and parent != branches[branch]:  # (the Hub's answer to a commit made on an old head)
                return self._error(h, 412, "", "A commit has happened since. Please refresh and try again.")
            files = dict(commits[branches[branch]])
            paths = []
            for item in lines:
                v = item["value"]
                if item["key"] == "file":
                    files[v["path"]] = base64.b64decode(v["content"])
                elif item["key"] == "lfsFile":
                    if v["oid"] not in self.blobs:
                        return self._error(h, 400, "", f"LFS object {v['oid']} was never uploaded")
                    files[v["path"]] = self.blobs[v["oid"]]
                elif item["key"] in ("deletedFile", "deletedFolder"):
                    files = {
                        p: d for p, d in files.items() if p != v["path"] and not p.startswith(v["path"] + "/")
                    }
                else:
                    continue
                paths.append(v["path"])
            sha = self._new_commit(files, lines[0]["value"].get("summary", ""), m["repo"], branch)
            self.commit_log.append((m["repo"], sha, paths))
            return self._json(
                h, {"commitUrl": f"{self.url}/{m['repo']}/commit/{sha}", "commitOid": sha, "success": True}
            )
        m = re.fullmatch(r"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if m:
            req = json.loads(body)
            objects = []
            for o in req["objects"]:
                entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
                if o["oid"] not in self.blobs:
                    entry["actions"] = {"upload": {"href": f"{self.url}/lfs-upload/{o['oid']}", "header": {}}}
                objects.append(entry)
            return self._json(h, {"transfer": "basic", "objects": objects})
        return self._error(h, 404, "", f"no such endpoint: {method} {path}")


class _Window:
    """Bytes [start, stop) of a body (bytes or a FileBlob), sliced relative to ``start``."""

    def __init__(self, data: object, start: int, stop: int):
        self.data, self.start, self.stop = data, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, s: slice) -> bytes:
        a, b, _ = s.indices(len(self))
        return bytes(self.data[self.start + a : self.start + b])
