"""Streaming from the Hub, against a loopback server speaking the Hub's file protocol."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import PER_LAYER, run_cli
from dask_helpers import dask_cluster
from hub_server import HubServer

REPO = "moonshotai/Kimi-K3"


def _convert(
    hub: HubServer, tmp: Path, *extra: str, token: str | None = None, repo: str = REPO
) -> subprocess.CompletedProcess:
    env = hub.client_env(tmp, token)
    # huggingface_hub writes 10 MB chunks; with 64 KiB ones a cut in a 400 KB test shard is resumed
    # from the middle, as a cut in a 16 GB shard is
    launcher = (
        "import sys, huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 65536; "
        "from k3lab.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    cmd = [
        sys.executable,
        "-c",
        launcher,
        "convert",
        "--repo",
        repo,
        "--meta",
        str(tmp / "meta"),
        "--out-dir",
        str(tmp / "out"),
        "--scratch",
        str(tmp / "scratch"),
        "--quiet",
        *PER_LAYER,  # a layer per file: each output file streams its own source file
        *extra,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


class ShardCounter(threading.Thread):
    """Polls the scratch folder: the most source shards (finished or partial) seen at once; and every
    process's open files: the most deleted downloads still open at once (a descriptor left open on a
    deleted shard keeps its 16 GB on the disk until the process ends)."""

    def __init__(self, scratch: Path):
        super().__init__(daemon=True)
        self.scratch, self.peak, self.stop = scratch, 0, threading.Event()
        self.looks = 0  # completed looks: the test checks the counter kept watching to the end
        self.held_deleted = 0

    def _deleted_but_open(self) -> int:
        n = 0
        for fd in Path("/proc").glob("[0-9]*/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:  # (gone meanwhile, or not ours to read)
                continue
            n += target.startswith(str(self.scratch)) and target.endswith(".safetensors (deleted)")
        return n

    def run(self) -> None:
        while not self.stop.wait(0.002):
            try:
                n = sum(
                    1
                    for p in self.scratch.rglob("*")
                    if p.name.endswith((".safetensors", ".incomplete")) and p.is_file()
                )
            except FileNotFoundError:  # a folder vanished while we walked it: look again
                continue
            self.peak = max(self.peak, n)
            if self.looks % 20 == 0:
                self.held_deleted = max(self.held_deleted, self._deleted_but_open())
            self.looks += 1


def test_streaming_with_faults_gives_the_local_bytes(tiny_src: Path, tiny_out: Path, tmp_path: Path) -> None:
    """`convert --repo` from a Hub whose shards are Xet-backed (a redirect to a bridge), with cut
    transfers and 503s: the local conversion's bytes."""
    counter = ShardCounter(tmp_path / "scratch")
    counter.start()
    with HubServer(tiny_src, faults=True) as hub:
        result = _convert(hub, tmp_path)
    assert counter.is_alive()  # watched the whole conversion
    counter.stop.set()
    counter.join()
    assert counter.looks > 100
    assert result.returncode == 0, result.stderr[-3000:]
    for f in sorted(tiny_out.glob("*.gguf")):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    assert 1 <= counter.peak <= 2, counter.peak
    assert not list((tmp_path / "scratch").glob("*.safetensors"))  # deleted after conversion
    assert counter.held_deleted == 0  # and closed before
    # the faults really happened, and downloads resumed with ranged requests
    assert len(hub.cut) >= 3
    resumed = [
        r
        for r in hub.requests
        if r[0] == "GET"
        and r[1].endswith(".safetensors")
        and r[2].startswith("bytes=")
        and not r[2].startswith("bytes=0-")
    ]
    assert resumed

    # the shards are Xet-backed, as on today's Hub: every byte came through the bridge the Hub's
    # redirect names (a ranged read of the header, then the download, resumed by range)
    def files(bridge: bool) -> set[str]:
        return {
            r[1].split("?")[0].rsplit("/", 1)[-1]
            for r in hub.requests
            if "/resolve/" in r[1]
            and r[1].endswith(".safetensors")
            and r[1].startswith("/cas-bridge/") == bridge
        }

    assert len(files(False)) >= 9 and files(False) <= files(True), (files(False), files(True))
    assert (tmp_path / "meta" / "config.json").exists() and (tmp_path / "meta" / "tiktoken.model").exists()


