"""A loopback Xet CAS, written from the protocol hf_xet speaks (xet-core's ``openapi/cas.openapi.yaml``
and the byte formats of its xorbs and shards), for the test Hub (``hub_server.HubServer``) to serve
under ``/cas``. hf_xet 1.8 asks first for a xorb upload grant and a V2 shard upload; answered 404,
it falls back to the V1 routes served here:

- ``GET /v1/chunks/{prefix}/{hash}``: global dedup; 404 (nothing tracked: the client's own shard
  cache still dedups what it uploaded before).
- ``POST /v1/xorbs/default/{hash}``: a xorb, kept as sent (chunks, each behind an 8-byte header:
  version, compressed length (3 bytes LE), scheme (0 none, 1 LZ4 frame, 2 byte-grouped LZ4), length).
- ``POST /v1/shards``: file records (each file's Xet hash, its terms: xorb hash and chunk range, and
  its SHA-256 in the metadata extension) and xorb records; each file is rebuilt from the xorbs it names
  and its SHA-256 checked, then the Hub can commit it (``blobs``) and serve it.
- ``GET /v1/reconstructions/{file}``: terms and fetch ranges into ``/cas/xorb/{hash}``, served by range.

Faults, for the tests: ``trickle`` (a request body taken at 2 kB/s), ``dead`` (every upload route
answers 500), ``refuse`` (a xorb's upload answers 403), ``garbage`` (a xorb's answer is not JSON), ``huge`` (a xorb's answer never ends); the
Hub's own ``uplink_dead``, ``upload_faults`` (every third upload 500) and ``uplink`` (a paced body)
hold here too.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
import time
from typing import Any

BOOKEND = b"\xff" * 32


def xet_hex(raw: bytes) -> str:
    """A Xet hash as Xet writes it: four little-endian u64 words, each printed big-endian."""
    return "".join(raw[i : i + 8][::-1].hex() for i in range(0, 32, 8))


def lz4_frame_decode(data: bytes) -> bytes:
    """An LZ4 frame (what hf_xet's ``lz4_flex`` writes), decoded: the test's own reading of the format."""
    if data[:4] != b"\x04\x22\x4d\x18":
        raise ValueError("not an LZ4 frame")
    flg = data[4]
    pos = 6 + (8 if flg & 0x08 else 0) + (4 if flg & 0x01 else 0) + 1  # FLG BD [size] [dict] HC
    out = bytearray()
    while True:
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if size == 0:
            break
        raw, size = size & 0x80000000, size & 0x7FFFFFFF
        block = data[pos : pos + size]
        pos += size + (4 if flg & 0x10 else 0)
        if raw:
            out += block
        else:
            _lz4_block(block, out)
    return bytes(out)


def _lz4_block(src: bytes, out: bytearray) -> None:
    i = 0
    while i < len(src):
        token = src[i]
        i += 1
        n = token >> 4
        if n == 15:
            while True:
                b = src[i]
                i += 1
                n += b
                if b != 255:
                    break
        out += src[i : i + n]
        i += n
        if i >= len(src):
            return
        offset = src[i] | src[i + 1] << 8
        i += 2
        m = token & 15
        if m == 15:
            while True:
                b = src[i]
                i += 1
                m += b
                if b != 255:
                    break
        m += 4
        start = len(out) - offset
        for k in range(m):  # (may overlap what it copies)
            out.append(out[start + k])


def chunk_spans(xorb: bytes) -> list[tuple[int, int, int, int]]:
    """(header offset, stored length, scheme, length) of each chunk of a serialized xorb."""
    spans, pos = [], 0
    while pos + 8 <= len(xorb):
        version, scheme = xorb[pos], xorb[pos + 4]
        stored = int.from_bytes(xorb[pos + 1 : pos + 4], "little")
        length = int.from_bytes(xorb[pos + 5 : pos + 8], "little")
        if version != 0 or scheme > 2 or pos + 8 + stored > len(xorb):
            break  # (a footer, if a client sends one)
        spans.append((pos, stored, scheme, length))
        pos += 8 + stored
    return spans


def chunk_bytes(xorb: bytes, span: tuple[int, int, int, int]) -> bytes:
    pos, stored, scheme, length = span
    body = xorb[pos + 8 : pos + 8 + stored]
    if scheme == 0:
        return body
    data = lz4_frame_decode(body)
    if scheme == 2:  # byte-grouped by 4: the groups interleaved back
        groups, base, rem = [], len(data) // 4, len(data) % 4
        at = 0
        for g in range(4):
            n = base + (1 if g < rem else 0)
            groups.append(data[at : at + n])
            at += n
        out = bytearray(len(data))
        for g in range(4):
            out[g::4] = groups[g]
        data = bytes(out)
    assert len(data) == length, "a chunk's length is not what its header says"
    return data


def parse_shard(shard: bytes) -> list[dict[str, Any]]:
    """The file records of an uploaded shard: hash, terms [(xorb, start, end, unpacked)], sha256."""
    files, pos = [], 48
    while shard[pos : pos + 32] != BOOKEND:
        rec = shard[pos : pos + 48]
        flags, n = struct.unpack_from("<II", rec, 32)
        pos += 48
        terms = []
        for _ in range(n):
            e = shard[pos : pos + 48]
            _, unpacked, start, end = struct.unpack_from("<IIII", e, 32)
            terms.append((xet_hex(e[:32]), start, end, unpacked))
            pos += 48
        if flags >> 31 & 1:
            pos += 48 * n
        sha = ""
        if flags >> 30 & 1:
            sha = xet_hex(shard[pos : pos + 32])
            pos += 48
        files.append({"hash": xet_hex(rec[:32]), "terms": terms, "sha256": sha})
    return files


class XetCas:
    """The CAS's state and routes; ``HubServer`` hands it every request under ``/cas``."""

    def __init__(self, hub: Any):
        self.hub = hub
        self.xorbs: dict[str, bytes] = {}
        self.files: dict[str, dict[str, Any]] = {}  # by Xet hash
        self.by_sha: dict[str, str] = {}  # SHA-256 -> Xet hash
        self.received = {"xorbs": 0, "shards": 0, "chunk_headers": 0}
        self.trickle = self.dead = self.garbage = self.huge = self.refuse = False
        self.token_answer: str | None = None  # "huge" or "slow": the Hub's token answer (see ``token``)
        self.token_wait, self.token_life = 600.0, 3600
        self.tokens_given = self.token_bytes_sent = 0
        self.valid_tokens: set[str] = {"xet-token"}
        self.outage_at_xorb = 0.0  # seconds of outage that the first xorb upload starts (mid-transfer)
        self.posts = 0
        self.resent: list[str] = []  # xorbs uploaded again though the CAS held them
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    # --- what the Hub says about a Xet file --------------------------------------------------------
    def token(self, h: Any) -> None:
        """The Hub's Xet token answer; ``token_answer`` "huge" (200 MB of JSON), "slow" (nothing for
        ``token_wait`` seconds), else a token of ``token_life`` seconds (a new one each time, the
        CAS taking any token it gave out)."""
        with self.lock:
            self.tokens_given += 1
            access = f"xet-token-{self.tokens_given}"
            self.valid_tokens.add(access)
        if self.token_answer == "slow":
            time.sleep(self.token_wait)
        exp = int(time.time()) + self.token_life
        body = json.dumps({"accessToken": access, "exp": exp, "casUrl": f"{self.hub.url}/cas"}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("X-Xet-Cas-Url", f"{self.hub.url}/cas")
        h.send_header("X-Xet-Access-Token", access)
        h.send_header("X-Xet-Token-Expiration", str(exp))
        if self.token_answer == "huge":  # a JSON string of 200 MB, sent a MiB at a time
            filler, n = b"x" * (1 << 20), 200
            head = body[:-1] + b', "pad": "'
            h.send_header("Content-Length", str(len(head) + n * len(filler) + 2))
            h.end_headers()
            try:
                for part in (head, *[filler] * n, b'"}'):
                    h.wfile.write(part)
                    self.token_bytes_sent += len(part)
            except OSError:  # (the client stopped reading: as it should)
                pass
            return
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def register(self, data: bytes, sha: str) -> str:
        """A file the Hub holds in Xet (a source repo's shard): chunked here at fixed 64 KiB into one
        xorb (hf_xet reads any chunking a CAS describes), returned by its (made-up, unique) Xet hash."""
        if sha in self.by_sha:
            return self.by_sha[sha]
        xorb, step = bytearray(), 1 << 16
        for i in range(0, max(1, len(data)), step):
            part = data[i : i + step]
            xorb += (
                bytes([0]) + len(part).to_bytes(3, "little") + bytes([0]) + len(part).to_bytes(3, "little")
            )
            xorb += part
        xhash = hashlib.sha256(b"xorb" + sha.encode()).hexdigest()
        fhash = hashlib.sha256(b"file" + sha.encode()).hexdigest()
        n = len(chunk_spans(bytes(xorb)))
        with self.lock:
            self.xorbs[xhash] = bytes(xorb)
            self.files[fhash] = {"terms": [(xhash, 0, n, len(data))], "sha256": sha, "size": len(data)}
            self.by_sha[sha] = fhash
        return fhash

    # --- the CAS's routes -------------------------------------------------------------------------
    def handle(self, h: Any, method: str, path: str, body: bytes) -> None:
        with self.lock:
            self.requests.append((method, path))
        route = path[len("/cas") :]
        given = h.headers.get("Authorization", "").removeprefix("Bearer ")
        if given not in self.valid_tokens and not route.startswith("/xorb/"):
            return self.hub._error(h, 401, "", "no or a wrong Xet token")
        if method == "POST" and route.startswith(("/v1/xorbs/", "/v1/shards")):
            with self.lock:  # (the Hub's upload faults hold for its CAS too: a dead uplink, every third 500)
                self.posts += 1
                fail = self.dead or self.hub.uplink_dead or (self.hub.upload_faults and self.posts % 3 == 0)
            if fail:
                return self.hub._error(h, 500, "", "Internal Server Error")
        if m := re.fullmatch(r"/v1/xorbs/default/([0-9a-f]{64})", route):
            if self.outage_at_xorb:
                seconds, self.outage_at_xorb = self.outage_at_xorb, 0.0
                self.hub.outage(seconds)
                return self.hub._drop(h)
            if self.refuse:
                return self.hub._error(h, 403, "", "this token may not write to the repo's storage")
            return self._xorb(h, m[1], body)
        if route == "/v1/shards" and method == "POST":
            return self._shard(h, body)
        if m := re.fullmatch(r"/v1/reconstructions/([0-9a-f]{64})", route):
            return self._reconstruction(h, m[1])
        if m := re.fullmatch(r"/xorb/([0-9a-f]{64})", route):
            return self._xorb_range(h, m[1])
        return self.hub._error(h, 404, "", f"no such route: {method} {route}")

    def _xorb(self, h: Any, xhash: str, body: bytes) -> None:
        if self.garbage:
            return self._raw(h, b"<html>not json</html>", "text/html")
        if self.huge:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.end_headers()
            try:
                for _ in range(1 << 14):  # (1 GiB at most, for the test's own sake)
                    h.wfile.write(b" " * 65536)
            except OSError:
                pass
            h.close_connection = True
            return
        spans = chunk_spans(body)
        with self.lock:
            if xhash in self.xorbs:
                self.resent.append(xhash)  # (bytes the CAS already held, sent again)
            self.xorbs[xhash] = body
            self.received["xorbs"] += len(body)
            self.received["chunk_headers"] += 8 * len(spans)
        self._raw(h, json.dumps({"was_inserted": True}).encode())

    def _shard(self, h: Any, body: bytes) -> None:
        try:
            files = parse_shard(body)
        except (struct.error, IndexError) as e:
            return self.hub._error(h, 400, "", f"a malformed shard: {e}")
        for f in files:
            data = self.rebuild(f["terms"])
            if data is None:
                return self.hub._error(h, 400, "", f"file {f['hash']} names a xorb never uploaded")
            sha = hashlib.sha256(data).hexdigest()
            if f["sha256"] and f["sha256"] != sha:
                return self.hub._error(h, 400, "", f"file {f['hash']}: its SHA-256 is not {f['sha256']}")
            with self.lock:
                self.files[f["hash"]] = {"terms": f["terms"], "sha256": sha, "size": len(data)}
                self.by_sha[sha] = f["hash"]
                if sha not in self.hub.blobs:  # (a file's bytes stored, as an LFS PUT would be counted;
                    self.hub.uploads.append(sha)  # a file described again by a shard sends none)
                self.hub.blobs[sha] = data  # (the Hub's commit takes it by SHA-256, as an LFS object)
        with self.lock:
            self.received["shards"] += len(body)
        self._raw(h, json.dumps({"result": 1}).encode())

    def rebuild(self, terms: list[tuple[str, int, int, int]]) -> bytes | None:
        out = bytearray()
        for xhash, start, end, unpacked in terms:
            xorb = self.xorbs.get(xhash)
            if xorb is None:
                return None
            part = b"".join(chunk_bytes(xorb, s) for s in chunk_spans(xorb)[start:end])
            if len(part) != unpacked:
                return None
            out += part
        return bytes(out)

    def _reconstruction(self, h: Any, fhash: str) -> None:
        f = self.files.get(fhash)
        if f is None:
            return self.hub._error(h, 404, "", f"no file {fhash}")
        terms, fetch = [], {}
        for xhash, start, end, unpacked in f["terms"]:
            spans = chunk_spans(self.xorbs[xhash])
            first, last = spans[start], spans[end - 1]
            terms.append({"hash": xhash, "unpacked_length": unpacked, "range": {"start": start, "end": end}})
            fetch.setdefault(xhash, []).append(
                {
                    "range": {"start": start, "end": end},
                    "url": f"{self.hub.url}/cas/xorb/{xhash}",
                    "url_range": {"start": first[0], "end": last[0] + 8 + last[1] - 1},
                }
            )
        self._raw(h, json.dumps({"offset_into_first_range": 0, "terms": terms, "fetch_info": fetch}).encode())

    def _xorb_range(self, h: Any, xhash: str) -> None:
        xorb = self.xorbs.get(xhash)
        if xorb is None:
            return self.hub._error(h, 404, "", f"no xorb {xhash}")
        r = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range", ""))
        a, b = (int(r[1]), int(r[2])) if r else (0, len(xorb) - 1)
        part = xorb[a : b + 1]
        h.send_response(206 if r else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(part)))
        if r:
            h.send_header("Content-Range", f"bytes {a}-{a + len(part) - 1}/{len(xorb)}")
        h.end_headers()
        h.wfile.write(part)

    def _raw(self, h: Any, body: bytes, kind: str = "application/json") -> None:
        h.send_response(200)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
