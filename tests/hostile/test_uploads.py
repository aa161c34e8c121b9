"""Uploads under the same rules as downloads (#37): a PUT to an uplink that trickles fails at the
minimum rate's window (never waits as long as a byte still moves), a dead uplink ends the run within
the retry budget while downloads work (exit 1, finished files kept, the rerun finishes the set
byte-identical), and a README.md a collaborator commits during a run is theirs at the end."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import PER_LAYER
from hub_server import HubServer

SOURCE = "moonshotai/Kimi-K3"
TARGET = "k3lab-test/Kimi-K3-GGUF"
TOKEN = "hf_uploads_secret_0123456789"


def _trickle_server(stop: threading.Event) -> int:
    """A server that takes a request body at ~20 bytes a second and never answers."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.settimeout(0.5)
        while not stop.is_set():
            try:
                if not conn.recv(20):
                    break
            except (TimeoutError, OSError):
                pass
            time.sleep(1.0)
        conn.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def test_a_put_to_a_trickling_uplink_fails_at_the_rate_window(monkeypatch) -> None:
    """huggingface_hub's client as k3lab gives it (``transport.install``), K3LAB_SPEED_LIMIT at
    100 kB over 2 s: the PUT of 64 MB fails with TooSlowUp once a window carried less than that
    (a plain write would wait on, each send moving a few bytes)."""
    from huggingface_hub.utils import get_session

    from k3lab.pipeline.hub import transport

    monkeypatch.setenv("K3LAB_SPEED_LIMIT", "100000/2")
    transport.install()
    stop = threading.Event()
    port = _trickle_server(stop)
    failed: list[BaseException] = []

    def put() -> None:
        try:
            get_session().put(f"http://127.0.0.1:{port}/lfs-upload/x", content=b"\0" * (64 << 20))
        except BaseException as e:  # noqa: BLE001 (collected for the assertion)
            failed.append(e)

    t = threading.Thread(target=put, daemon=True)
    t.start()
    t.join(60)
    stop.set()
    assert failed, "the PUT went on past any bound"
    assert isinstance(failed[0], transport.TooSlowUp) and "below the minimum rate" in str(failed[0]), failed


# the CLI with huggingface_hub retrying a PUT once rather than five times (~23 s of its own waits
# per attempt): only to keep the test short; k3lab's budget counts those retries either way
QUICK_PUTS = (
    "import functools, sys, huggingface_hub.lfs as lfs; "
    "lfs.http_backoff = functools.partial(lfs.http_backoff, max_retries=1, base_wait_time=0.2); "
    "from k3lab.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _push_args(tmp: Path) -> list[str]:
    """`convert` from the loopback Hub, a layer per file, each published to TARGET."""
    out = ["convert", "--repo", SOURCE, "--meta", str(tmp / "meta"), "--out-dir", str(tmp / "out")]
    return [*out, *PER_LAYER, "--push-to", TARGET, "--quiet"]


def _push(hub: HubServer, tmp: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = hub.client_env(tmp, TOKEN) | {"K3LAB_SPEED_LIMIT": "1000/2"}
    return subprocess.run(
        [sys.executable, "-c", QUICK_PUTS, *_push_args(tmp), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_dead_uplink_ends_within_the_budget_and_the_rerun_finishes(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """Every PUT answers 500 (downloads, the API and commits work): exit 1 within the budget
    (huggingface_hub's own retries of each PUT counted in it), every finished file kept; the rerun,
    the uplink back, uploads them and the repo holds the set, byte-identical."""
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.uplink_dead = True
        t0 = time.monotonic()
        dead = _push(hub, tmp_path, "--retry-budget", "2")
        took = time.monotonic() - t0
        assert dead.returncode == 1, dead.stderr[-2000:]
        lines = dead.stderr.strip().splitlines()
        assert lines and all(line.startswith("k3lab: error: ") for line in lines), lines
        assert any("the Hub kept failing" in line and "retry budget 2 s" in line for line in lines), lines
        assert took < 60, took
        kept = sorted(p.name for p in (tmp_path / "out").glob("Kimi-K3-*.gguf"))
        assert kept and all((tmp_path / "out" / n).read_bytes() == (tiny_out / n).read_bytes() for n in kept)
        hub.uplink_dead = False
        again = _push(hub, tmp_path)
        assert again.returncode == 0, again.stderr[-2000:]
        files = hub.files_of(TARGET)
    for p in tiny_out.glob("Kimi-K3-*.gguf"):
        assert files[p.name] == p.read_bytes(), p.name


def test_a_readme_a_collaborator_commits_during_the_run_is_kept(tiny_src: Path, tmp_path: Path) -> None:
    """The card goes in at the run's last commit; the repo's README.md, committed by someone else
    after the run began, is theirs: kept, and the run says nothing false about it."""
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.throttle = 1_000_000  # (the run goes on for seconds after its first upload)
        run = subprocess.Popen(
            [sys.executable, "-m", "k3lab.cli", *_push_args(tmp_path)],
            env=hub.client_env(tmp_path, TOKEN),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while TARGET not in hub.repos or not hub.uploads:
            time.sleep(0.05)
            assert run.poll() is None, run.communicate()
        theirs = b"# Our notes on this set\n\nWritten by a collaborator while the run was going.\n"
        hub._new_commit({**hub.files_of(TARGET), "README.md": theirs}, "our README", TARGET)
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        files = hub.files_of(TARGET)
    assert files["README.md"] == theirs
    assert "TENSOR_MAP.md" in files and any(
        re.fullmatch(r"Kimi-K3-MXFP4-00001-of-\d{5}\.gguf", n) for n in files
    )


@pytest.mark.parametrize("moved", [1, 2])
def test_a_branch_that_moves_between_read_and_commit_is_read_again(
    tiny_src: Path, tmp_path: Path, moved: int, monkeypatch
) -> None:
    """The Hub refuses a commit made on an old head (412): the committer reads the branch again
    and commits on the new head (the collaborator's file kept)."""
    from k3lab.pipeline.publishing import publish
    from k3lab.pipeline.publishing.upload import PushTarget

    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.check_cards = False  # (a card of one line: its metadata is not what this tests)
        for k, v in hub.client_env(tmp_path, TOKEN).items():
            monkeypatch.setenv(k, v)
        target = PushTarget(TARGET, endpoint=hub.url, token=TOKEN, retry_budget=30.0)
        state = publish.open_target(target, {})
        committer = publish.Committer(target, state)
        real = publish.read_repo
        calls = []

        def racing(t: PushTarget) -> publish.RepoState:
            fresh = real(t)
            calls.append(1)
            if len(calls) <= moved:  # someone commits right after each read
                hub._new_commit({**hub.files_of(TARGET), f"notes-{len(calls)}.md": b"x"}, "notes", TARGET)
            return fresh

        monkeypatch.setattr(publish, "read_repo", racing)
        commit = committer.commit({"README.md": b"# card\n"}, "k3lab: the whole set")
        files = hub.files_of(TARGET)
    assert commit and len(calls) == moved + 1
    assert files["README.md"] == b"# card\n" and all(f"notes-{k}.md" in files for k in range(1, moved + 1))
