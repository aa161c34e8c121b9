from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3lab.kimi_k3.synth import synthesize

ROOT = Path(__file__).resolve().parent.parent  # the repository


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny synthetic checkpoint (seed 0), written once per test session. Treat as read-only."""
    out = tmp_path_factory.mktemp("tiny") / "src"
    synthesize("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def full_src(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """``synth --preset full`` (the real 96 headers, data as holes) and what synthesize returned, written
    once per test session. Treat as read-only."""
    out = tmp_path_factory.mktemp("full") / "Kimi-K3"
    return out, synthesize("full", out)


# one layer per output file: tiny's 8 layers and its output tensors as 9 files, the split set the
# real model gives by default (tiny fits in one file, its own default); most tests of the machinery
# (--jobs, --files, resume, Dask, publishing) want several files
PER_LAYER = ("--split-max-tensors", "1")


def convert(src: Path, out: Path, *extra: str, per_layer: bool = True) -> int:
    from k3lab.cli import main

    split = PER_LAYER if per_layer else ()
    return main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet", *split, *extra])


@pytest.fixture(scope="session")
def tiny_out(tiny_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny converted a layer per file with --jobs 2 (read-only: copy it before changing anything)."""
    out = tmp_path_factory.mktemp("tiny-gguf")
    assert convert(tiny_src, out, "--jobs", "2") == 0
    return out


@pytest.fixture(scope="session")
def tiny_one(tiny_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny converted as the default makes it: one file, no split keys (read-only)."""
    out = tmp_path_factory.mktemp("tiny-one")
    assert convert(tiny_src, out, per_layer=False) == 0
    return out


def saved_plan(src: Path, out: Path, per_layer: bool = True):
    """Plan converting ``src`` into ``out`` and save it there, as a run does (then release the folder)."""
    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.planning.split import make_split
    from k3lab.pipeline.running.start import RunOptions, start_run
    from k3lab.pipeline.sources.base import SourceSpec

    options = RunOptions(split=make_split(None, 1) if per_layer else None)
    with start_run(MODEL, SourceSpec.local(src), out, options) as (plan, _, _):
        return plan


def state_json(path: Path):
    """The JSON of a state file in ``OUT/.k3lab/`` (after its ``k3lab-state/1 KIND SHA256`` line)."""
    import json

    head, _, body = path.read_bytes().partition(b"\n")
    assert head.startswith(b"k3lab-state/1 "), head
    return json.loads(body)


def run_cli(env: dict[str, str] | None, *args: str, timeout: float = 300, cwd: Path | None = None):
    """``k3lab ARGS`` as a user runs it: a process of its own (``env``: its environment, None: this
    one's), its output captured; the one way the tests run the command line in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "k3lab.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.fixture(name="run_cli")
def run_cli_fixture():
    """``run_cli`` for a test that takes it as a fixture."""
    return run_cli


def wait_until(condition, timeout: float, step: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass (a deadline, never a fixed
    sleep standing in for one): whether it held."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)
    return True
