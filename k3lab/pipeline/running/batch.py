"""Batch runs: a notebook executed once per output file with papermill, as tasks of the one runner
(``runner.run_notebooks``): on Dask (a LocalCluster, or ``--scheduler``), one loop, one cancel.

Each task runs papermill in a process of its own (its kernel a child of it) with the parameters
among ``meta``, ``src``, ``out_dir``, ``run_token`` and ``file`` that the notebook's ``parameters``
cell sets (``declared_parameters``: a notebook without ``file`` is not one to run per file), keeping the executed notebook as
``papermill_runs/<run-id>/file-NN.ipynb``. Nothing can hang it: every cell has ``cell_timeout``
seconds and the notebook ``notebook_timeout`` (a kernel that stops answering, a widget waiting for a
front end), after which its process group is killed and the task reports one line naming the
notebook and the cell that was running. A failed file does not stop the others: it is listed, and
running the same command again converts it (finished files are found complete and kept).
Concurrent kernel starts can race for ports (a known papermill and jupyter_client problem), so a
kernel that fails to start is tried again after a short pause, at most ``START_ATTEMPTS`` times.
"""

from __future__ import annotations

import ast
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3lab.children import KERNEL_NAME, kernel_spec, python_command

CELL_TIMEOUT = 600.0  # seconds one cell may run (converting a real layer takes under a minute)
NOTEBOOK_TIMEOUT = 3600.0  # seconds a whole notebook may run
START_ATTEMPTS = 4
KERNEL_START_ERRORS = (
    "Kernel died before replying",
    "Address already in use",
    "kernel_info",
    "ZMQError",
    "Kernel didn't respond",
)


NOTEBOOK_LIMIT = 64 << 20  # bytes of a notebook read to find its parameters (ours are ~20 KB)
GIVEN = ("meta", "src", "out_dir", "run_token", "file")  # what a batch run can tell a notebook


def declared_parameters(notebook: str | Path) -> frozenset[str]:
    """``parameter_names``, with ``file`` among them: one line when it is not (the notebook cannot be
    told which output file it runs for: every run would do the same)."""
    from k3lab.errors import K3LabError

    names = parameter_names(notebook)
    if "file" not in names:
        raise K3LabError(
            f"{notebook}: has no 'file' parameter, so it cannot be run once per output file "
            "(k3lab batch's notebooks: 01, 02, 03 and 06 in notebooks/)"
        )
    return names


def parameter_names(notebook: str | Path) -> frozenset[str]:
    """The names the notebook's cell tagged ``parameters`` assigns, as papermill finds that cell;
    one line when there is none. Reads the notebook only."""
    from k3lab.errors import K3LabError
    from k3lab.formats.files import InputFileError, parse_json, read_bounded

    try:
        nb = parse_json(read_bounded(notebook, NOTEBOOK_LIMIT, "notebook"), str(notebook))
    except InputFileError as e:
        raise K3LabError(str(e)) from None
    cells = nb.get("cells") if isinstance(nb, dict) else None
    tagged = [
        c
        for c in (cells if isinstance(cells, list) else [])
        if isinstance(c, dict)
        and c.get("cell_type") == "code"
        and isinstance(c.get("metadata"), dict)
        and isinstance(c["metadata"].get("tags"), list)
        and "parameters" in c["metadata"]["tags"]
    ]
    if not tagged:
        raise K3LabError(
            f"{notebook}: no cell tagged 'parameters' (papermill sets a notebook's parameters there)"
        )
    source = tagged[0].get("source", "")
    text = "".join(x for x in source if isinstance(x, str)) if isinstance(source, list) else str(source)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError) as e:
        raise K3LabError(f"{notebook}: its parameters cell is not Python ({type(e).__name__})") from None
    return frozenset(
        t.id
        for node in tree.body
        for t in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
        if isinstance(t, ast.Name)
    )


@dataclass(frozen=True)
class NotebookTask:
    """What a worker needs to run one notebook per output file (plain values: it travels to Dask)."""

    notebook: str
    run_dir: str
    parameters: tuple[tuple[str, Any], ...]  # the same for every file (meta, src, out_dir, run_token)
    run_token: str
    cell_timeout: float = CELL_TIMEOUT
    notebook_timeout: float = NOTEBOOK_TIMEOUT
    channel: str = ""  # set by the runner on Dask
    takes_file: bool = True  # whether the notebook is told which output file (its ``file`` parameter)


@dataclass
class NotebookRun:
    file: int  # the output file the notebook ran for
    status: str  # ok | failed
    seconds: float
    notebook: str
    error: str = ""
    number: int = 0  # (the runner's name for the file)
    skipped: bool = False

    def __post_init__(self) -> None:
        self.number = self.file


