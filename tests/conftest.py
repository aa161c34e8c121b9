from __future__ import annotations

from pathlib import Path

import pytest

from k3lab.synth import synthesize


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny synthetic checkpoint (seed 0), written once per test session. Treat as read-only."""
    out = tmp_path_factory.mktemp("tiny") / "src"
    synthesize("tiny", out, seed=0)
    return out


def convert(src: Path, out: Path, *extra: str) -> int:
    from k3lab.cli import main

    return main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet", *extra])


@pytest.fixture(scope="session")
def tiny_out(tiny_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny converted with --jobs 2 (read-only: copy it before changing anything)."""
    out = tmp_path_factory.mktemp("tiny-gguf")
    assert convert(tiny_src, out, "--jobs", "2") == 0
    return out


def saved_plan(src: Path, out: Path):
    """Plan converting ``src`` into ``out`` and save it there, as a run does (then release the folder)."""
    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.running.runner import start_run
    from k3lab.pipeline.sources.base import SourceSpec

    with start_run(MODEL, SourceSpec.local(src), out) as (plan, _, _):
        return plan


def state_json(path: Path):
    """The JSON of a state file in ``OUT/.k3lab/`` (after its ``k3lab-state/1 KIND SHA256`` line)."""
    import json

    head, _, body = path.read_bytes().partition(b"\n")
    assert head.startswith(b"k3lab-state/1 "), head
    return json.loads(body)
