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
