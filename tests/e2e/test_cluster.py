"""Streaming on a real cluster: a `dask scheduler` and two `dask worker`s started from the command line,
a loopback Hub that keeps commits, throttles and goes down, and the client as a user runs it (a
subprocess, signals and all). What must hold: a set is all from one commit; a changed shard redoes its
file only; an outage is ridden out; Ctrl-C stops every task (nothing written after the client exits);
a killed download is cleaned up; --quiet is quiet."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PER_LAYER
from dask_helpers import dask_cluster, wait_workers
from hub_server import HubServer

REPO = "moonshotai/Kimi-K3"
# huggingface_hub writes 10 MB chunks; with 64 KiB ones a cut in a 400 KB test shard is resumed from
# the middle, and a throttled download reports progress, as a 16 GB shard's does
LAUNCHER = (
    "import sys, huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 65536; "
    "from k3lab.cli import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scheduler and two single-threaded workers, as a user starts them; yields the address."""
    with dask_cluster(tmp_path_factory.mktemp("cluster")) as (address, _):
        yield address


def _env(hub: HubServer, tmp: Path) -> dict[str, str]:
    return hub.client_env(tmp)


def _start(hub: HubServer, tmp: Path, *extra: str) -> subprocess.Popen:
    """The client as a user runs it from a terminal, in the background of the test. With SIGINT as a
    terminal leaves it: a test runner started in the background by a script without job control
    (`make test &`, as CI may) passes SIGINT on ignored, and the client would then rightly ignore a
    Ctrl-C (the cause of both Ctrl-C tests' rare exit 0 with nothing said)."""
    return subprocess.Popen(
        _args(tmp, *extra),
        env=_env(hub, tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _signal(run: subprocess.Popen, sig: signal.Signals) -> None:
    """``sig`` to a run that is still going (one that had finished would prove nothing)."""
    assert run.poll() is None, f"the run ended (exit {run.returncode}) before the signal: slow it down"
    run.send_signal(sig)


def _args(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", LAUNCHER, "convert", "--repo", REPO, "--meta", str(tmp / "meta")] + [
        "--out-dir",
        str(tmp / "out"),
        "--scratch",
        str(tmp / "scratch"),
        *PER_LAYER,  # a layer per file: a task each on the cluster
        *extra,
    ]


def _convert(hub: HubServer, tmp: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        _args(tmp, *extra), env=_env(hub, tmp), capture_output=True, text=True, timeout=timeout
    )


def _snapshot(out: Path) -> dict[str, tuple[int, int, int]]:
    """Every file in the folder (state included): inode, size, mtime."""
    found = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            st = p.stat()
            found[str(p.relative_to(out))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return found


def _tampered(data: bytes) -> bytes:
    raw = bytearray(data)
    raw[-3] ^= 0xFF  # the last tensor's last bytes: the header (and so the plan) stays the same
    return bytes(raw)


def _local_set(src: Path, out: Path) -> Path:
    from conftest import convert

    assert convert(src, out) == 0
    return out


def test_one_commit_per_set_while_the_repo_moves(
    cluster: str, tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """The repo moves during a run: every file is still the first commit's. It moves again after:
    an explicit --revision of the old commit keeps the set; the branch redoes exactly the changed
    shard's file, with the new bytes, and says so."""
    index = json.loads((tiny_src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["language_model.model.layers.2.input_layernorm.weight"]
    with HubServer(tiny_src) as hub:
        hub.throttle = 400_000
        first = hub.head
        run = _start(hub, tmp_path, "--scheduler", cluster, "--quiet")
        while not hub.downloads():
            time.sleep(0.05)  # the first shard download: planning is over
        moved = hub.commit({shard: _tampered(hub.file(shard))}, "change a shard mid-run")
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        for f in sorted(tiny_out.glob("*.gguf")):
            assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
        shard_gets = {r[1].split("/resolve/")[1].split("/")[0] for r in hub.requests if "/resolve/" in r[1]}
        assert shard_gets == {first}, shard_gets  # every download at the planned commit
        manifest = json.loads((tmp_path / "out" / "MANIFEST.json").read_text())
        served = {r["sources"][0]["file"]: r["sources"][0]["sha256"] for r in manifest["files"]}
        import hashlib

        assert served[shard] == hashlib.sha256((tiny_src / shard).read_bytes()).hexdigest()

        before = _snapshot(tmp_path / "out")
        pinned = _convert(hub, tmp_path, "--revision", first, "--scheduler", cluster)
        assert pinned.returncode == 0, pinned.stderr[-3000:]
        assert "0 written, 9 already complete" in pinned.stdout
        assert {k: v for k, v in _snapshot(tmp_path / "out").items() if k.endswith(".gguf")} == {
            k: v for k, v in before.items() if k.endswith(".gguf")
        }

        again = _convert(hub, tmp_path, "--scheduler", cluster)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "1 written, 8 already complete" in again.stdout, again.stdout
        assert f"the source moved (commit {first[:12]} -> {moved[:12]})" in again.stderr, again.stderr
        redone = [f for f in manifest["files"] if f["sources"][0]["file"] == shard][0]["file"]
        assert f"1 of 9 output files change ({redone.split('-')[-3].lstrip('0')})" in again.stderr
        after = _snapshot(tmp_path / "out")
        for name, st in before.items():
            if name.endswith(".gguf") and name != redone:
                assert after[name] == st, name  # kept: the same inode, size and time
        assert after[redone] != before[redone]
    # the redone file is the new commit's conversion
    changed = tmp_path / "changed-src"
    changed.mkdir()
    for p in tiny_src.iterdir():
        (changed / p.name).symlink_to(p)
    (changed / shard).unlink()
    (changed / shard).write_bytes(_tampered((tiny_src / shard).read_bytes()))
    local = _local_set(changed, tmp_path / "local")
    assert (tmp_path / "out" / redone).read_bytes() == (local / redone).read_bytes()
    assert (tmp_path / "out" / redone).read_bytes() != (tiny_out / redone).read_bytes()


@pytest.mark.slow  # (over a minute on CI's 2 cores: `make test-slow`)
def test_a_minute_of_outage_is_ridden_out(
    cluster: str, tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """The Hub unreachable for 60 s in the middle of a Dask run: huggingface_hub gives up on its own
    ("cannot find the requested files in the local cache") long before; k3lab's budget rides it out
    and the set is byte-identical."""
    with HubServer(tiny_src, faults=True) as hub:
        hub.throttle = 300_000
        run = _start(hub, tmp_path, "--scheduler", cluster, "--quiet")
        while len(hub.downloads()) < 3:
            time.sleep(0.05)
        hub.outage(60)
        hub.throttle = None  # (only so that downloads were in flight when it began)
        t0 = time.monotonic()
        out, err = run.communicate(timeout=900)
        assert time.monotonic() - t0 > 55  # it did wait the outage out
    assert run.returncode == 0, err[-3000:]
    assert err == "" and out.count("\n") == 1, (out, err)  # --quiet: the summary line only
    assert hub.dropped > 0
    for f in sorted(tiny_out.glob("*.gguf")):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    assert not list((tmp_path / "scratch").iterdir())


@pytest.mark.slow  # (20 s; the budget's arithmetic is test_retry's, a dead uplink's test_uploads')
def test_an_outage_longer_than_the_budget_lists_every_failed_file(tiny_src: Path, tmp_path: Path) -> None:
    """Past --retry-budget: exit 1 (the network's fault, not the input's), every file that failed
    listed, no new file begun (each would spend a budget), and how to resume; a rerun once the Hub
    is back finishes the set."""
    with HubServer(tiny_src) as hub:
        hub.throttle = 2_000_000
        run = _start(hub, tmp_path, "--retry-budget", "4", "--quiet", "--shards", "2-9", "--jobs", "2")
        while not hub.downloads():
            time.sleep(0.02)
        hub.outage(3600)
        out, err = run.communicate(timeout=300)
        assert run.returncode == 1, err
        lines = err.strip().splitlines()
        assert all(line.startswith("k3lab: error: ") for line in lines), lines
        failed = [line for line in lines if "output file " in line and "the Hub kept failing" in line]
        # those in flight (and the pool's queue) fail; no more are begun (each would spend a budget)
        assert 2 <= len(failed) < 8 and len(lines) == len(failed) + 1, lines
        assert f"{len(failed)} of 8 output files failed, {8 - len(failed)} not attempted; " in lines[-1]
        assert "finished files are kept: run the same command again" in lines[-1]
        hub.outage(0)
        again = _convert(hub, tmp_path, "--quiet", "--shards", "2-9")
        assert again.returncode == 0, again.stderr
    assert len(list((tmp_path / "out").glob("*.gguf"))) == 8
    assert not list((tmp_path / "scratch").iterdir())


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],  # (SIGTERM: `make test-slow`)
)
def test_stopping_the_client_stops_every_task(
    cluster: str, tiny_src: Path, tiny_out: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C (or SIGTERM) on the client while tasks download and convert on the workers: exit
    130/143, and nothing in the output folder changes afterwards (no file renamed, no .partial); an
    immediate rerun is byte-identical."""
    with HubServer(tiny_src) as hub:
        hub.throttle = 150_000
        run = _start(hub, tmp_path, "--scheduler", cluster, "--quiet")
        while len({p for p, _ in hub.downloads()}) < 3:
            time.sleep(0.05)  # both workers busy, one file done or nearly
        _signal(run, sig)
        out, err = run.communicate(timeout=120)
        assert run.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], err
        at_exit = _snapshot(tmp_path / "out")
        time.sleep(4)  # a task that went on would write within this
        assert _snapshot(tmp_path / "out") == at_exit
        assert not list((tmp_path / "out").glob("*.partial"))
        written = [n for n in at_exit if n.endswith(".gguf")]
        assert len(written) < 9
        hub.throttle = None
        again = _convert(hub, tmp_path, "--scheduler", cluster, "--quiet")
        assert again.returncode == 0, again.stderr
    for f in sorted(tiny_out.glob("*.gguf")):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.slow  # (26 s on CI's 2 cores)
def test_a_killed_download_is_removed_by_the_next_task(
    cluster: str, tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """A worker process killed (SIGKILL) mid-download: the nanny restarts it, the shard is done again
    and the killed download's slot is gone; a slot a live process holds is never touched."""
    import psutil

    (tmp_path / "scratch").mkdir()
    holder = subprocess.Popen(  # another live process's download in the same scratch
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
            str(tmp_path / "scratch" / ("k3lab-dl-" + "a" * 32 + ".lock")),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    (tmp_path / "scratch" / ("k3lab-dl-" + "a" * 32)).mkdir()
    (tmp_path / "scratch" / ("k3lab-dl-" + "a" * 32) / "busy.incomplete").write_bytes(b"x" * 100)
    try:
        with HubServer(tiny_src) as hub:
            hub.throttle = 100_000
            run = _start(hub, tmp_path, "--scheduler", cluster, "--quiet")
            victim = None
            deadline = time.monotonic() + 120
            while victim is None and time.monotonic() < deadline:  # a worker half way into a download
                for p in psutil.process_iter(["cmdline"]):
                    try:
                        if not any("incomplete" in f.path for f in p.open_files()):
                            continue
                    except (psutil.Error, OSError):
                        continue
                    partial = [f.path for f in p.open_files() if f.path.endswith(".incomplete")]
                    if partial and p.pid not in (holder.pid, run.pid):  # a worker's, not the client's
                        victim, victim_slot = p, Path(partial[0])
                        break
                time.sleep(0.05)
            assert victim is not None
            victim_slot = next(p for p in victim_slot.parents if p.name.startswith("k3lab-dl-"))
            victim.kill()
            out, err = run.communicate(timeout=600)
            assert run.returncode == 0, err[-3000:]
        assert not victim_slot.exists()  # removed (and the shard downloaded afresh)
        left = sorted(p.name for p in (tmp_path / "scratch").iterdir())
        assert left == ["k3lab-dl-" + "a" * 32, "k3lab-dl-" + "a" * 32 + ".lock"], left  # the live one's
        for f in sorted(tiny_out.glob("*.gguf")):
            assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    finally:
        holder.kill()
        wait_workers(cluster, 2)


def test_a_download_that_is_not_the_listed_bytes_is_refused(tiny_src: Path, tmp_path: Path) -> None:
    """The Hub lists a shard's SHA-256 and serves other bytes: one line naming the file, exit 2, the
    download discarded, no output file."""
    index = json.loads((tiny_src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["language_model.model.layers.2.input_layernorm.weight"]
    with HubServer(tiny_src) as hub:
        hub.corrupt.add(shard)
        r = _convert(hub, tmp_path, "--quiet")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and shard in lines[0] and "not the ones the Hub lists" in lines[0], lines
    assert len(list((tmp_path / "out").glob("*.gguf"))) == 8  # the others are done
    assert not list((tmp_path / "scratch").iterdir())


@pytest.mark.slow  # (the bar's own test; the cluster's work is covered by the others)
def test_one_byte_bar_moves_while_the_cluster_works(cluster: str, tiny_src: Path, tmp_path: Path) -> None:
    """On Dask, the bar counts source bytes as the workers convert them (not 0% until the end), shows
    the download, never passes its total, and huggingface_hub draws nothing of its own."""
    code = (
        "import sys, huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 65536\n"
        "from k3lab.kimi_k3.model import MODEL\n"
        "from k3lab.pipeline.sources.hub import hub_spec\n"
        "from k3lab.pipeline.running.runner import convert_shards\n"
        "import os\n"
        "spec = hub_spec(sys.argv[1], 'moonshotai/Kimi-K3', scratch=sys.argv[3], endpoint=os.environ['HF_ENDPOINT'],"
        " meta_files=MODEL.meta_files, optional_meta=MODEL.optional_meta)\n"
        "convert_shards(MODEL, spec, sys.argv[2], quiet=None, scheduler=sys.argv[4])\n"
    )
    with HubServer(tiny_src, faults=True) as hub:
        hub.throttle = 400_000
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                str(tmp_path / "meta"),
                str(tmp_path / "out"),
                str(tmp_path / "s"),
                cluster,
            ],
            env=_env(hub, tmp_path),
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert r.returncode == 0, r.stderr[-3000:]
    import re

    frames = [f for f in re.split(r"[\r\n]", r.stderr) if f.strip()]
    percents = [int(m[1]) for f in frames if (m := re.search(r"(\d+)%\|", f))]
    assert any(0 < p < 100 for p in percents), frames[:20]
    assert percents[-1] == 100 and max(percents) == 100
    assert percents == sorted(percents)  # never back, never past the total
    assert any("down " in f and "/s" in f for f in frames)
    assert not any(".safetensors:" in f for f in frames)  # no huggingface_hub bar of its own
    assert not any("Trying to resume" in f or "Error while downloading" in f for f in frames)


@pytest.mark.slow  # (16 s; a pipelining property, also measured by the benchmarks)
def test_a_worker_is_a_pipeline_within_its_disk_budget(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """One single-threaded worker publishing with an uplink far slower than its downlink: its next
    shards download and convert while files upload (the stages overlap), yet its own folders never
    hold more than two source shards and two output files (the budget the README gives per thread),
    and the published set is byte-identical to a local conversion."""
    with HubServer(tiny_src) as hub, dask_cluster(tmp_path, workers=1) as (address, dirs):
        hub.uplink = 400_000  # bytes/s: each file's upload takes about a second, downloads none
        run = _start(hub, tmp_path, "--scheduler", address, "--push-to", "k3lab-test/pipe", "--text-only")
        most = {"sources": 0, "outputs": 0, "both": 0}
        while run.poll() is None:
            k3 = list(dirs[0].glob("**/k3lab"))  # (<local directory>/dask-scratch-space/worker-*/k3lab)
            outputs = len(
                [p for d in k3 for p in d.glob("out-*/*") if p.name.endswith((".gguf", ".partial"))]
            )
            sources = len([p for d in k3 for p in d.glob("scratch/k3lab-dl-*/*") if ".safetensors" in p.name])
            most["sources"], most["outputs"] = max(most["sources"], sources), max(most["outputs"], outputs)
            most["both"] = max(most["both"], min(sources, 1) + min(outputs, 2))
            time.sleep(0.01)
        out, err = run.communicate()
        assert run.returncode == 0, err[-3000:]
        pushed = {p: d for p, d in hub.files_of("k3lab-test/pipe", "main").items() if p.endswith(".gguf")}
    local = {f.name: f.read_bytes() for f in tiny_out.glob("Kimi-K3-*-of-*.gguf")}
    assert pushed == local
    assert most["sources"] <= 2 and most["outputs"] <= 2, most
    assert most["both"] == 3, most  # a shard was here while one file uploaded and the next waited


def test_ctrl_c_while_a_worker_publishes_stops_its_uploads(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """Ctrl-C on the client while a worker that shares nothing uploads, converts and waits for its
    slots: exit 130, and afterwards nothing more reaches the Hub (no upload, no commit); running the
    command again publishes the set, byte-identical."""
    target = "k3lab-test/stopped"
    with HubServer(tiny_src) as hub, dask_cluster(tmp_path, workers=1) as (address, _):
        hub.uplink = 200_000
        extra = ("--scheduler", address, "--push-to", target, "--text-only", "--quiet")
        run = _start(hub, tmp_path, *extra)
        while len(hub.uploads) < 2:
            time.sleep(0.05)
        _signal(run, signal.SIGINT)
        out, err = run.communicate(timeout=120)
        assert run.returncode == 130, err

        def reached() -> tuple:  # (files uploaded, any request to the Xet CAS, the branch's files)
            return (
                len(hub.uploads),
                len(hub.cas.requests),
                hub.files_of(target, "main") if target in hub.repos else {},
            )

        at_exit = reached()
        time.sleep(4)  # a task that went on would upload or commit within this
        assert reached() == at_exit
        hub.uplink = None
        again = _convert(hub, tmp_path, *extra)
        assert again.returncode == 0, again.stderr[-3000:]
        pushed = {p: d for p, d in hub.files_of(target, "main").items() if p.endswith(".gguf")}
    assert pushed == {f.name: f.read_bytes() for f in tiny_out.glob("Kimi-K3-*-of-*.gguf")}
