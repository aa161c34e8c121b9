"""Notebook parameters and the helpers behind them, given what cannot mean anything (#37): one line
naming the parameter, before anything is read or fetched, under papermill as in a batch; indexes
checked, never wrapped (a row -1 would read the bytes before a tensor: another tensor's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import papermill
import pytest
from conftest import ROOT

from k3lab import explore
from k3lab.errors import K3LabError
from k3lab.explore.parameters import ParameterError, check_parameters

BAD = {
    "repo": ["../../etc/passwd", "a/b/c", "org/na me", 7],
    "revision": ["main\x1b[2J", "../main", "-x", "a b", "", 3],
    "shard": [0, -1, True, 1.5, "2"],
    "file": [0, -3, 1.5],
    "layers": ["2", [-1], [True], [1.0], list(range(2000))],
    "proj": ["w9", "", None],
    "expert": [-1, "0", 0.0],
    "sample_rows": [0, -1, "64"],
    "sample": [-1, "1"],
    "seed": [-5],
    "check": ["yes", 1, None],
    "src": [None, "", 3, "a\0b"],
    "text": [None, "x" * (2 << 20)],
}


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD.items() for v in vs])
def test_a_parameter_that_cannot_mean_anything_is_one_line_naming_it(name: str, value: object) -> None:
    with pytest.raises(ParameterError) as e:
        check_parameters(**{name: value})
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"notebook parameter {name}=") and "\x1b" not in line, line


def test_every_notebooks_defaults_pass_and_a_typo_is_named() -> None:
    check_parameters(src="k3-demo/src", repo=None, revision=None, shard=2, layers=[1, 2], proj="w2", expert=0)
    check_parameters(repo="moonshotai/Kimi-K3", revision="refs/pr/1", sample_rows=None, check=True)
    with pytest.raises(ParameterError, match="notebook parameter shrad: k3lab does not know it"):
        check_parameters(shrad=2)


@pytest.mark.parametrize(
    "notebook,params,needle",
    [
        (
            "01-tensor-layouts.ipynb",
            {"shard": 99},
            "notebook parameter shard=99: this checkpoint has 1 to 11",
        ),
        ("02-mxfp4-scales.ipynb", {"proj": "w9"}, "notebook parameter proj='w9': give one of w1, w2, w3"),
        ("03-convert-a-file.ipynb", {"file": 0}, "notebook parameter file=0: give a whole number from 1"),
        (
            "04-vision-and-tokenizer.ipynb",
            {"sample_rows": -1, "check": False},
            "notebook parameter sample_rows=-1",
        ),
        (
            "05-verify-a-run.ipynb",
            {"repo": "a/b", "revision": "main\x1b[2J"},
            "notebook parameter revision='main\\x1b[2J': give a branch, tag or commit",
        ),
    ],
)
def test_papermill_says_one_line_naming_the_parameter(
    tiny_src: Path, tmp_path: Path, notebook: str, params: dict, needle: str, monkeypatch
) -> None:
    """Before anything is read: the Hub is never asked (nothing listens where it would be)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    where = (
        {"meta": str(tiny_src), "src": str(tiny_src)} if notebook.startswith("03") else {"src": str(tiny_src)}
    )
    if notebook.startswith(("01", "03", "05")):
        where["out_dir"] = str(tmp_path / "out")
    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(
            str(ROOT / "notebooks" / notebook),
            str(tmp_path / notebook),
            parameters={**where, **params},
            kernel_name="python3",
            progress_bar=False,
            cwd=str(tmp_path),
            execution_timeout=120,
        )
    said = [line for line in str(e.value).splitlines() if line.strip() and not line.startswith("---")]
    assert said[-1].startswith("ParameterError: ") and needle in said[-1], said
    assert "Traceback" not in str(e.value) and len(said) == 2, (
        said
    )  # "Exception encountered at ...", the line
    assert not (tmp_path / "out").exists()


