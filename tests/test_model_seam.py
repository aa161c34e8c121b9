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

from k3lab.formats import mxfp4
from k3lab.pipeline.checking.verify import verify
from k3lab.pipeline.running.runner import RunOptions, convert_shards
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.writing.folder import OutputFolder

PACKAGE = Path(__file__).resolve().parent.parent / "k3lab"


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
    banned = ("k3lab.kimi_k3", "k3lab.synth", "k3lab.cli", "k3lab.explore", "k3lab.demo", "k3lab.plots")
    for path in sorted((PACKAGE / layer).glob("*.py")):
        bad = sorted(m for m in _imports(path) if m.startswith(banned))
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}"
    if layer == "formats":  # and formats knows no pipeline either
        for path in sorted((PACKAGE / "formats").glob("*.py")):
            assert not [m for m in _imports(path) if m.startswith("k3lab.pipeline")], path


def _bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.gguf"))}


@pytest.mark.parametrize("seed", [0, 5])
def test_a_second_architecture_plans_converts_resumes_and_verifies(tmp_path: Path, seed: int) -> None:
    src = tmp_path / "toy"
    cfg = toy_model.write_checkpoint(src, seed=seed, experts=3 + seed)
    spec = SourceSpec.local(src)
    out = tmp_path / "out"

    results = convert_shards(
        toy_model.MODEL, spec, out, jobs=2, quiet=True
    )  # the model crosses to workers by name
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
    again = convert_shards(toy_model.MODEL, spec, out, quiet=True)
    assert all(r.skipped for r in again)
    (out / names[1]).unlink()
    redo = convert_shards(toy_model.MODEL, spec, out, quiet=True)
    assert [r.skipped for r in redo] == [True, False, True]
    assert _bytes(out) == first

    # verify: the bytes, the folder's plan, and every tensor re-derived from the source
    report = verify(out, model=toy_model.MODEL, source=spec, quiet=True)
    assert report.ok, report.problems
    assert report.files == 3 and report.tensors == sum(len(rr.tensors) for rr in OutputFolder(out).records())

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
    assert folder.load_plan(toy_model.MODEL) is not None
    assert folder.load_plan(KIMI) is None  # another model's plan reads as absent
    digest = hashlib.sha256((out / "Toy-MXFP4-00001-of-00003.gguf").read_bytes()).hexdigest()
    assert len(digest) == 64


def _readme_layout() -> dict[str, set[str]]:
    """The README's layout block: folder (``""`` for the package itself) -> the files it names."""
    text = (PACKAGE.parent / "README.md").read_text()
    block = text[text.index("```\nk3lab/\n") + 4 :]
    block = block[: block.index("```")]
    named: dict[str, set[str]] = {}
    folder = ""
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        head = line.split()[0] if line.strip() else ""
        if indent == 2 and head.endswith("/"):
            folder = head.rstrip("/")
            continue
        if indent == 2:
            folder = ""
        if indent in (2, 4):  # (deeper lines continue a description)
            first = re.split(r"\s{2,}", line.strip())[0]  # the names, before the description
            names = re.findall(r"\b[a-z_0-9]+\.(?:py|md)\b", first)
            named.setdefault(folder, set()).update(names)
    return named


def test_the_readme_layout_matches_the_tree() -> None:
    """Every public module of the package, formats, pipeline and kimi_k3 is named where it lives in the
    README's layout section, and every file named there exists."""
    named = _readme_layout()
    for folder in ("", "formats", "pipeline", "kimi_k3"):
        here = {
            p.name
            for p in (PACKAGE / folder).iterdir()
            if p.suffix in (".py", ".md") and not p.name.startswith("_")
        }
        assert named.get(folder, set()) == here, (
            f"README layout, k3lab/{folder}: not named {sorted(here - named.get(folder, set()))}, "
            f"named but missing {sorted(named.get(folder, set()) - here)}"
        )
