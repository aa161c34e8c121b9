"""The house a newcomer finds their way in: rooms of a readable size, no module named after the
standard library, docstrings that name what exists, a pipeline that never reaches back into the
front (by import or by a callable the front hands it), and a run that enters the folder's state in
a few places only."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import sys
import typing
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "k3lab"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 400
FRONT = (
    "k3lab.cli",
    "k3lab.request",
    "k3lab.variants",
    "k3lab.demo",
    "k3lab.explore",
    "k3lab.lab",
    "k3lab.plots",
)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_no_module_is_named_after_the_standard_library() -> None:
    shadows = sorted(str(p.relative_to(ROOT)) for p in MODULES if p.stem in sys.stdlib_module_names)
    assert not shadows, shadows


def _docstrings() -> list[tuple[str, str]]:
    """(module, docstring) of every module, class and function of the package."""
    found = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    found.append((_name(path), doc))
    return found


def test_docstrings_name_only_modules_that_exist() -> None:
    """A module a docstring names by the package-relative form (``pipeline.MODULE``, ``pipeline.MODULE.NAME``)
    is there: a moved module leaves no stale pointer behind. (Paths, file names and ``k3lab.`` names, in
    docstrings and pages alike: ``tests/unit/test_docs.py``.)"""
    dotted = {_name(p) for p in MODULES}
    missing = []
    for module, doc in _docstrings():
        for ref in re.findall(r"``((?:k3lab\.)?pipeline\.[a-z_]+(?:\.[a-z_]+)*)``", doc):
            name = ref if ref.startswith("k3lab.") else f"k3lab.{ref}"
            # a module, or a name in one (``pipeline.state.record`` or ``pipeline.running.task.run_task``)
            if name not in dotted and name.rpartition(".")[0] not in dotted:
                missing.append((module, ref))
    assert not missing, missing


def test_the_pipeline_hands_the_front_no_way_back() -> None:
    """Nothing the pipeline runs comes from the front: no module of it imports the front, and the
    plain values that carry a run across processes (``Task``, ``Publication``, ``RunOptions``) hold
    no callable a front could have put there."""
    for path in (PACKAGE / "pipeline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(FRONT), (path, node.module)
    carriers = [
        ("k3lab.pipeline.running.task", "Task"),
        ("k3lab.pipeline.publishing.publish", "Publication"),
        ("k3lab.pipeline.running.start", "RunOptions"),
        ("k3lab.pipeline.running.batch", "NotebookTask"),
    ]
    for module, name in carriers:
        cls = getattr(importlib.import_module(module), name)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert "Callable" not in str(hints[f.name]), (name, f.name, hints[f.name])


def test_the_runners_calls_stay_in_the_pipeline() -> None:
    """Every call ``runner.py``, ``start.py``, ``task.py`` and ``processes.py`` make is to a name they
    import from the pipeline, the formats, the errors or values, the standard library or a library;
    or to their own functions; or a method of something they hold: none reaches a callable of the
    front's."""
    for module in ("runner", "start", "task", "processes", "cluster"):
        path = PACKAGE / "pipeline" / "running" / f"{module}.py"
        tree = ast.parse(path.read_text())
        imported: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    imported[a.asname or a.name] = node.module
            elif isinstance(node, ast.Import):
                for a in node.names:
                    imported[(a.asname or a.name).split(".")[0]] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                origin = imported.get(node.func.id, "")
                assert not origin.startswith(FRONT), (module, node.func.id, origin)


def _state_calls(path: Path, functions: set[str] | None = None) -> list[str]:
    """The calls into the folder's state (``OutputFolder(...)`` and what hangs on it) in ``path``."""
    tree = ast.parse(path.read_text())
    calls = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
            functions and fn.name not in functions
        ):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                text = ast.unparse(node.func)
                if re.match(r"(OutputFolder\(.*\)|folder)\.", text):
                    calls.append(f"{path.name}:{fn.name}: {text}")
    return calls


def test_a_convert_request_enters_the_folders_state_in_few_places() -> None:
    """A walk of the Request from ``k3lab convert`` until it becomes plain tasks (request.py's convert
    and the source it opens, the runner, the start of a run): the places it calls into the folder's
    state. Counted by call site: each one is a door into ``pipeline/state`` that a reader follows."""
    calls = _state_calls(PACKAGE / "request.py", {"convert", "output_source"})
    calls += _state_calls(PACKAGE / "pipeline" / "running" / "start.py")
    calls += _state_calls(
        PACKAGE / "pipeline" / "running" / "runner.py",
        {"convert_shards", "run_planned", "_found_complete", "_executor"},
    )
    assert len(calls) <= 9, calls  # (a set's variants: their commands, their manifests)
