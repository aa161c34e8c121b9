"""`k3lab lab`: JupyterLab on the repository's notebooks, as a person meets them.

It starts JupyterLab at the repository root (``--allow-root`` added when run as root), tells the
notebooks where their relative paths start (``K3LAB_HOME``, see ``explore.home``), and installs a
save hook: a notebook saved under ``notebooks/`` is written without outputs, execution counts or
run-time metadata, so that Run All, Save leaves ``git status`` clean while the page keeps showing
everything. Extra arguments go to ``jupyter lab`` as they are.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3lab.children import python_command
from k3lab.explore.paths import HOME_ENV, home

TRACKED = "notebooks/"
KEEP_CELL_METADATA = ("tags",)


def clean_notebook(nb: dict[str, Any], stored_metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """A notebook as the repository keeps it: code cells without outputs or counts, cell metadata
    reduced to tags, the notebook's metadata as stored (a kernel's Python version is not content)."""
    for cell in nb.get("cells", []):
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items() if k in KEEP_CELL_METADATA}
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    if stored_metadata is not None:
        nb["metadata"] = stored_metadata
    return nb


def strip_outputs_on_save(model: dict[str, Any], path: str, contents_manager: Any, **kwargs: Any) -> None:
    """jupyter_server's ContentsManager.pre_save_hook: clean the tracked notebooks on their way to disk."""
    if model.get("type") != "notebook" or not path.lstrip("/").startswith(TRACKED):
        return
    import nbformat

    stored = None
    on_disk = Path(contents_manager.root_dir) / path.lstrip("/")
    if on_disk.is_file():
        stored = nbformat.read(on_disk, as_version=4).get("metadata")
    clean_notebook(model["content"], dict(stored) if stored is not None else None)


def lab_command(extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The `jupyter lab` command line and environment `k3lab lab` runs."""
    root = home()
    cmd = [
        # isolated (k3lab.children); its kernels start in k3lab's home, not in the current folder
        *python_command("from jupyterlab.labapp import main\nsys.exit(main())"),
        f"--ServerApp.root_dir={root}",
        "--ContentsManager.pre_save_hook=k3lab.lab.strip_outputs_on_save",
        f"--LabApp.default_url=/lab/tree/{TRACKED.rstrip('/')}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return [*cmd, *extra], {**os.environ, HOME_ENV: str(root)}


def run_lab(extra: Sequence[str] = ()) -> int:
    cmd, env = lab_command(extra)
    print(f"k3lab lab: JupyterLab at {env[HOME_ENV]}, notebooks/ saved without outputs", flush=True)
    return subprocess.call(cmd, env=env)


def lab_cli(req: Any, args: Any) -> int:
    """`k3lab lab [JUPYTER ARGS...]`."""
    return run_lab(args.jupyter_args)