def test_keep_source_and_a_rerun_downloads_nothing(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src) as hub:
        assert _convert(hub, tmp_path, "--shards", "1-3", "--keep-source").returncode == 0
        kept = list((tmp_path / "scratch").glob("k3lab-dl-*/*.safetensors"))
        assert len(kept) == 3 and len(list((tmp_path / "scratch").glob("k3lab-dl-*.kept"))) == 3
        before = len(hub.downloads())
        again = _convert(hub, tmp_path, "--shards", "1-3")
        assert again.returncode == 0
        assert len(hub.downloads()) == before  # complete files are kept; only headers are read


def test_missing_repo_and_missing_file_are_one_line_errors(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src) as hub:
        r = _convert(hub, tmp_path / "a", repo="someone/not-there")
        assert r.returncode == 2
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and "someone/not-there" in err[0] and "404" in err[0]
    served = tmp_path / "served"
    shutil.copytree(tiny_src, served)
    (served / "model-00004-of-000011.safetensors").unlink()
    with HubServer(served) as hub:
        r = _convert(hub, tmp_path / "b")
        assert r.returncode == 2
        err = r.stderr.strip().splitlines()
        assert (
            len(err) == 1
            and REPO in err[0]
            and "model-00004-of-000011.safetensors" in err[0]
            and "404" in err[0]
        )
        assert not list((tmp_path / "b" / "out").glob("*.gguf"))


def test_token_is_honoured(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src, token="hf_secret") as hub:
        r = _convert(hub, tmp_path / "a", "--shards", "9")
        assert r.returncode == 2 and "401" in r.stderr and REPO in r.stderr
        r = _convert(hub, tmp_path / "b", "--shards", "9", token="hf_secret")
        assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow  # (12 s; Dask workers streaming from the Hub: also test_layouts' and test_publish's)
