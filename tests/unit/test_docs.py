"""The documentation a newcomer reads: a README short enough to read in five minutes, every link of it
and of docs/ resolving (files and anchors), and the generated reference pages exactly what the code
prints now."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_the_cli_reference_is_what_the_parser_makes() -> None:
    """docs/reference/cli.md regenerates byte-identical (`python -m k3lab.cli_reference`)."""
    from k3lab.cli_reference import markdown

    assert (ROOT / "docs" / "reference" / "cli.md").read_text() == markdown(), (
        "docs/reference/cli.md is stale: python -m k3lab.cli_reference > docs/reference/cli.md"
    )


def test_the_readmes_local_recipe_runs_as_written_after_the_demo(tmp_path: Path) -> None:
    """Every `k3lab` line of the README that works on the demo's folder, run verbatim (in a process of
    its own, from a folder where `k3lab demo` ran), succeeds."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.startswith("k3lab ") and "k3-demo/" in ln]
    assert len(lines) >= 4, lines
    k3 = [sys.executable, "-m", "k3lab.cli"]
    assert subprocess.run([*k3, "demo"], cwd=tmp_path, capture_output=True, timeout=600).returncode == 0
    for line in lines:
        r = subprocess.run(
            [*k3, *line.split()[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, (line, r.stderr[-2000:])


def test_the_metadata_reference_is_what_the_code_writes() -> None:
    """docs/reference/metadata.md regenerates byte-identical (`python -m k3lab.metadata_reference`)."""
    from k3lab.metadata_reference import markdown

    assert (ROOT / "docs" / "reference" / "metadata.md").read_text() == markdown(), (
        "docs/reference/metadata.md is stale: python -m k3lab.metadata_reference > docs/reference/metadata.md"
    )
