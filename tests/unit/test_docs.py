"""The documentation a newcomer reads: a README short enough to read in five minutes, every link of it
and of docs/ resolving (files and anchors), and the generated reference pages exactly what the code
prints now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text, fence = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            text.append(_anchor(line.lstrip("#")))
    return set(text)


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, len(lines)
    assert DOCS and all(
        f"docs/{p.relative_to(ROOT / 'docs')}" in "\n".join(lines) for p in DOCS if p.parent.name == "docs"
    )


def test_every_link_of_the_readme_and_docs_resolves() -> None:
    for page in [ROOT / "README.md", *DOCS]:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            goal = (page.parent / path).resolve() if path else page
            assert goal.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
            if anchor:
                assert anchor in _anchors(goal), f"{page.relative_to(ROOT)}: {target}: no such heading"


def test_one_table_of_commands_and_one_of_notebooks() -> None:
    """The README's table of commands is the CLI reference's first (generated from the parser: a new
    command or a changed description fails here); docs/notebooks.md's one table lists exactly the
    notebooks there are, and the README names each."""
    from k3lab.cli_reference import summary

    readme = (ROOT / "README.md").read_text()
    assert "\n".join(summary("docs/reference/cli.md")) in readme, "README.md: its commands table is stale"
    there = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    page = (ROOT / "docs" / "notebooks.md").read_text()
    assert page.count("| notebook |") == 1 and re.findall(r"^\| `([^`]+)` \|", page, re.M) == there
    assert all(f"`{stem}`" in readme for stem in there)


def test_the_cli_reference_is_what_the_parser_makes() -> None:
    """docs/reference/cli.md regenerates byte-identical (`python -m k3lab.cli_reference`)."""
    from k3lab.cli_reference import markdown

    assert (ROOT / "docs" / "reference" / "cli.md").read_text() == markdown(), (
        "docs/reference/cli.md is stale: python -m k3lab.cli_reference > docs/reference/cli.md"
    )


@pytest.mark.parametrize("page", ["text", "mmproj"])
def test_the_metadata_references_are_what_the_code_writes(page: str) -> None:
    """docs/reference/metadata.md and mmproj.md regenerate byte-identical
    (`python -m k3lab.metadata_reference [mmproj]`)."""
    from k3lab.metadata_reference import markdown

    name = {"text": "metadata.md", "mmproj": "mmproj.md"}[page]
    assert (ROOT / "docs" / "reference" / name).read_text() == markdown(page), (
        f"docs/reference/{name} is stale: python -m k3lab.metadata_reference {page} > docs/reference/{name}"
    )


def test_the_on_disk_state_reference_is_what_a_conversion_leaves() -> None:
    """docs/reference/on-disk-state.md regenerates byte-identical (`python -m k3lab.state_reference`):
    the folder, the plan's fields and a record, from converting the tiny checkpoint now."""
    from k3lab.state_reference import markdown

    assert (ROOT / "docs" / "reference" / "on-disk-state.md").read_text() == markdown(), (
        "docs/reference/on-disk-state.md is stale: python -m k3lab.state_reference > docs/reference/on-disk-state.md"
    )


PATH_NAMED = re.compile(r"(?<![\w/.-])((?:k3lab|tests|benchmarks|docs|notebooks|\.ci)/[\w./-]*\w)")
MODULE_NAMED = re.compile(r"(?<![\w/.-])(k3lab(?:\.\w+)+)")
FILE_NAMED = re.compile(r"`([\w/]+\.(?:py|ipynb|jinja|toml))`")  # a file named by itself, in code


def _said() -> list[tuple[str, str]]:
    """(where, text) of everything a reader is told: every docstring of k3lab, benchmarks and the tests,
    and every page of the README and docs/."""
    import ast

    out = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in [ROOT / "README.md", *DOCS]]
    for py in sorted(p for top in ("k3lab", "benchmarks", "tests") for p in (ROOT / top).rglob("*.py")):
        tree = ast.parse(py.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out.append((f"{py.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}", doc))
    return out


# files of other projects the docs name (Moonshot's, llama.cpp's, fla's, llmcompressor's): judges, not ours
OTHERS = {
    "encoding_k3.py", "tokenization_kimi.py", "modeling_kimi_linear.py", "modeling_kimi_k3.py",
    "convert_hf_to_gguf.py", "fla/ops/kda/gate.py", "moe/context.py",
}  # fmt: skip
PLACEHOLDER = re.compile(r"[A-Z]{2,}")  # (``k3lab/MODULE.py``, ``file-NN``: a shape, not a name)


def _files() -> list[str]:
    """Every file of the project (what git tracks and what is about to be committed)."""
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\n")  # fmt: skip
    return ["/" + f for f in listed if f]


def _resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            thing = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(thing, attr):
                return False
            thing = getattr(thing, attr)
        return True
    return False


def test_no_docstring_or_page_names_a_file_or_module_that_does_not_exist() -> None:
    wrong, files = [], _files()
    for where, text in _said():
        for path in PATH_NAMED.findall(text):
            if not PLACEHOLDER.search(path) and "*" not in path and not (ROOT / path).exists():
                wrong.append(f"{where}: {path}")
        for name in FILE_NAMED.findall(text):
            if (
                name not in OTHERS
                and not PLACEHOLDER.search(name)
                and not any(f.endswith("/" + name) for f in files)
            ):
                wrong.append(f"{where}: {name}")
        for dotted in MODULE_NAMED.findall(text):
            if dotted.endswith(("py", "md", "json")) or PLACEHOLDER.search(dotted):
                continue
            if not _resolves(dotted):
                wrong.append(f"{where}: {dotted}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_says_how_many_tests_there_are() -> None:
    """The README's test count is pytest's own: the default run's, and the slow tests beside it."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    counts = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", done.stdout)
    assert counts, done.stdout[-2000:] + done.stderr[-2000:]
    said = f"({counts[1]} tests; {counts[3]} more marked `slow`)"
    assert said in " ".join((ROOT / "README.md").read_text().split()), f"README.md should say {said}"