def test_every_dask_worker_streams_its_own_shards_from_the_hub(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """A real `dask scheduler` and two `dask worker` processes, started as a user would: each task
    downloads its own shard from the (faulty) Hub into scratch, converts it into the shared output
    folder and deletes it."""
    with dask_cluster(tmp_path) as (address, _):
        with HubServer(tiny_src, faults=True) as hub:
            result = _convert(hub, tmp_path, "--scheduler", address)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "9 written" in result.stdout and "written by 2 processes" in result.stdout, result.stdout
        for f in sorted(tiny_out.glob("*.gguf")):
            assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
        streamed = json.loads((tmp_path / "out" / "MANIFEST.json").read_text())
        for rec in streamed["files"]:  # the Hub also gives each source file's SHA-256
            assert len(rec["sources"][0].pop("sha256")) == 64
            rec.pop("plan_digest")  # which covers that SHA-256
        local = json.loads((tiny_out / "MANIFEST.json").read_text())
        for rec in local["files"]:
            rec.pop("plan_digest")
        assert streamed == local
        assert not list((tmp_path / "scratch").rglob("*.safetensors*"))
        assert any(r[0] == "GET" and ".safetensors" in r[1] for r in hub.requests)


@pytest.mark.slow  # (11 s; streaming with faults stays in the default run)
def test_hub_streaming_with_jobs_gives_the_local_bytes(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """--repo with --jobs 2: each worker process downloads its own shards, converts and deletes them."""
    with HubServer(tiny_src, faults=True) as hub:
        result = _convert(hub, tmp_path, "--jobs", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "9 written" in result.stdout and "written by 2 processes" in result.stdout, result.stdout
    for f in sorted(tiny_out.glob("*.gguf")):
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    assert not list((tmp_path / "scratch").rglob("*.safetensors*"))


def test_every_command_reads_the_hub_through_the_one_source(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """verify --repo re-derives every tensor from the Hub, vision --repo writes the local mmproj's
    bytes, and neither leaves a shard behind; a tampered tensor fails verify --repo."""
    from k3lab.cli import main

    out = tmp_path / "out"
    shutil.copytree(tiny_out, out)
    meta = ["--meta", str(tmp_path / "meta")]
    with HubServer(tiny_src) as hub:
        ok = run_cli(hub.client_env(tmp_path), "verify", str(out), "--repo", REPO, *meta, "--quiet")
        assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
        assert "re-derived from the source" in ok.stdout
        assert len(hub.downloads(fresh=True)) >= 9  # every text shard came down
        vision = run_cli(
            hub.client_env(tmp_path),
            "vision",
            "--repo",
            REPO,
            *meta,
            "--out",
            str(tmp_path / "v" / "mmproj.gguf"),
        )
        assert vision.returncode == 0, vision.stderr[-2000:]
        assert not list((tmp_path / "v" / ".k3lab" / "scratch").glob("*.safetensors"))
        # the same file as from the local copy
        assert (
            main(["vision", "--meta", str(tiny_src), "--out", str(tmp_path / "local" / "mmproj.gguf")]) == 0
        )
        assert (tmp_path / "v" / "mmproj.gguf").read_bytes() == (
            tmp_path / "local" / "mmproj.gguf"
        ).read_bytes()
        # a tampered set fails against the Hub too, naming the tensor: a new commit changes a shard
        name = "language_model.model.layers.2.input_layernorm.weight"
        index = json.loads((tiny_src / "model.safetensors.index.json").read_text())
        raw = bytearray(hub.file(index["weight_map"][name]))
        raw[-3] ^= 0xFF  # the last tensor's last bytes
        hub.commit({index["weight_map"][name]: bytes(raw)})
        bad = run_cli(
            hub.client_env(tmp_path / "b"),
            "verify",
            str(out),
            "--repo",
            REPO,
            "--meta",
            str(tmp_path / "meta2"),
            "--quiet",
        )
        assert bad.returncode == 1 and "re-derived from the source, SHA-256 differs" in bad.stdout, (
            bad.stdout[-2000:]
        )


def test_check_logits_reads_the_hub(tiny_src: Path, tiny_out: Path, tmp_path: Path) -> None:
    """The reference reads every tensor it needs through the Hub source (each shard downloaded once,
    into a temporary scratch), and the verdict is the local one's."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("SKIPPED LOUDLY: llama-cpp-python is not installed")
    first = sorted(tiny_out.glob("*-00001-of-*.gguf"))[0]
    with HubServer(tiny_src) as hub:
        r = run_cli(
            hub.client_env(tmp_path),
            "check-logits",
            "--repo",
            REPO,
            "--meta",
            str(tmp_path / "meta"),
            "--gguf",
            str(first),
        )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.rstrip().endswith("check-logits OK: the verdict is the stage check")


def test_metadata_follows_the_commit_and_a_users_file_is_never_replaced(
    tiny_src: Path, tmp_path: Path
) -> None:
    """A new commit changes config.json: the rerun fetches it again (k3lab fetched the old one), says
    the source moved, and redoes file 1 only (it carries the hyperparameters). A differing config.json
    that k3lab did not fetch is one line, and stays as the user left it."""
    with HubServer(tiny_src) as hub:
        assert _convert(hub, tmp_path, "--shards", "1,2").returncode == 0
        config = json.loads(hub.file("config.json"))
        config["text_config"]["rms_norm_eps"] = 3e-6
        new = json.dumps(config, indent=1).encode()
        moved = hub.commit({"config.json": new}, "a new rms_norm_eps")
        before = (tmp_path / "out").glob("*-00002-of-*.gguf").__next__().stat().st_mtime_ns
        r = _convert(hub, tmp_path, "--shards", "1,2")
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "meta" / "config.json").read_bytes() == new
        assert "1 written, 1 already complete" in r.stdout, r.stdout
        assert next((tmp_path / "out").glob("*-00002-of-*.gguf")).stat().st_mtime_ns == before
        rerun = subprocess.run(  # not --quiet: it says what moved
            [
                sys.executable,
                "-m",
                "k3lab.cli",
                "plan",
                "--repo",
                REPO,
                "--meta",
                str(tmp_path / "meta"),
                "--out-dir",
                str(tmp_path / "out"),
                "--revision",
                hub.first,
            ],
            env=hub.client_env(tmp_path),
            capture_output=True,
            text=True,
        )
        assert rerun.returncode == 0, rerun.stderr
        assert f"the source moved (commit {moved[:12]} -> {hub.first[:12]})" in rerun.stderr, rerun.stderr
        assert "1 of 9 output files change (1)" in rerun.stderr

        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "config.json").write_bytes(new + b"\n")
        r = subprocess.run(
            _convert_args(tmp_path / "b", "--meta", str(mine)),
            env=hub.client_env(tmp_path),
            capture_output=True,
            text=True,
        )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "config.json: is not moonshotai/Kimi-K3@" in lines[0]
        and "did not fetch it" in lines[0]
    )
    assert (mine / "config.json").read_bytes() == new + b"\n"
    assert sorted(p.name for p in mine.iterdir()) == ["config.json"]


def _convert_args(tmp: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "k3lab.cli",
        "convert",
        "--repo",
        REPO,
        "--out-dir",
        str(tmp / "out"),
        "--quiet",
        *extra,
    ]


def test_a_download_cut_half_way_resumes_from_its_last_byte(tiny_src: Path, tmp_path: Path) -> None:
    """A shard's download cut half way (the connection dropped), then the Hub unreachable for a few
    seconds: the download continues from the byte it had, in the next attempt; the Hub serves the
    shard's bytes hardly more than once in all, and the file converts to the local bytes."""
    index = json.loads((tiny_src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["language_model.model.layers.2.input_layernorm.weight"]
    size = (tiny_src / shard).stat().st_size
    with HubServer(tiny_src, faults=True) as hub:
        hub.throttle = 100_000  # ~4 s for the shard: time for the outage to land mid-transfer
        plan = _convert(hub, tmp_path, "--shards", "1")  # plans (headers) and converts file 1
        assert plan.returncode == 0, plan.stderr
        served_before = hub.served_bytes(shard)
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "k3lab.cli",
                "convert",
                "--repo",
                REPO,
                "--meta",
                str(tmp_path / "meta"),
                "--out-dir",
                str(tmp_path / "out"),
                "--scratch",
                str(tmp_path / "scratch"),
                "--shards",
                "3",
                "--quiet",
            ],
            env=hub.client_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while shard not in hub.cut:  # the first transfer of the shard was cut half way
            time.sleep(0.02)
        hub.outage(3)
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        served = hub.served_bytes(shard) - served_before
        resumed = [a for p, a in hub.downloads() if p == shard and a > 0]
    assert resumed, "no ranged request continued the download"
    assert served < 1.1 * size, (served, size)
    name = next(p.name for p in (tmp_path / "out").glob("*-00003-of-*.gguf"))
    local = tmp_path / "local"
    from k3lab.cli import main

    assert (
        main(
            [
                "convert",
                "--meta",
                str(tiny_src),
                "--out-dir",
                str(local),
                *PER_LAYER,
                "--shards",
                "3",
                "--quiet",
            ]
        )
        == 0
    )
    assert (tmp_path / "out" / name).read_bytes() == (local / name).read_bytes()


def test_the_bar_fits_the_terminal(tiny_src: Path, tmp_path: Path) -> None:
    """On a 72-column terminal (a pty), every bar the run draws (planning, then the run's, with the
    bytes down beside it) fits in 72 columns; messages are whole lines of their own."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import termios

    main_fd, side_fd = pty.openpty()
    fcntl.ioctl(side_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 72, 0, 0))
    with HubServer(tiny_src) as hub:
        hub.throttle = 2_000_000  # (slow enough for the bar to be drawn with its rates)
        env = hub.client_env(tmp_path)
        args = ["--repo", REPO, "--meta", str(tmp_path / "meta"), "--out-dir", str(tmp_path / "out")]
        proc = subprocess.Popen(
            [sys.executable, "-m", "k3lab.cli", "convert", *args],
            env={**env, "TERM": "xterm"},
            stdin=side_fd,
            stdout=side_fd,
            stderr=side_fd,
        )
        os.close(side_fd)
        drawn = b""
        while True:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # (the pty closes when the command ends)
                break
            if not chunk:
                break
            drawn += chunk
        assert proc.wait(timeout=120) == 0, drawn[-2000:]
    os.close(main_fd)
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", drawn.decode(errors="replace"))
    bars = [line for line in re.split(r"[\r\n]", text) if re.match(r"(planning|\d+ files): ", line)]
    assert any("down" in line for line in bars) and any(line.startswith("planning") for line in bars), bars
    assert max(len(line) for line in bars) <= 72, [line for line in bars if len(line) > 72]