def run_notebook(
    task: NotebookTask, number: int, next_number: Any = None, plan_state: Any = None
) -> NotebookRun:
    """The notebook for output file ``number``, run by papermill in a process of its own within the
    task's timeouts; never raises for the notebook's own failure: reports it."""
    output = str(Path(task.run_dir) / f"file-{number:02d}.ipynb")
    parameters = {**dict(task.parameters), **({"file": number} if task.takes_file else {})}
    t0 = time.perf_counter()
    error = ""
    for attempt in range(START_ATTEMPTS):
        error = _papermill(task, output, parameters)
        if not error:
            return NotebookRun(number, "ok", time.perf_counter() - t0, output)
        if attempt + 1 < START_ATTEMPTS and any(k in error for k in KERNEL_START_ERRORS):
            time.sleep(random.uniform(0.5, 2.0) * (attempt + 1))  # a port race: try again
            continue
        break
    return NotebookRun(number, "failed", time.perf_counter() - t0, output, error)


_RUN = """
import json, sys, papermill
args = json.loads(sys.argv[1])
papermill.execute_notebook(args["notebook"], args["output"], parameters=args["parameters"],
    kernel_name=args["kernel"], progress_bar=False, log_output=False, start_timeout=120,
    execution_timeout=args["cell_timeout"])
"""


def _papermill(task: NotebookTask, output: str, parameters: dict[str, Any]) -> str:
    """'' when the notebook ran to its end; else one line saying why (the cell that failed or hung)."""
    args = {
        "notebook": task.notebook,
        "output": output,
        "parameters": parameters,
        "cell_timeout": task.cell_timeout,
        "kernel": KERNEL_NAME,
    }
    proc = subprocess.Popen(
        python_command(_RUN, json.dumps(args)),  # (isolated, and so is its kernel)
        env={**os.environ, **kernel_spec()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # (its kernel joins the group: killed with it)
    )
    try:
        _, err = proc.communicate(timeout=task.notebook_timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return f"{Path(task.notebook).name}: {_running_cell(output)} still running after the notebook's {task.notebook_timeout:g} s; stopped"
    except BaseException:  # Ctrl-C, a cancel: the kernel goes with it
        _kill_group(proc)
        raise
    finally:
        _kill_group(proc)  # (a kernel left behind by papermill's own exit)
    if proc.returncode == 0:
        return ""
    lines = [ln for ln in (err or "").strip().splitlines() if ln.strip()]
    said = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    if "CellTimeoutError" in err or "timed out" in said:
        return f"{Path(task.notebook).name}: {_running_cell(output)} ran past its {task.cell_timeout:g} s; stopped"
    return f"{Path(task.notebook).name}: {said.strip()[:300] or f'papermill exit {proc.returncode}'}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _running_cell(output: str) -> str:
    """Which cell was running when a notebook was stopped, from papermill's own record in the
    executed notebook: the last cell it started (``metadata.papermill.start_time``; after a timeout
    papermill marks every cell "completed", the stopped one included), as ``cell N (its first
    line)``, N counted in that executed notebook (its injected parameters cell included)."""
    try:
        nb = json.loads(Path(output).read_text()[: 64 << 20])
        started = [
            (i, c)
            for i, c in enumerate(nb.get("cells", []))
            if (c.get("metadata", {}).get("papermill", {}) or {}).get("start_time")
        ]
        if started:
            i, cell = started[-1]
            first = "".join(cell.get("source", "")).strip().splitlines()[:1]
            return f"cell {i + 1} ({first[0][:60]!r})" if first else f"cell {i + 1}"
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return "a cell"


def notebook_task(
    notebook: str | Path,
    meta: str | Path,
    src: str | Path,
    out_dir: str | Path,
    run_dir: Path,
    run_token: str,
    cell_timeout: float = CELL_TIMEOUT,
    notebook_timeout: float = NOTEBOOK_TIMEOUT,
) -> NotebookTask:
    given = {
        "meta": str(Path(meta).resolve()),
        "src": str(Path(src).resolve()),
        "out_dir": str(Path(out_dir).resolve()),
        "run_token": run_token,
    }
    declared = declared_parameters(notebook)  # (papermill warns of a parameter the notebook lacks)
    parameters = {k: v for k, v in given.items() if k in declared}
    return NotebookTask(
        str(Path(notebook).resolve()),
        str(run_dir.resolve()),
        tuple(sorted(parameters.items())),
        run_token,
        cell_timeout,
        notebook_timeout,
    )


def summary(run_dir: Path, results: list[NotebookRun]) -> str:
    lines = [f"run {run_dir}", f"{'file':>5}  {'status':<7} {'seconds':>8}  notebook / error"]
    for r in results:
        lines.append(
            f"{r.file:>5}  {r.status:<7} {r.seconds:>8.1f}  {Path(r.notebook).name}"
            + (f"  {r.error}" if r.error else "")
        )
    failed = [r.file for r in results if r.status != "ok"]
    lines.append(
        f"{len(results) - len(failed)} ok, {len(failed)} failed"
        + (f" (files {','.join(map(str, failed))}: run the same command again)" if failed else "")
    )
    return "\n".join(lines)
