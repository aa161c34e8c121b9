"""The imatrix of a set published on the Hub, computed on a real cluster whose workers share no folder
(a `dask scheduler` and two `dask worker`s, each with a local directory of its own, the set only in
a loopback Hub): every worker reads by ranges only the tensors of the steps it holds, the steps run
two at a time, the chunks flowing between them, and the file is the one a single machine writes from
a local copy of the set, byte for byte (itself llama-imatrix's: tests/pipeline/test_imatrix.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from dask_helpers import dask_cluster
from hub_server import HubServer
from llama_support import needs_llama

from k3lab.cli import main

pytestmark = needs_llama
TEXT = ROOT / "tests" / "data" / "imatrix-calibration.txt"
REPO = "k3lab-test/Kimi-K3-GGUF"
FLAGS = ("-c", "64", "--chunks", "6", "--calibration", str(TEXT), "--quiet")


def _published(set_dir: Path, tmp: Path) -> Path:
    """The set's files and manifest as a publishing run leaves them in a repo (no state folder)."""
    repo = tmp / "repo"
    repo.mkdir()
    for p in set_dir.iterdir():
        if p.is_file():
            shutil.copy(p, repo / p.name)
    return repo


def test_two_workers_that_share_no_folder_compute_one_machines_imatrix(
    tiny_out: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    shutil.copytree(tiny_out, local)
    assert main(["imatrix", str(local), *FLAGS]) == 0
    (tmp_path / "cluster").mkdir()
    with (
        HubServer(_published(tiny_out, tmp_path), repo=REPO) as hub,
        dask_cluster(tmp_path / "cluster") as (
            address,
            worker_dirs,
        ),
    ):
        out = tmp_path / "from-hub" / "imatrix.gguf"
        loud = [f for f in FLAGS if f != "--quiet"]
        done = run_cli(
            hub.client_env(tmp_path),
            "imatrix",
            REPO,
            "--out",
            str(out),
            "--scheduler",
            address,
            *loud,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "k3lab: imatrix: layer 1 .. layer 2 (6 chunks of 64) on 2 workers at once" in done.stderr, (
            done.stderr
        )
        assert out.read_bytes() == (local / "imatrix.gguf").read_bytes()
        # every tensor read once, by ranges, never a whole file; nothing of the set on a worker's disk
        reads = [
            (path, rng) for method, path, rng in hub.requests if method == "GET" and path.endswith(".gguf")
        ]
        assert reads and all(rng for _, rng in reads), reads[:5]
        # the bytes served: every tensor once (a worker reads only its step's), and file 1's header
        # twice (the client's metadata and vocabulary; its range read by the parser, then whole)
        served = sum(n for path, _, n in hub.served if path.endswith(".gguf"))
        files = sorted(p for p in tiny_out.glob("*.gguf"))
        import gguf

        header = gguf.GGUFReader(files[0]).tensors[0].data_offset
        assert served <= sum(p.stat().st_size for p in files) + 3 * header, (served, header)
        for d in worker_dirs:
            assert not [p for p in d.rglob("*.gguf")], d
        # the client's folder holds the imatrix and the run's plan alone
        left = sorted(str(p.relative_to(out.parent)) for p in out.parent.rglob("*") if p.is_file())
        assert left == [
            ".k3lab/imatrix/done.json",
            ".k3lab/imatrix/plan.json",
            ".k3lab/lock",
            "imatrix.gguf",
        ], left


def test_a_set_on_the_hub_in_this_process_and_its_bad_input(tiny_out: Path, tmp_path: Path) -> None:
    """Without --scheduler a set on the Hub is computed here, the same bytes; an unknown repo, a repo
    with no manifest, and no --out are one line each, with nothing left behind."""
    local = tmp_path / "local"
    shutil.copytree(tiny_out, local)
    assert main(["imatrix", str(local), *FLAGS]) == 0
    repo = _published(tiny_out, tmp_path)
    with HubServer(repo, repo=REPO) as hub:
        env = hub.client_env(tmp_path)
        out = tmp_path / "here" / "imatrix.gguf"
        done = run_cli(env, "imatrix", REPO, "--out", str(out), *FLAGS)
        assert done.returncode == 0, done.stderr[-3000:]
        assert out.read_bytes() == (local / "imatrix.gguf").read_bytes()
        for args, said in (
            ((REPO,), "give --out FILE"),
            (("nobody/nothing", "--out", str(tmp_path / "x" / "i.gguf")), "nobody/nothing"),
        ):
            bad = run_cli(env, "imatrix", *args, *FLAGS)
            lines = bad.stderr.strip().splitlines()
            assert bad.returncode == 2 and len(lines) == 1 and said in lines[0], bad.stderr
        assert not (tmp_path / "x").exists()
    (repo / "MANIFEST.json").unlink()
    with HubServer(repo, repo=REPO) as hub:
        bad = run_cli(
            hub.client_env(tmp_path), "imatrix", REPO, "--out", str(tmp_path / "y" / "i.gguf"), *FLAGS
        )
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and "no MANIFEST.json" in lines[0], bad.stderr
        assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("flag", [("--revision", "main")])
def test_hub_flags_on_a_folder_are_one_line(flag: tuple[str, str], tiny_out: Path, capsys) -> None:
    assert main(["imatrix", str(tiny_out), *flag, *FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--revision is for a set on the Hub" in err[0], err


def test_the_imatrix_is_one_of_the_sets_files_published_and_verified(tiny_out: Path, tmp_path: Path) -> None:
    """Made in the set's folder, the imatrix is recorded with the set (its manifest), checked by
    `verify`, published by `publish` beside the set and checked there by `verify ORG/NAME`; a byte
    changed in it is found."""
    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    assert main(["imatrix", str(out), *FLAGS]) == 0
    import json

    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert [f["file"] for f in manifest["files"] if f["kind"] == "imatrix"] == ["imatrix.gguf"]
    assert run_cli(None, "verify", str(out)).returncode == 0
    token = "hf_publish_secret_0123456789"
    with HubServer(_published(tiny_out, tmp_path), token=token) as hub:
        env = hub.client_env(tmp_path, token)
        r = run_cli(env, "publish", str(out), REPO)
        assert r.returncode == 0, r.stderr[-2000:]
        assert hub.files_of(REPO)["imatrix.gguf"] == (out / "imatrix.gguf").read_bytes()
        r = run_cli(env, "verify", REPO, "--all")
        assert r.returncode == 0, r.stdout + r.stderr
    data = bytearray((out / "imatrix.gguf").read_bytes())
    data[-3] ^= 0x40
    (out / "imatrix.gguf").write_bytes(bytes(data))
    r = run_cli(None, "verify", str(out))
    assert r.returncode == 1 and "imatrix.gguf" in r.stdout, r.stdout


def test_ctrl_c_of_the_client_stops_the_cluster_run_and_nothing_is_written_after(
    tiny_out: Path, tmp_path: Path
) -> None:
    """Ctrl-C while the workers read their layers (the Hub slowed): the client exits non-zero, leaves
    no half-written file and no imatrix, and writes nothing once it has exited."""
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "cluster").mkdir()
    with (
        HubServer(_published(tiny_out, tmp_path), repo=REPO) as hub,
        dask_cluster(tmp_path / "cluster") as (
            address,
            _,
        ),
    ):
        hub.link = 200_000.0  # (bytes a second, every answer together: the layers take seconds to read)
        out = tmp_path / "run" / "imatrix.gguf"
        run = subprocess.Popen(
            [sys.executable, "-m", "k3lab.cli", "imatrix", REPO, "--out", str(out), "--scheduler", address, *FLAGS],
            env=hub.client_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        state = out.parent / ".k3lab" / "imatrix"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (state / "plan.json").exists():
            time.sleep(0.05)
        time.sleep(1.0)
        assert run.poll() is None, "the run ended before Ctrl-C: slow the Hub down"
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=120)
        assert run.returncode != 0, err
        before = {str(p): p.stat().st_mtime_ns for p in out.parent.rglob("*") if p.is_file()}
        assert not out.exists() and not [p for p in before if p.endswith(".partial")], before
        time.sleep(3)
        assert {str(p): p.stat().st_mtime_ns for p in out.parent.rglob("*") if p.is_file()} == before