def test_helpers_never_wrap_an_index(tiny_src: Path, tmp_path: Path) -> None:
    from k3lab.kimi_k3.rules import expert_tensor

    plan, source = explore.open_conversion(tiny_src, tiny_src, tmp_path / "out")
    for bad in (0, -1, len(source.files()) + 1, True):
        with pytest.raises(K3LabError, match=f"shard {bad!r}: give a number from 1 to"):
            explore.shard_rows(plan, source, bad)
    for bad in (0, -1, 2):
        with pytest.raises(K3LabError, match=f"file {bad}: give a number from 1 to 1"):
            explore.derive_tensor(plan, source, bad)
    name = expert_tensor(1, 0, "w2", "weight_packed")
    assert np.asarray(source.rows(name, 0, 2)).shape[0] == 2
    for start, stop in ((-1, None), (0, -1), (-2, -1)):
        with pytest.raises(K3LabError, match=r"rows \[.*\): give rows from 0 on"):
            source.rows(name, start, stop)
    with pytest.raises(K3LabError, match="expert -1: layer 1 has experts 0 to 7"):
        explore.expert_codes(source, 1, "w2", -1)
    with pytest.raises(K3LabError, match="expert 8: layer 1 has experts 0 to 7"):
        explore.first_block(source, 1, "w2", 8)
    with pytest.raises(K3LabError, match="block -1: a row of"):
        explore.first_block(source, 1, "w2", 0, block=-1)
    with pytest.raises(K3LabError, match="layer 0: no routed experts"):  # (layer 0 is dense)
        explore.expert_codes(source, 0, "w2", 0)
    for layer, proj, said in (
        (99, "w2", "layer 99: no routed experts"),
        (0, "w1", "layer 0: no routed"),
        (-1, "w3", "layer -1: no routed"),
        (1, "w4", "proj 'w4': give one of w1, w2, w3"),
    ):
        with pytest.raises(K3LabError, match=said):  # (not an empty view)
            explore.scale_stats(source, layer, proj)


def test_a_layers_list_with_no_moe_layer_is_one_line(tiny_src: Path) -> None:
    cfg, _ = explore.open_checkpoint(tiny_src)
    assert explore.moe_layers(cfg, [99, 0, 1]) == [1]  # past the end and dense: left out, as printed
    with pytest.raises(
        K3LabError, match=r"^notebook parameter layers=\[0, 99\]: this checkpoint has \d+ layers"
    ):
        explore.moe_layers(cfg, [0, 99])


def test_notebook_paths_start_at_the_repository(monkeypatch, tmp_path: Path) -> None:
    """Without K3LAB_HOME, relative notebook paths start at the checkout k3lab runs from, whatever
    the working folder (they fell back to it when the module moved a level down)."""
    monkeypatch.delenv("K3LAB_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert explore.home() == ROOT and explore.resolve("k3-demo/src") == ROOT / "k3-demo" / "src"


def test_tables_read_at_a_glance_and_codes_in_value_order() -> None:
    from k3lab.plots import code_histogram

    table = explore.html_table([{"tensor": "blk.0.attn_q.weight", "shape": [7168, 2048], "bytes": 29360128}])
    assert "<td>[7168, 2048]</td>" in table and "<td style='text-align:right'>29,360,128</td>" in table
    assert "<table style='white-space:nowrap'>" in table
    codes = np.array([0, 8, 15, 7, 1, 1])  # +0, -0, -6, +6, +0.5, +0.5
    ax = code_histogram(codes).axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [
        "-6",
        "-4",
        "-3",
        "-2",
        "-1.5",
        "-1",
        "-0.5",
        "-0",
        "+0",
        "+0.5",
        "+1",
        "+1.5",
        "+2",
        "+3",
        "+4",
        "+6",
    ]
    heights = [round(p.get_height(), 3) for p in ax.patches]
    assert heights[0] == heights[7] == heights[8] == heights[15] == round(1 / 6, 3) and heights[9] == round(
        2 / 6, 3
    )
