"""The model interface: a second architecture (tests/toy_model.py) goes through plan -> convert ->
resume -> verify with the pipeline as it is, and the pipeline and formats import nothing of Kimi-K3."""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import toy_model
from conftest import ROOT

from k3lab.formats import mxfp4
from k3lab.pipeline.checking.verify import verify
from k3lab.pipeline.planning.split import make_split
from k3lab.pipeline.running.runner import convert_shards
from k3lab.pipeline.running.start import RunOptions
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.state import OutputFolder

PACKAGE = ROOT / "k3lab"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


@pytest.mark.parametrize("layer", ["pipeline", "formats"])
def test_the_pipeline_and_formats_import_no_model(layer: str) -> None:
    """Every import, at the top or inside a function: none of the model, the front or synth."""
    banned = (
        "k3lab.kimi_k3",
        "k3lab.kimi_k3.synth",
        "k3lab.cli",
        "k3lab.explore",
        "k3lab.demo",
        "k3lab.plots",
    )
    banned += ("k3lab.request",)  # (values.py: user values, no front)
    paths = sorted((PACKAGE / layer).rglob("*.py"))
    assert len(paths) > 5
    for path in paths:
        bad = sorted(m for m in _imports(path) if m.startswith(banned))
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}"
    if layer == "formats":  # and formats knows no pipeline either
        for path in sorted((PACKAGE / "formats").rglob("*.py")):
            assert not [m for m in _imports(path) if m.startswith("k3lab.pipeline")], path


def _bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.gguf"))}


@pytest.mark.parametrize("seed", [0, 5])
def test_a_second_architecture_plans_converts_resumes_and_verifies(tmp_path: Path, seed: int) -> None:
    src = tmp_path / "toy"
    cfg = toy_model.write_checkpoint(src, seed=seed, experts=3 + seed)
    spec = SourceSpec.local(src)
    out = tmp_path / "out"

    # a layer per output file, from the toy's ONE source file: the model crosses to workers by name
    per_layer = RunOptions(split=make_split(None, 1))
    results = convert_shards(toy_model.MODEL, spec, out, jobs=2, quiet=True, options=per_layer)
    assert [r.skipped for r in results] == [False, False, False]
    names = [r.filename for r in results]
    assert names == [f"Toy-MXFP4-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    first = _bytes(out)

    # what gguf-py reads back is the toy's own: its keys, its transform, the MXFP4 repack
    r = gguf.GGUFReader(out / names[0])
    assert r.fields["general.architecture"].contents() == "toy"
    assert r.fields["toy.expert_count"].contents() == cfg.n_expert
    tensors = {t.name: t for t in r.tensors}
    from k3lab.pipeline.sources.local import LocalSource

    source = LocalSource(src)
    gate = np.asarray(source.array("layers.0.gate"))
    assert np.array_equal(np.asarray(tensors["blk.0.ffn_gate.weight"].data), -gate)
    want = np.concatenate(
        [
            mxfp4.repack(
                np.asarray(source.array(f"layers.0.experts.{e}.weight_packed")),
                np.asarray(source.array(f"layers.0.experts.{e}.weight_scale")),
            ).reshape(-1)
            for e in range(cfg.n_expert)
        ]
    )
    assert np.array_equal(np.asarray(tensors["blk.0.ffn_up_exps.weight"].data).reshape(-1), want)

    # resume: nothing redone; one file removed: only it is redone, byte-identical
    again = convert_shards(toy_model.MODEL, spec, out, quiet=True, options=per_layer)
    assert all(r.skipped for r in again)
    (out / names[1]).unlink()
    redo = convert_shards(toy_model.MODEL, spec, out, quiet=True, options=per_layer)
    assert [r.skipped for r in redo] == [True, False, True]
    assert _bytes(out) == first

    # verify: the bytes, the folder's plan, and every tensor re-derived from the source
    report = verify(out, model=toy_model.MODEL, source=spec, quiet=True)
    assert report.ok, report.problems
    assert report.files == 3 and report.tensors == sum(
        len(rr.tensors) for rr in OutputFolder(out).records.all()
    )

    # and it fails where it should: one byte of the MXFP4 stack flipped
    path = out / names[0]
    data = bytearray(path.read_bytes())
    t = tensors["blk.0.ffn_up_exps.weight"]
    data[t.data_offset + 5] ^= 0x10
    path.write_bytes(bytes(data))
    bad = verify(out, model=toy_model.MODEL, quiet=True)
    assert [p for p in bad.problems if "blk.0.ffn_up_exps.weight: SHA-256 differs" in p], bad.problems


def test_a_toy_plan_is_never_taken_for_a_kimi_plan(tmp_path: Path) -> None:
    from k3lab.kimi_k3.model import MODEL as KIMI

    src = tmp_path / "toy"
    toy_model.write_checkpoint(src)
    out = tmp_path / "out"
    convert_shards(toy_model.MODEL, SourceSpec.local(src), out, quiet=True, options=RunOptions())
    folder = OutputFolder(out)
    assert folder.plans.load(toy_model.MODEL) is not None
    assert folder.plans.load(KIMI) is None  # another model's plan reads as absent
    digest = hashlib.sha256((out / "Toy-64K-MXFP4.gguf").read_bytes()).hexdigest()
    assert len(digest) == 64


def _readme_layout() -> dict[str, set[str]]:
    """The architecture page's layout block: folder (``""`` for the package itself, ``pipeline/sources``
    ...) -> the files it names. Indentation gives the nesting: a name ending in ``/`` opens a folder."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text[text.index("```\nk3lab/\n") + 4 :]
    block = block[: block.index("```")]
    named: dict[str, set[str]] = {}
    folders: list[tuple[int, str]] = []  # (indent, name) of the folders open at this line
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = re.split(r"\s{2,}", line.strip())[0]  # the names, before the description
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if folders and indent > folders[-1][0] + 2:
            continue  # (a description's continuation)
        if not folders and indent > 2:
            continue
        if first.endswith("/") and " " not in first:
            folders.append((indent, first.rstrip("/")))
            continue
        where = "/".join(name for _, name in folders)
        named.setdefault(where, set()).update(re.findall(r"\b[a-z_0-9]+\.(?:py|md)\b", first))
    return named


def test_the_readme_layout_matches_the_tree() -> None:
    """Every public module of the package and its folders is named where it lives in the layout section
    of docs/architecture.md, and every file named there exists."""
    named = _readme_layout()
    folders = [""] + sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()
    )
    folders = [f for f in folders if not f.startswith("synth")]
    for folder in folders:
        here = {
            p.name
            for p in (PACKAGE / folder).iterdir()
            if p.suffix in (".py", ".md") and not p.name.startswith("_")
        }
        assert named.get(folder, set()) == here, (
            f"docs/architecture.md layout, k3lab/{folder}: not named {sorted(here - named.get(folder, set()))}, "
            f"named but missing {sorted(named.get(folder, set()) - here)}"
        )
        assert (PACKAGE / folder / "__init__.py").read_text().strip().startswith('"""'), (
            folder
        )  # says its job


