"""The notebooks: thin, diffable (no stored outputs), papermill-ready, and they compute the right things."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import ROOT
from notebook_runs import NOTEBOOKS, images_of, result_of, run_notebook


def test_notebooks_are_stored_clean_and_parameterised() -> None:
    assert len(NOTEBOOKS) == 7
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), (
            f"{path.name} has outputs"
        )
        tagged = [c for c in code if "parameters" in c["metadata"].get("tags", [])]
        assert len(tagged) == 1, path.name
        # thin: no function or class definitions of their own beyond widget callbacks (show_*)
        src = "".join("\n" + "".join(c["source"]) for c in code)
        defs = re.findall(r"\ndef (\w+)", src)
        assert all(d.startswith("show") for d in defs) and len(defs) <= 2 and "class " not in src, path.name
        assert "import k3lab" in src or "from k3lab" in src


def test_notebooks_are_stored_as_jupyter_saves_them() -> None:
    """Canonical nbformat, as Jupyter writes a notebook, and clean as `k3lab lab`'s save hook leaves
    it: opening one, running it and saving it in `k3lab lab` changes no byte (git status stays clean)."""
    import nbformat

    from k3lab.lab import clean_notebook, strip_outputs_on_save

    for path in NOTEBOOKS:
        raw = path.read_text()
        nb = nbformat.reads(raw, as_version=4)
        assert nbformat.writes(nb) + "\n" == raw or nbformat.writes(nb) == raw, f"{path.name}: not canonical"
        # what JupyterLab sends on save after Run All: outputs, counts, run-time metadata
        ran = nbformat.reads(raw, as_version=4)
        for cell in ran.cells:
            if cell.cell_type == "code":
                cell.outputs = [nbformat.v4.new_output("stream", text="hello\n")]
                cell.execution_count = 3
                cell.metadata["execution"] = {"iopub.status.busy": "2026-11-30T00:00:00Z"}
        ran.metadata["language_info"] = {"name": "python", "version": "3.99.0"}
        ran.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
        model = {"type": "notebook", "content": ran}

        class Manager:
            root_dir = str(ROOT)

        strip_outputs_on_save(model, f"notebooks/{path.name}", Manager())
        assert nbformat.writes(model["content"]) == nbformat.writes(nb), path.name
        assert clean_notebook(nbformat.reads(raw, as_version=4)) == nb


def test_01_tensor_layouts(tiny_src: Path, tmp_path: Path) -> None:
    r = result_of(
        run_notebook(
            "01-tensor-layouts.ipynb", tmp_path, src=str(tiny_src), out_dir=str(tmp_path / "o"), shard=2
        )
    )
    assert r["file"] == "model-00002-of-000011.safetensors" and r["tensors"] == 76 and r["unmapped"] == []
    assert r["by_transform"]["mxfp4_stack"] == 48 and r["by_transform"]["neg_exp"] == 1
    r = result_of(
        run_notebook(
            "01-tensor-layouts.ipynb", tmp_path, src=str(tiny_src), out_dir=str(tmp_path / "o"), shard=4
        )
    )
    assert r["kv_b"] == ["blk.3.attn_k_b.weight + blk.3.attn_v_b.weight"]  # one source, both targets shown


def test_02_mxfp4_scales(tiny_src: Path, tmp_path: Path) -> None:
    out = run_notebook("02-mxfp4-scales.ipynb", tmp_path, src=str(tiny_src))
    r = result_of(out)
    # the histograms, then the picked expert's codes and exponents: plain outputs (no Output widget),
    # so a headless run shows the default view whole and never waits on a front end
    assert images_of(out) == 3
    nb = json.loads(out.read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if "OutputModel" in json.dumps(o)]
    assert r["layers"] == [1, 2, 5] and len(r["summary"]) == 3 and r["heatmap"] == [8, 2]  # w2 of each layer
    assert sum(r["code_counts"]) == 64 * 96 and all(c > 0 for c in r["code_counts"][1:8])
    assert all(-8 < row["mean exponent"] < 0 for row in r["summary"])


def test_03_convert_shard(tiny_src: Path, tiny_one: Path, tmp_path: Path) -> None:
    r = result_of(
        run_notebook(
            "03-convert-a-file.ipynb",
            tmp_path,
            meta=str(tiny_src),
            src=str(tiny_src),
            out_dir=str(tmp_path / "out"),
            file=1,
        )
    )
    assert r["verified"] and r["tensors"] == 218 and not r["skipped"]  # tiny fits in one file
    assert (tmp_path / "out" / r["file"]).read_bytes() == (tiny_one / r["file"]).read_bytes()
    assert len(bytes.fromhex(r["block"]["ggml bytes"])) == 17


def test_04_vision_and_tokenizer(tiny_src: Path, tmp_path: Path) -> None:
    import moonshot

    moonshot.chat()  # (Moonshot's files unpacked where k3lab finds them: the notebook shows its column)
    out = run_notebook(
        "04-vision-and-tokenizer.ipynb",
        tmp_path,
        src=str(tiny_src),
        text="the quick brown fox",
        mmproj_dir=str(tmp_path / "vision"),
    )
    r = result_of(out)
    assert r["blocks"] == 2 and r["parameters"] == 2 * (64 * 2 + 192 * 64 + 64 * 64 + 2 * 256 * 64)
    assert r["ids"] and r["bytes_per_token"] > 2 and images_of(out) == 3  # spread, image, stages
    # the sample (200 x 150) padded to 224 x 168: 12 x 16 patches, 48 tokens; every stage agrees
    assert (r["image_grid"], r["image_tokens"]) == ([12, 16], 48)
    assert r["prompt"] == "<|media_begin|>image 200x150<|media_content|><|media_pad|><|media_end|>"
    stages = ["patch embed", "position table", "block 0", "block 1", "final norm", "merge", "projector"]
    assert r["stages"] == [[s, True] for s in stages]
    assert (tmp_path / "vision" / "mmproj-Kimi-K3.gguf").is_file()
    # the sample chat: Moonshot's encoder and the template write the same text, and llama.cpp's ids of
    # it are Moonshot's (no special-token text in it, no seam that tokenizes otherwise)
    assert r["chat_same_text"] is True and r["chat_ids"] > 600 and r["chat_ids_differ"] is False


def test_05_verify_a_run(tiny_src: Path, tiny_out: Path, tmp_path: Path) -> None:
    r = result_of(run_notebook("05-verify-a-run.ipynb", tmp_path, out_dir=str(tiny_out), src=str(tiny_src)))
    three = {
        k: r.pop(k) for k in ("reference_vs_moonshot", "llama_vs_moonshot_first", "choices_vs_moonshot_first")
    }
    assert r == {"files": 9, "tensors": 218, "ok": True, "problems": []}
    # the three forwards: k3lab's reference is Moonshot's forward (float32 both); llama.cpp's first
    # layer within its BF16 rounding of matmul inputs
    assert three["reference_vs_moonshot"] < 1e-8, three
    assert 0 < three["llama_vs_moonshot_first"] < 1e-3, three
    # the runtime's own choices are what parts llama.cpp from Moonshot: its line lies on llama.cpp's
    assert (
        abs(three["choices_vs_moonshot_first"] - three["llama_vs_moonshot_first"])
        < 0.1 * three["llama_vs_moonshot_first"]
    )


def test_06_variants(tiny_src: Path, tiny_out: Path, tmp_path: Path) -> None:
    """The whole model's size per variant, one layer's tensors quantised and compared, and (llama.cpp
    installed) the set's cost tables drawn with the size-loss curve, the variants made in the set's
    folder and their KL divergence from the lossless set."""
    import importlib.util
    import shutil

    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    imatrix = str(ROOT / "tests" / "data" / "imatrix-tiny.gguf")
    r = result_of(run_notebook("06-variants.ipynb", tmp_path, src=str(tiny_src), out_dir=str(out),
                               types=["Q8_0", "Q2_K", "MoE-Q2_K"], imatrix=imatrix))  # fmt: skip
    sizes = {s["variant"]: s for s in r["sizes"]}
    assert list(sizes) == ["Q8_0", "Q2_K", "MoE-Q2_K"] and all(s["files"] == 9 for s in sizes.values())
    assert sizes["Q2_K"]["bytes"] < sizes["MoE-Q2_K"]["bytes"] < sizes["Q8_0"]["bytes"]
    errors = {(e["tensor"], e["variant"]): e["rel_rmse"] for e in r["errors"]}
    down = "blk.1.ffn_down_exps.weight"
    assert 0 < errors[(down, "Q8_0")] < errors[(down, "Q2_K")] < 1
    if importlib.util.find_spec("llama_cpp") is not None:
        assert set(r["kl"]) == {"Q8_0", "Q2_K", "MoE-Q2_K"} and r["kl"]["Q8_0"][0] < r["kl"]["Q2_K"][0]
        # the cost tables' predicted loss orders them as llama.cpp's KL does
        assert 0 < r["predicted"]["Q8_0"] < r["predicted"]["Q2_K"], r["predicted"]
        assert any((out / ".k3lab" / "costs").glob("costs-*.json"))
        assert (out / "Q2_K" / "Kimi-K3-Q2_K-00001-of-00009.gguf").is_file()


def test_07_importance_matrix(tiny_one: Path, tmp_path: Path) -> None:
    """The set's imatrix computed as `k3lab imatrix` computes it, its coverage drawn (layers x
    experts), llama-imatrix's figures per tensor (the rows `--show-statistics` prints) and one
    tensor's columns."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("SKIPPED LOUDLY: the imatrix needs llama-cpp-python (pip install 'k3lab[llama]')")
    out = tmp_path / "set"
    shutil.copytree(tiny_one, out)
    text = str(ROOT / "tests" / "data" / "imatrix-calibration.txt")
    nb = run_notebook("07-importance-matrix.ipynb", tmp_path, out_dir=str(out), calibration=text, chunks=4,
                      chunk_size=64)  # fmt: skip
    r = result_of(nb)
    assert (out / "imatrix.gguf").is_file() and r["imatrix"] == str(out / "imatrix.gguf")
    assert 0 < r["experts_reached"] < r["experts"] and r["unreached"]
    from k3lab.imatrix import statistics

    assert r["rows"] == [s.row() for s in statistics(out / "imatrix.gguf").tensors]
    assert images_of(nb) == 3


