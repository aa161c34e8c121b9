"""Running a notebook as a batch does (papermill, a result file, a timeout on every cell) and reading
what it computed."""

from __future__ import annotations

import json
from pathlib import Path

import papermill
from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def result_of(nb_path: Path) -> dict:
    """What the notebook computed: written to ``result_file`` (never printed on the page), and no
    cell errored or printed FAILED."""
    nb = json.loads(nb_path.read_text())
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", out
            assert "FAILED" not in "".join(out.get("text", "")) and "K3LAB_RESULT" not in "".join(
                out.get("text", "")
            )
    return json.loads(nb_path.with_suffix(".json").read_text())


def images_of(nb_path: Path) -> int:
    nb = json.loads(nb_path.read_text())
    return sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))


def run_notebook(name: str, tmp_path: Path, **params) -> Path:
    out = tmp_path / name
    papermill.execute_notebook(
        str(ROOT / "notebooks" / name),
        str(out),
        parameters={"result_file": str(out.with_suffix(".json")), **params},
        kernel_name="python3",
        progress_bar=False,
        cwd=str(tmp_path),
        execution_timeout=300,  # a lost kernel message is a failure here, never a stuck CI
    )
    return out