def _module_imports() -> dict[str, set[str]]:
    """Every k3lab module -> the k3lab modules it imports, at the top or inside a function
    (``from pkg import name`` counts as importing ``pkg.name`` when that is a module)."""
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: ``from . import x``, ``from .mod import y``, ``from .. import z``
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([node.module] if node.module else []))
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
                found |= subs
                if len(subs) < len(node.names):  # (a name from the package itself, not a submodule)
                    found.add(base)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycles_not_even_inside_functions() -> None:
    graph = _module_imports()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1 and not m.startswith(n + "."):  # (a package's own __init__ is no cycle)
                cycle = path[path.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_one_owner_of_each_name_on_disk() -> None:
    """The manifest's name, the partial suffix, the scratch and worker folders: each spelled in one module."""
    owners = {
        '"MANIFEST.json"': "k3lab/pipeline/state/record.py",
        '.partial"': "k3lab/formats/files.py",
        '/ "scratch"': None,  # (SCRATCH_NAME in state/names.py is the one default)
        "SCRATCH_NAME = ": "k3lab/pipeline/state/names.py",
        '"k3lab-dl-"': "k3lab/pipeline/sources/slots.py",
        '"k3lab-state/1"': "k3lab/pipeline/state/codec.py",
        'f"out-{': "k3lab/pipeline/running/task.py",
    }
    for spelling, owner in owners.items():
        found = sorted(
            str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py") if spelling in p.read_text()
        )
        assert found == ([owner] if owner else []), (spelling, found)


def test_declared_dependencies_are_the_imported_ones() -> None:
    """pyproject's dependencies name exactly the third-party packages k3lab imports (tests and the
    optional llama.cpp binding aside)."""
    import sys

    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=\[ ]", d)[0].lower().replace("-", "_") for d in project["dependencies"]}
    imported: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
    third = {m for m in imported if m not in sys.stdlib_module_names and m != "k3lab"}
    dists = {"distributed": "dask", "llama_cpp": "llama_cpp_python", "PIL": "pillow"}
    used = {dists.get(m, m).lower() for m in third} - {"llama_cpp_python"}  # (the optional binding)
    # what the notebooks and `k3lab lab` run on, never imported by k3lab itself
    runtimes = {"ipykernel", "jupyterlab", "jupytext", "papermill"}  # (batch runs papermill)
    # the Moonshot judge's packages: the `judge` extra, imported only by `check-logits --judge moonshot`
    judge = {
        re.split(r"[<>=\[ ]", d)[0].lower().replace("-", "_")
        for d in project["optional-dependencies"]["judge"]
    }
    judge -= {
        "fla_core",
        "transformers",
    }  # (fla: its files read, never imported; transformers: Moonshot's code imports it)
    assert used == (declared - runtimes) | judge, used ^ ((declared - runtimes) | judge)


def test_generated_files_name_no_stale_path() -> None:
    """TENSOR_MAP.md (pushed to every repo), the README and docs/ name only paths that exist."""
    docs = sorted(str(p.relative_to(PACKAGE.parent)) for p in (PACKAGE.parent / "docs").rglob("*.md"))
    for doc in ("TENSOR_MAP.md", "README.md", *docs):
        text = (PACKAGE.parent / doc).read_text()
        for path in sorted(
            set(re.findall(r"`((?:k3lab|tests|notebooks|benchmarks)/[\w/.-]+\.(?:py|md|ipynb))`", text))
        ):
            assert (PACKAGE.parent / path).exists(), (doc, path)
