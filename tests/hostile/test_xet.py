"""Uploads through Xet held to k3lab's guarantees, against the loopback CAS (``xet_cas``): hf_xet's own
client, driven by ``hub.xet.send``, counted to the byte, cut at the minimum rate, inside the retry
budget, stopped by SIGTERM and Ctrl-C with nothing committed, its errors one line; republishing after
one tensor changed sends about that tensor's chunks. And the LFS path's answer wait: a small body the
socket takes whole, read too slowly by the server, still fails in bounded time."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hub_server import HubServer
from xet_cas import chunk_spans

from k3lab.errors import K3LabError
from k3lab.pipeline.hub.retry import HubUnreachable
from k3lab.pipeline.hub.xet import XetRefused
from k3lab.pipeline.progress import TaskReport
from k3lab.pipeline.publishing.upload import PushTarget, upload

pytest.importorskip("hf_xet")
TARGET, TOKEN = "k3lab-test/xet-target", "hf_xet_secret_0123456789"


def _repo(hub: HubServer) -> None:
    from huggingface_hub import HfApi

    HfApi(endpoint=hub.url, token=TOKEN).create_repo(TARGET, exist_ok=True)


def _file(tmp: Path, n: int = 3_000_000, seed: int = 0) -> Path:
    path = tmp / f"f{seed}.gguf"
    path.write_bytes(np.random.default_rng(seed).bytes(n))
    return path


def _send(hub: HubServer, path: Path, budget: float = 30.0) -> tuple[object, list[int]]:
    counted: list[int] = []
    report = TaskReport(emit=lambda m: counted.append(m[2]) if m[0] == "up" else None)
    target = PushTarget(TARGET, endpoint=hub.url, token=TOKEN, retry_budget=budget)
    return upload(target, path, report, hashlib.sha256(path.read_bytes()).hexdigest()), counted


@pytest.fixture
def xet_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "xet-cache"))  # (its shard cache: this test's own)
    monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    return tmp_path


def test_a_xet_upload_is_counted_to_the_byte_and_committed_by_its_sha256(
    xet_env: Path, tiny_src: Path
) -> None:
    path = _file(xet_env)
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        op, counted = _send(hub, path)
        sent = hub.cas.received
        # k3lab counted what hf_xet sent: every chunk's bytes (their 8-byte headers are the CAS's
        # framing, not counted by hf_xet) and the shard
        assert sum(counted) == sent["xorbs"] - sent["chunk_headers"] + sent["shards"], (counted, sent)
        assert sent["xorbs"] >= path.stat().st_size  # (random bytes: nothing to deduplicate or compress)
        assert op.upload_info.sha256.hex() == hashlib.sha256(path.read_bytes()).hexdigest()
        assert hub.blobs[op.upload_info.sha256.hex()] == path.read_bytes()
        assert not any("/lfs-upload/" in p for _, p, _ in hub.requests)  # (the LFS path not taken)


def test_a_trickling_cas_fails_within_one_window(xet_env: Path, tiny_src: Path, monkeypatch) -> None:
    monkeypatch.setenv("K3LAB_SPEED_LIMIT", "100000/2")
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        hub.cas.trickle = True
        t0 = time.monotonic()
        with pytest.raises(HubUnreachable) as e:
            _send(hub, _file(xet_env), budget=0)
        took = time.monotonic() - t0
    assert "below the minimum rate" in str(e.value) and "\n" not in str(e.value), e.value
    assert took < 2 + 3, took  # one window, and the time to start and abort the transfer


def test_a_dead_cas_fails_within_the_retry_budget(xet_env: Path, tiny_src: Path, monkeypatch) -> None:
    monkeypatch.setenv("K3LAB_SPEED_LIMIT", "100000/5")
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        hub.cas.dead = True
        t0 = time.monotonic()
        with pytest.raises(HubUnreachable) as e:
            _send(hub, _file(xet_env), budget=4)
        took = time.monotonic() - t0
    assert "retry budget 4 s" in str(e.value) and "\n" not in str(e.value), e.value
    assert took < 4 + 5 + 5, took  # the budget, then one attempt's own retries and a window at most


@pytest.mark.parametrize("when", ["before", "mid-transfer"])
def test_a_cas_outage_shorter_than_the_budget_is_ridden_out(xet_env: Path, tiny_src: Path, when: str) -> None:
    """The Hub and its CAS unreachable for 3 s, from before the upload starts or from its first xorb
    on (that xorb's connection dropped): the upload rides it out and the CAS holds the file's bytes."""
    path = _file(xet_env)
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        if when == "before":
            hub.outage(3)
        else:
            hub.cas.outage_at_xorb = 3.0
        op, _ = _send(hub, path, budget=60)
        assert hub.blobs[op.upload_info.sha256.hex()] == path.read_bytes()
        assert hub.dropped > 0 and not hub.cas.outage_at_xorb  # (the outage was met)


def test_a_cas_that_refuses_is_one_line_at_once(xet_env: Path, tiny_src: Path) -> None:
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        hub.cas.refuse = True
        t0 = time.monotonic()
        with pytest.raises(XetRefused) as e:
            _send(hub, _file(xet_env, 300_000), budget=60)
        took = time.monotonic() - t0
    assert "refused" in str(e.value) and "\n" not in str(e.value), e.value
    assert took < 30, took  # (not the budget: a refusal is not retried by k3lab)


def test_a_huge_token_answer_is_cut_at_k3labs_bound(xet_env: Path, tiny_src: Path) -> None:
    """The Hub's Xet token answered with 200 MB: k3lab fetches the token (hf_xet never does), so the
    answer is read to k3lab's bound on any Hub answer and no further; one line, nothing uploaded."""
    from k3lab.pipeline.hub.bounds import API_LIMIT

    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        hub.cas.token_answer = "huge"
        with pytest.raises(K3LabError) as e:
            _send(hub, _file(xet_env, 300_000), budget=10)
        sent, posts = hub.cas.token_bytes_sent, hub.cas.posts
    assert "\n" not in str(e.value) and "longer than the 16777216 bytes" in str(e.value), e.value
    assert sent < API_LIMIT + (16 << 20), sent  # (what the sockets' buffers took besides the bound)
    assert posts == 0


def test_a_slow_token_answer_is_given_up_within_the_budget(xet_env: Path, tiny_src: Path) -> None:
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        hub.cas.token_answer, hub.cas.token_wait = "slow", 120.0
        t0 = time.monotonic()
        with pytest.raises(HubUnreachable) as e:
            _send(hub, _file(xet_env, 300_000), budget=8)
        took = time.monotonic() - t0
    assert "retry budget 8 s" in str(e.value) and "\n" not in str(e.value), e.value
    assert took < 8 + 2 + 5, took  # the budget, then one request's wait (a quarter of it) at most


def test_hf_xet_refreshes_its_token_through_k3lab(xet_env: Path, tiny_src: Path, monkeypatch) -> None:
    """Tokens that expire at once: hf_xet asks for new ones, from k3lab's loopback route, which fetches
    each from the Hub itself: every token request the Hub sees is one k3lab made; the upload completes."""
    from k3lab.pipeline.hub import xet, xet_token

    fetched: list[str] = []
    real = xet_token.fetch_token

    def counted(*args, **kwargs):
        fetched.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(xet_token, "fetch_token", counted)
    monkeypatch.setattr(xet, "fetch_token", counted)
    path = _file(xet_env)
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        hub.cas.token_life = 1
        op, _ = _send(hub, path, budget=60)
        assert hub.blobs[op.upload_info.sha256.hex()] == path.read_bytes()
        asked = len(hub.token_requests)
    assert asked >= 2 and asked == len(fetched), (asked, fetched)  # the seed, then the refreshes


def test_hf_xets_errors_are_classified_by_kind() -> None:
    """Each kind hf_xet raises: its authentication and not-found errors and a status it names are
    refusals; a network error, a timeout or anything else is ridden out."""
    import hf_xet

    from k3lab.pipeline.hub.retry import is_transient
    from k3lab.pipeline.hub.xet import classify

    refusals = [
        hf_xet.XetAuthenticationError("token expired"),
        hf_xet.XetObjectNotFoundError("xorb"),
        RuntimeError("HTTP status client error (403 Forbidden) for url (http://cas/v1/xorbs/default/ab)"),
        RuntimeError("Data processing error: status client error (401 Unauthorized)"),
    ]
    transient = [
        RuntimeError("File reconstruction error: Internal Error: connection reset"),
        ConnectionError("error sending request for url"),
        OSError("timed out"),
        RuntimeError(
            "HTTP status server error (500 Internal Server Error) for url (http://cas/v1/xorbs/default/a4040b)"
        ),
    ]
    for e in refusals:
        out = classify(e, "repo: f.gguf")
        assert isinstance(out, XetRefused) and "\n" not in str(out), (e, out)
    for e in transient:
        out = classify(e, "repo: f.gguf")
        assert not isinstance(out, XetRefused) and is_transient(out), (e, out)


@pytest.mark.parametrize("answer", ["garbage", "huge"])
def test_a_malformed_or_endless_cas_answer_is_one_line(
    xet_env: Path, tiny_src: Path, monkeypatch, answer
) -> None:
    monkeypatch.setenv("K3LAB_SPEED_LIMIT", "100000/2")
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        setattr(hub.cas, answer, True)
        t0 = time.monotonic()
        with pytest.raises(K3LabError) as e:
            _send(hub, _file(xet_env, 300_000), budget=3)
        took = time.monotonic() - t0
    text = str(e.value)
    assert "\n" not in text and len(text) < 700 and TARGET in text, text
    assert took < 3 + 2 + 5, took


def test_republishing_after_one_tensor_changed_sends_about_its_chunks(
    xet_env: Path, tiny_src: Path, tiny_out: Path
) -> None:
    """A GGUF of the tiny set published, then the same file with one tensor's bytes changed: the CAS
    receives the chunks holding that tensor (hf_xet's content-defined chunks, deduplicated against
    this machine's shard cache), at most 1.2x their bytes, plus the shard's metadata."""
    from gguf import GGUFReader

    name = max((p for p in tiny_out.glob("Kimi-K3-*.gguf")), key=lambda p: p.stat().st_size)
    first = xet_env / name.name
    first.write_bytes(name.read_bytes())
    tensor = min(GGUFReader(first).tensors, key=lambda t: abs(int(t.n_bytes) - 100_000))  # (a few chunks)
    start, n = int(tensor.data_offset), int(tensor.n_bytes)
    with HubServer(tiny_src, token=TOKEN) as hub:
        _repo(hub)
        _send(hub, first)
        before = dict(hub.cas.received)
        data = bytearray(first.read_bytes())
        data[start : start + n] = np.random.default_rng(7).bytes(n)
        second = xet_env / "second" / name.name
        second.parent.mkdir()
        second.write_bytes(bytes(data))
        op, _ = _send(hub, second)
        sent = {k: hub.cas.received[k] - before[k] for k in before}
        terms = hub.cas.files[hub.cas.by_sha[op.upload_info.sha256.hex()]]["terms"]
        lengths = [s[3] for x, a, b, _ in terms for s in chunk_spans(hub.cas.xorbs[x])[a:b]]
    ends = np.cumsum(lengths)
    starts = ends - np.asarray(lengths)
    changed = int(sum(e - s for s, e in zip(starts, ends) if s < start + n and e > start))
    chunk_bytes = sent["xorbs"] - sent["chunk_headers"]
    print(
        f"\nrepublish of {name.name} ({len(data)} bytes) after one tensor ({n} bytes) changed: "
        f"{chunk_bytes} chunk bytes sent for {changed} bytes of changed chunks "
        f"({chunk_bytes / changed:.2f}x), shard {sent['shards']} bytes"
    )
    assert 0 < chunk_bytes <= 1.2 * changed, (chunk_bytes, changed)
    assert chunk_bytes < len(data) / 2


# (Ctrl-C slow: SIGTERM takes the same path, and Ctrl-C of a publishing Dask client is in the default run)
@pytest.mark.parametrize("how", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_sigterm_and_ctrl_c_stop_a_xet_upload_within_2_s_and_commit_nothing(
    tiny_out: Path, tiny_src: Path, tmp_path: Path, how: signal.Signals
) -> None:
    """`k3lab publish` of the tiny set to a CAS whose uplink carries 20 kB/s: stopped once its uploads
    are under way, it ends within 2 s, and the repo gets no commit of any GGUF."""
    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.uplink = 20_000
        env = hub.client_env(tmp_path, TOKEN)
        run = subprocess.Popen(
            [sys.executable, "-m", "k3lab.cli", "publish", str(out), TARGET],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Ctrl-C as a terminal gives it (the test runner may ignore SIGINT: a child would inherit that)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        until = time.monotonic() + 60
        while time.monotonic() < until and not any(p.startswith("/cas/v1/") for _, p in hub.cas.requests):
            if run.poll() is not None:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # (a xorb on its way)
        assert run.poll() is None, run.communicate()
        t0 = time.monotonic()
        run.send_signal(how)
        run.communicate(timeout=30)
        took = time.monotonic() - t0
        commits = [paths for repo, _, paths in hub.commit_log if repo == TARGET]
        time.sleep(1.0)
        late = [p for _, p in hub.cas.requests if p.startswith("/cas/v1/shards")]
    assert run.returncode != 0
    assert took < 2.0, took
    assert not any(p.endswith(".gguf") for paths in commits for p in paths), commits
    assert not late, late  # (no file's upload finished after the stop)


def test_a_small_lfs_upload_read_too_slowly_fails_in_bounded_time(
    tiny_src: Path, tmp_path: Path, monkeypatch
) -> None:
    """The LFS path: a body far smaller than the socket's buffers (the kernel takes it whole at once),
    a server that reads it at 2 kB/s: the answer's wait is bounded by a window plus the time the body
    needs at the minimum rate, and huggingface_hub does not retry it outside the budget."""
    from huggingface_hub import constants

    monkeypatch.setenv("K3LAB_SPEED_LIMIT", "16384/2")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # (HF_HUB_DISABLE_XET=1, read at import)
    with HubServer(tiny_src, token=TOKEN, xet=False) as hub:
        _repo(hub)
        hub.uplink = 2_000
        path = _file(tmp_path, 40_000)
        t0 = time.monotonic()
        with pytest.raises(HubUnreachable) as e:
            _send(hub, path, budget=2)
        took = time.monotonic() - t0
    assert "no answer" in str(e.value) or "below the minimum rate" in str(e.value), e.value
    # two attempts at most (each: a window, plus 40 kB at 16 kB/s), never huggingface_hub's six
    assert took < 2 * (2 + 40_000 / 16384) + 2 + 3, took
