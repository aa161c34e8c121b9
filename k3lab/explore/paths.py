"""Where a notebook's relative paths start, and where it writes what it computed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HOME_ENV = "K3LAB_HOME"  # set by `k3lab lab`: where the notebooks' relative paths start


def home() -> Path:
    """Where a notebook's relative paths (``k3-demo/src``) start, whatever the kernel's working
    folder: $K3LAB_HOME (`k3lab lab` sets it), else the repository this k3lab is installed from, else
    the working folder."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]  # (k3lab/explore/paths.py -> the checkout)
    return repo if (repo / "notebooks").is_dir() and (repo / "pyproject.toml").is_file() else Path.cwd()


def resolve(path: str | Path) -> Path:
    """A notebook parameter as a path: absolute as given, relative from ``home()``."""
    path = Path(path)
    return path if path.is_absolute() else home() / path


def save_result(result: dict[str, Any], path: str | Path | None) -> None:
    """What a notebook computed, for tests and batch runs, into a file (never printed on the page)."""
    if path:
        Path(path).write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")


NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"  # the checkout's notebooks
CONVERT_NOTEBOOK = NOTEBOOKS / "03-convert-a-file.ipynb"  # `k3lab batch`'s default
RENAMED = {"03-convert-shard.ipynb": "03-convert-a-file.ipynb"}  # old name -> new, for users' batch commands


def notebook_path(given: str | Path) -> Path:
    """A notebook to run, as given; a repository notebook's old name (``RENAMED``) as its new one, so
    that a ``k3lab batch --notebook`` given 03's old name (``03-convert-shard.ipynb``) before the rename runs."""
    path = Path(given)
    renamed = path.with_name(RENAMED.get(path.name, path.name))
    return renamed if not path.exists() and renamed != path and renamed.is_file() else path
