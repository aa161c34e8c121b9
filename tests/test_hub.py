"""Streaming from the Hub, against a loopback server speaking the Hub's file protocol."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from hub_server import HubServer

REPO = "moonshotai/Kimi-K3"


def _convert(
    hub: HubServer, tmp: Path, *extra: str, token: str | None = None, repo: str = REPO
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
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
        *extra,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


class ShardCounter(threading.Thread):
    """Polls the scratch folder: the most source shards (finished or partial) seen at once."""

    def __init__(self, scratch: Path):
        super().__init__(daemon=True)
        self.scratch, self.peak, self.stop = scratch, 0, threading.Event()
        self.looks = 0  # completed looks: the test checks the counter kept watching to the end

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
            self.looks += 1


def test_streaming_with_faults_gives_the_local_bytes(tiny_src: Path, tiny_out: Path, tmp_path: Path) -> None:
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
    assert (tmp_path / "meta" / "config.json").exists() and (tmp_path / "meta" / "tiktoken.model").exists()


def test_keep_source_and_a_rerun_downloads_nothing(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src) as hub:
        assert _convert(hub, tmp_path, "--shards", "1-3", "--keep-source").returncode == 0
        assert len(list((tmp_path / "scratch").glob("*.safetensors"))) == 3
        before = len(hub.requests)
        again = _convert(hub, tmp_path, "--shards", "1-3")
        assert again.returncode == 0
        shard_gets = [
            r for r in hub.requests[before:] if r[0] == "GET" and r[2] == "" and ".safetensors" in r[1]
        ]
        assert not shard_gets  # complete files are kept; only headers are read


def test_missing_repo_and_missing_file_are_one_line_errors(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src) as hub:
        r = _convert(hub, tmp_path / "a", repo="someone/not-there")
        assert r.returncode == 2
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and "someone/not-there" in err[0] and "404" in err[0]
    served = tmp_path / "served"
    shutil.copytree(tiny_src, served)
    (served / "model-00004-of-00011.safetensors").unlink()
    with HubServer(served) as hub:
        r = _convert(hub, tmp_path / "b")
        assert r.returncode == 2
        err = r.stderr.strip().splitlines()
        assert (
            len(err) == 1
            and REPO in err[0]
            and "model-00004-of-00011.safetensors" in err[0]
            and "404" in err[0]
        )
        assert not list((tmp_path / "b" / "out").glob("*.gguf"))


def test_token_is_honoured(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src, token="hf_secret") as hub:
        r = _convert(hub, tmp_path / "a", "--shards", "9")
        assert r.returncode == 2 and "401" in r.stderr and REPO in r.stderr
        r = _convert(hub, tmp_path / "b", "--shards", "9", token="hf_secret")
        assert r.returncode == 0, r.stderr[-2000:]