def test_notebook_defaults_run_anywhere(tmp_path: Path, monkeypatch) -> None:
    """With no parameters but the result file, a notebook's paths start at $K3LAB_HOME (what `k3lab
    lab` sets), not at the kernel's working folder, and it synthesises what it needs there."""
    home = tmp_path / "home"
    monkeypatch.setenv("K3LAB_HOME", str(home))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = result_of(run_notebook("05-verify-a-run.ipynb", elsewhere))  # converts the whole demo set first
    assert r["ok"] and r["files"] == 1
    r = result_of(run_notebook("03-convert-a-file.ipynb", elsewhere))  # the same set, not a second checkpoint
    assert r["verified"] and r["skipped"] and (home / "k3-demo" / "out" / r["file"]).is_file()
    assert not (elsewhere / "k3-demo").exists()


def test_scale_histogram_keeps_far_outliers_off_the_axis_and_says_so() -> None:
    """One block at 2^-127 must not squeeze the histograms into a single bar: the axis spans the
    bulk, and the panel says how many blocks it left off and where they are."""
    import numpy as np

    from k3lab.plots import scale_histograms

    rng = np.random.default_rng(0)
    bulk = (127 - 4 + rng.integers(-3, 3, (64, 32))).astype(np.uint8)
    with_outlier = bulk.copy()
    with_outlier[0, 0] = 0
    counts = {
        (1, "w1"): np.bincount(bulk.ravel(), minlength=256),
        (1, "w3"): np.bincount(with_outlier.ravel(), minlength=256),
    }
    fig = scale_histograms(counts)
    plain, squeezed = fig.axes
    assert plain.get_xlim()[0] > -10 and squeezed.get_xlim()[0] > -10
    assert [t.get_text() for t in plain.texts] == []
    assert [t.get_text() for t in squeezed.texts] == ["1 block left off: exponents from -127 to -2"]


def test_vision_block_plot_counts_blocks_in_whole_numbers() -> None:
    from matplotlib.ticker import MaxNLocator

    from k3lab.plots import block_stats

    fig = block_stats([{"block": 0, "wo": 0.1}, {"block": 1, "wo": 0.2}], ["wo"], "t")
    assert isinstance(fig.axes[0].xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in fig.axes[0].get_xticks())


def test_k3lab_lab_passes_jupyter_arguments_through_and_knows_root(monkeypatch) -> None:
    from k3lab import lab
    from k3lab.cli import main

    seen = {}
    monkeypatch.setattr(lab, "run_lab", lambda extra: seen.setdefault("extra", list(extra)) and 0)
    assert main(["lab", "--no-browser", "--port=9999", "--ServerApp.token="]) == 0
    assert seen["extra"] == ["--no-browser", "--port=9999", "--ServerApp.token="]
    cmd, env = lab.lab_command(["--port=1"])
    assert "--ContentsManager.pre_save_hook=k3lab.lab.strip_outputs_on_save" in cmd and cmd[-1] == "--port=1"
    assert ("--allow-root" in cmd) == (os.geteuid() == 0) and env["K3LAB_HOME"] == str(ROOT)
