"""Fail closed: killed runs leave no process behind, stopped runs no .partial, one writer per folder,
a full disk is one line, and verify refuses what it cannot trust."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import convert, wait_until

from k3lab.cli import main
from k3lab.kimi_k3.synth import synthesize

K3LAB = [sys.executable, "-m", "k3lab.cli"]


@pytest.fixture(scope="session")
def layer_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real expert dimensions, 8 experts: a conversion slow enough (~1 s) to interrupt mid-write."""
    out = tmp_path_factory.mktemp("layer") / "src"
    synthesize("layer", out, experts=8)
    return out


def _start(src: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*K3LAB, "convert", "--meta", str(src), "--out-dir", str(out), "--quiet", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _wait_for_partial(out: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if list(out.glob("*.gguf.partial")):
            return
        time.sleep(0.002)
    pytest.fail(f"no .partial appeared (exit {proc.poll()}): {proc.stderr.read() if proc.stderr else ''}")


def _gguf_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.gguf"))}


def test_sigkill_of_the_main_process_leaves_no_process_and_a_rerun_is_identical(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    rng = random.Random(0)
    for attempt in range(5):
        out = tmp_path / f"out{attempt}"
        proc = _start(tiny_src, out, "--jobs", "2")
        moment = rng.uniform(0.3, 2.5)
        deadline = time.monotonic() + moment
        seen: dict[int, psutil.Process] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            seen.update({p.pid: p for p in _tree(proc.pid)})  # the run's processes, as they appear
            time.sleep(0.01)
        seen.update({p.pid: p for p in _tree(proc.pid)})
        proc.kill()
        proc.wait()
        others = [p for p in seen.values() if p.pid != proc.pid]
        wait_until(lambda others=others: not _alive(others), timeout=10)  # (workers see their parent die)
        left = _alive(others)
        assert not left, f"kill at {moment:.2f} s: {[(p.pid, p.cmdline()[:3]) for p in left]} still alive"
        assert convert(tiny_src, out) == 0
        assert _gguf_bytes(out) == _gguf_bytes(tiny_out), f"kill at {moment:.2f} s"
        assert not list(out.rglob("*.partial"))


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGINT to the group"])
def test_sigterm_and_sigint_stop_at_once_and_remove_their_partials(
    layer_src: Path, tmp_path: Path, how: str
) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*K3LAB, "convert", "--meta", str(layer_src), "--out-dir", str(out), "--quiet", "--jobs", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a pipeline
        # as a terminal starts it: a test runner launched in the background (`cmd &` in a script)
        # passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    _wait_for_partial(out, proc)
    run = _tree(proc.pid)
    t0 = time.monotonic()
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    elif how == "SIGINT":
        proc.send_signal(signal.SIGINT)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    stopped_in = time.monotonic() - t0
    assert stopped_in < 3.0, stopped_in
    assert proc.returncode == (143 if how == "SIGTERM" else 130), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ("stopped by SIGTERM" in lines[0] or "interrupted" in lines[0]), err
    assert wait_until(lambda: not _alive(run), timeout=10), _alive(run)
    assert not list(out.rglob("*.partial"))
    assert convert(layer_src, out) == 0  # and the rerun finishes the job


def test_two_converts_on_one_folder_never_corrupt_it(tiny_src: Path, tmp_path: Path) -> None:
    for attempt in range(5):
        out = tmp_path / f"out{attempt}"
        a, b = _start(tiny_src, out, "--jobs", "2"), _start(tiny_src, out)
        results = [(p.wait(timeout=120), p.stderr.read()) for p in (a, b)]
        assert all(code in (0, 2) for code, _ in results), results
        assert any(code == 0 for code, _ in results), results
        for code, err in results:
            assert "No such file or directory" not in err and "Traceback" not in err, err
            if code == 2:  # the loser: one line naming the holder
                lines = err.strip().splitlines()
                assert len(lines) == 1 and "another k3lab run (pid " in lines[0], err
        assert main(["verify", str(out), "--quiet"]) == 0


def test_a_second_run_is_refused_while_the_first_holds_the_folder(tiny_src: Path, tmp_path: Path) -> None:
    from k3lab.pipeline.state import OutputFolder

    out = tmp_path / "out"
    with OutputFolder(out).hold():  # this test process is "the first run"
        for cmd in (
            ["convert", "--meta", str(tiny_src), "--out-dir", str(out)],
            ["batch", "--meta", str(tiny_src), "--out-dir", str(out)],
        ):
            second = subprocess.run(
                [*K3LAB, *cmd, "--quiet"] if cmd[0] == "convert" else [*K3LAB, *cmd],
                capture_output=True,
                text=True,
                timeout=120,
            )
            err = second.stderr.strip().splitlines()
            assert second.returncode == 2 and len(err) == 1, second.stderr
            assert f"another k3lab run (pid {os.getpid()})" in err[0], err
    assert not list(out.glob("*.gguf")) and not (out / "MANIFEST.json").exists()
    assert convert(tiny_src, out) == 0  # the lock went with its holder


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(
            f"SKIPPED LOUDLY: cannot mount a tmpfs here ({r.stderr.decode().strip()}); the full-disk test did not run"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_one_line_leaves_no_partial_and_a_bigger_disk_resumes(
    tiny_src: Path, tiny_out: Path, small_tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = small_tmpfs / "out"
    assert convert(tiny_src, out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on the device" in err[0] and ".gguf" in err[0], err
    assert "bytes" in err[0] and str(out) in err[0]
    assert not list(out.rglob("*.partial"))
    kept = _gguf_bytes(out)
    assert 0 < len(kept) < 9  # it got part of the way
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    assert convert(tiny_src, out) == 0
    assert f"{9 - len(kept)} written, {len(kept)} already complete" in capsys.readouterr().out
    assert _gguf_bytes(out) == _gguf_bytes(tiny_out)


# --- verify fails closed ---------------------------------------------------------------------------


def _verify(out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["verify", str(out), "--quiet"])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip().splitlines()


@pytest.mark.parametrize(
    "manifest, needle",
    [
        ({}, "not a k3lab manifest"),
        ([], "not a k3lab manifest"),
        ({"files": [{}]}, "files[0]: not a k3lab-manifest/3 record"),
        ("edited offset", "lie outside the data"),
        ("string size", "field 'size' is missing or malformed"),
        ("not json", "not valid JSON"),
    ],
)
def test_verify_refuses_a_malformed_manifest_in_one_line(
    tiny_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], manifest: object, needle: str
) -> None:
    out = tmp_path / "out"
    shutil.copytree(tiny_out, out)
    path = out / "MANIFEST.json"
    if manifest == "not json":
        path.write_text("{not json")
    elif isinstance(manifest, str):
        man = json.loads(path.read_text())
        if manifest == "edited offset":
            man["files"][1]["tensors"][2]["offset"] = 10**9
        else:
            man["files"][0]["size"] = "big"
        path.write_text(json.dumps(man))
    else:
        path.write_text(json.dumps(manifest))
    code, lines = _verify(out, capsys)
    assert code == 1 and len(lines) == 1 and "MANIFEST.json" in lines[0] and needle in lines[0], lines
    assert "Traceback" not in lines[0]


def test_verify_reports_files_that_are_not_part_of_the_set(
    tiny_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    shutil.copytree(tiny_out, out)
    (out / "Kimi-K3-MXFP4-00010-of-00009.gguf").write_bytes(b"GGUF")
    (out / "other-model-00001-of-00002.gguf").write_bytes(b"GGUF")
    code, lines = _verify(out, capsys)
    assert code == 1
    strays = [ln for ln in lines if "not part of this set" in ln]
    assert [ln.split(":")[0] for ln in strays] == [
        "Kimi-K3-MXFP4-00010-of-00009.gguf",
        "other-model-00001-of-00002.gguf",
    ]


def test_verify_says_a_directory_is_a_directory(
    tiny_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    shutil.copytree(tiny_out, out)
    victim = next(out.glob("*-00004-of-*.gguf"))
    victim.unlink()
    victim.mkdir()
    code, lines = _verify(out, capsys)
    assert code == 1 and f"{victim.name}: is a directory, not a GGUF file" in lines


def test_a_manifest_left_half_written_by_a_killed_run_is_removed(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """kill -9 while the manifest is written leaves MANIFEST.json.PID.partial: the next run removes it
    (k3lab's own name), and nothing else of that shape that is not k3lab's."""
    out = tmp_path / "out"
    shutil.copytree(tiny_out, out)
    (out / "MANIFEST.json.4242.partial").write_text("{ half")
    (out / "MANIFEST.json.notes.partial").write_text("a user's file")
    assert convert(tiny_src, out) == 0
    assert not (out / "MANIFEST.json.4242.partial").exists()
    assert (out / "MANIFEST.json.notes.partial").read_text() == "a user's file"
