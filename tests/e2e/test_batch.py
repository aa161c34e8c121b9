"""k3lab batch: the conversion notebook run per output file with papermill on a Dask LocalCluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import (
    PER_LAYER,
    ROOT,  # noqa: E402  (the repository)
)

from k3lab.cli import main

NOTEBOOK = str(ROOT / "notebooks" / "03-convert-a-file.ipynb")


def _batch_args(src: Path, out: Path, runs: Path, run_id: str) -> list[str]:
    return [
        "batch",
        "--notebook",
        NOTEBOOK,
        "--meta",
        str(src),
        "--out-dir",
        str(out),
        "--workers",
        "2",
        "--runs-dir",
        str(runs),
        "--run-id",
        run_id,
        "--split-max-tensors",  # a layer per file: nine notebooks
        "1",
    ]


def _batch_cmd(src: Path, out: Path, runs: Path, run_id: str) -> list[str]:
    return [sys.executable, "-m", "k3lab.cli", *_batch_args(src, out, runs, run_id)]


@pytest.mark.slow  # (the batch's Dask path runs by default in the looking notebooks' batch below)
def test_batch_on_a_local_cluster(tiny_src: Path, tiny_out: Path, tmp_path: Path, capsys) -> None:
    out, runs = tmp_path / "out", tmp_path / "runs"
    code = main(_batch_args(tiny_src, out, runs, "first"))
    text = capsys.readouterr().out
    assert code == 0, text
    assert "9 ok, 0 failed" in text
    executed = sorted((runs / "first").glob("file-*.ipynb"))
    assert [p.name for p in executed] == [f"file-{k:02d}.ipynb" for k in range(1, 10)]
    assert json.loads(executed[3].read_text())["cells"][1]["source"]  # a real executed notebook
    assert main(["verify", str(out), "--quiet"]) == 0
    for f in tiny_out.glob("*.gguf"):  # the same bytes as a plain conversion
        assert (out / f.name).read_bytes() == f.read_bytes()


@pytest.mark.slow  # (over a minute on CI's 2 cores: `make test-slow`)
def test_a_killed_worker_is_recovered_by_running_again(tiny_src: Path, tmp_path: Path) -> None:
    out, runs = tmp_path / "out", tmp_path / "runs"
    proc = subprocess.Popen(
        _batch_cmd(tiny_src, out, runs, "killed"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    victim = None
    deadline = time.time() + 120
    while time.time() < deadline and victim is None:
        if list((runs / "killed").glob("file-*.ipynb")) if (runs / "killed").exists() else []:
            kids = psutil.Process(proc.pid).children(recursive=False)
            workers = [k for k in kids if "spawn" in " ".join(k.cmdline())]
            if workers:
                victim = workers[0]
        time.sleep(0.05)
    assert victim is not None, "no Dask worker process found"
    for child in victim.children(recursive=True):  # the kernel it is running, too
        child.send_signal(signal.SIGKILL)
    os.kill(victim.pid, signal.SIGKILL)
    proc.communicate(timeout=300)  # the batch ends, with or without failed shards
    again = subprocess.run(
        _batch_cmd(tiny_src, out, runs, "again"), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout[-2000:]
    assert "9 ok, 0 failed" in again.stdout
    assert main(["verify", str(out), "--quiet"]) == 0
    assert not list(out.glob("*.partial"))


def test_convert_fans_out_on_an_existing_scheduler(tiny_src: Path, tiny_out: Path, tmp_path: Path) -> None:
    from dask.distributed import LocalCluster

    # two threads a worker, as `dask worker` gives by default: conversions share a process
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=None) as cluster:
        code = main(
            [
                "convert",
                "--meta",
                str(tiny_src),
                "--out-dir",
                str(tmp_path),
                "--quiet",
                "--scheduler",
                cluster.scheduler_address,
                *PER_LAYER,
            ]
        )
    assert code == 0
    for f in tiny_out.glob("*.gguf"):
        assert (tmp_path / f.name).read_bytes() == f.read_bytes()
    assert main(["verify", str(tmp_path), "--quiet"]) == 0
    assert json.loads((tmp_path / "MANIFEST.json").read_text()) == json.loads(
        (tiny_out / "MANIFEST.json").read_text()
    )


@pytest.mark.slow  # (45 s: it waits out a cell timeout)
def test_a_hung_kernel_is_one_line_and_the_others_go_on(tiny_src: Path, tmp_path: Path, capsys) -> None:
    """A notebook whose cell never ends (file 2: a sleep) and one whose kernel stops answering at all
    (file 3: SIGSTOP) are each stopped at the cell timeout and named, notebook and cell, in one line
    (the notebook timeout is the bound behind it); file 1 converts; exit 1; the same command with the
    hang gone converts what failed."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(k for k, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])) + 1
    hang = "import os, signal, time\nif file == 2:\n    time.sleep(3600)\nif file == 3:\n    os.kill(os.getpid(), signal.SIGSTOP)"
    nb.cells.insert(at, nbformat.v4.new_code_cell(hang))
    hung = tmp_path / "03-hung.ipynb"
    nbformat.write(nb, hung)
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = _batch_args(tiny_src, out, runs, "hung")
    args[args.index("--notebook") + 1] = str(hung)
    code = main([*args, "--files", "1-3", "--cell-timeout", "10", "--notebook-timeout", "40"])
    text = capsys.readouterr().out
    assert code == 1 and "1 ok, 2 failed" in text, text
    lines = [line for line in text.splitlines() if "03-hung.ipynb: cell" in line]
    assert len(lines) == 2, text
    # (counted in the executed notebook, where papermill's injected parameters cell comes first)
    said = f"03-hung.ipynb: cell {at + 2} ('import os, signal, time') ran past its 10 s; stopped"
    assert all(line.endswith(said) for line in lines), lines
    nb.cells[at].source = "pass"
    nbformat.write(nb, hung)
    args[args.index("--run-id") + 1] = "again"
    assert main([*args, "--files", "1-3"]) == 0, capsys.readouterr()
    assert "3 ok, 0 failed" in capsys.readouterr().out


def _printed(executed: Path) -> str:
    nb = json.loads(executed.read_text())
    return "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))


def _injected(executed: Path) -> set[str]:
    """The names papermill injected into the executed notebook (its cell tagged injected-parameters)."""
    nb = json.loads(executed.read_text())
    cell = next(c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", []))
    return {ln.split(" = ")[0] for ln in "".join(cell["source"]).splitlines() if " = " in ln}


def test_batch_runs_the_looking_notebooks_per_output_file(tiny_src: Path, tmp_path: Path, capsys) -> None:
    """01 opens the shard each output file reads first, 02 shows the MoE layers each holds (a file with
    none says which layer it shows instead); each is told only the parameters it has (papermill warns
    of any other); a batch of notebooks that only look leaves the plan and no manifest."""
    for name, files in (("01-tensor-layouts.ipynb", "1,2"), ("02-mxfp4-scales.ipynb", "1,3")):
        out, runs = tmp_path / f"out-{name[:2]}", tmp_path / "runs"
        args = _batch_args(tiny_src, out, runs, name[:2])
        args[args.index("--notebook") + 1] = str(ROOT / "notebooks" / name)
        code = main([*args, "--files", files])
        assert code == 0, capsys.readouterr()
        assert "2 ok, 0 failed" in capsys.readouterr().out
        first, second = sorted((runs / name[:2]).glob("file-*.ipynb"))
        assert _injected(first) == {"src", "out_dir", "file"}
        # the notebooks only looked: no output file and no manifest; the plan stays for a convert
        assert sorted(p.name for p in out.iterdir()) == [".k3lab"]
        assert sorted(p.name for p in (out / ".k3lab").iterdir()) == ["kvs.json", "lock", "plan.json"]
        if name.startswith("01"):
            assert "output file 1: Kimi-K3-MXFP4-00001-of-00009.gguf reads model-00001-of-000011" in _printed(
                first
            )
            assert "Kimi-K3-MXFP4-00002-of-00009.gguf reads model-00002-of-000011" in _printed(second)
        else:
            said = "layers [0] hold no routed experts: showing layer 1, the next that has"
            assert said in _printed(first) and "MoE layers shown: [1];" in _printed(first)
            assert "MoE layers shown: [2];" in _printed(second) and "hold no" not in _printed(second)


def test_the_convert_notebooks_old_name_still_runs(
    tiny_src: Path, tiny_out: Path, tmp_path: Path, capsys
) -> None:
    """03 was 03-convert-shard.ipynb (a shard is a source file): a batch command written before the
    rename runs the renamed notebook, and without --notebook it is the default."""
    from k3lab.explore.paths import CONVERT_NOTEBOOK, notebook_path

    old = ROOT / "notebooks" / "03-convert-shard.ipynb"
    assert not old.exists() and notebook_path(old) == CONVERT_NOTEBOOK == Path(NOTEBOOK)
    assert (
        notebook_path(tmp_path / "03-convert-shard.ipynb") == tmp_path / "03-convert-shard.ipynb"
    )  # (not ours)
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = _batch_args(tiny_src, out, runs, "old-name")
    args[args.index("--notebook") + 1] = str(old)
    assert main([*args, "--files", "2"]) == 0, capsys.readouterr()
    assert "1 ok, 0 failed" in capsys.readouterr().out
    (executed,) = (runs / "old-name").glob("file-*.ipynb")
    ran = json.loads(executed.read_text())["cells"]
    assert [c["source"] for c in ran if "injected-parameters" not in c["metadata"].get("tags", [])] == [
        c["source"] for c in json.loads(Path(NOTEBOOK).read_text())["cells"]
    ]
    made = out / "Kimi-K3-MXFP4-00002-of-00009.gguf"
    assert made.read_bytes() == (tiny_out / made.name).read_bytes()


def test_batch_refuses_a_notebook_it_cannot_run_per_file(tiny_src: Path, tmp_path: Path, capsys) -> None:
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = _batch_args(tiny_src, out, runs, "x")
    for name, said in (
        (
            "04-vision-and-tokenizer.ipynb",
            "has no 'file' parameter, so it cannot be run once per output file",
        ),
        ("05-verify-a-run.ipynb", "has no 'file' parameter"),
    ):
        args[args.index("--notebook") + 1] = str(ROOT / "notebooks" / name)
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and name in err[0] and said in err[0], err
    untagged = tmp_path / "untagged.ipynb"
    nb = json.loads((ROOT / "notebooks" / "03-convert-a-file.ipynb").read_text())
    for cell in nb["cells"]:
        cell["metadata"].pop("tags", None)
    untagged.write_text(json.dumps(nb))
    args[args.index("--notebook") + 1] = str(untagged)
    assert main(args) == 2
    assert "untagged.ipynb: no cell tagged 'parameters'" in capsys.readouterr().err
    assert not out.exists() and not runs.exists()


def test_a_batch_that_finishes_no_file_leaves_no_state(tiny_src: Path, tmp_path: Path, capsys) -> None:
    """Every notebook fails before converting: exit 1, each named; OUT/ (made by the run) is gone, the
    executed notebooks are kept as the evidence. A folder that was there stays, with what was in it."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(k for k, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])) + 1
    nb.cells.insert(at, nbformat.v4.new_code_cell("raise RuntimeError('no conversion today')"))
    failing = tmp_path / "03-failing.ipynb"
    nbformat.write(nb, failing)
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = _batch_args(tiny_src, out, runs, "failing")
    args[args.index("--notebook") + 1] = str(failing)
    assert main([*args, "--files", "1-2"]) == 1
    text = capsys.readouterr().out
    assert "0 ok, 2 failed" in text and text.count("RuntimeError: no conversion today") == 2, text
    assert not out.exists()
    assert len(list((runs / "failing").glob("file-*.ipynb"))) == 2
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args[args.index("--run-id") + 1] = "failing-again"
    assert main([*args, "--files", "1-2"]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.slow  # (8 runs of every notebook: minutes on 2 cores, `make test-slow`)
def test_every_notebook_many_times_under_load_never_waits_past_its_timeout(
    tiny_src: Path, tmp_path: Path
) -> None:
    """Every notebook run ROUNDS times by k3lab's batch runner (papermill in a process of
    its own, a timeout on every cell and on the notebook), two at a time, while two busy processes
    hold both cores: every run ends well inside its notebook timeout, and ends ok (a run that hung
    would end failed at its cell timeout, naming the cell)."""
    from concurrent.futures import ThreadPoolExecutor

    from k3lab.pipeline.running.batch import NotebookTask, parameter_names, run_notebook

    rounds, cell_timeout, notebook_timeout = 8, 120.0, 300.0
    assert main(["convert", "--meta", str(tiny_src), "--out-dir", str(tmp_path / "set"), "--quiet"]) == 0
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        jobs = []
        for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
            declared = parameter_names(path)
            for k in range(1, rounds + 1):
                folder = tmp_path / f"{path.stem}-{k}"
                folder.mkdir()
                given = {
                    "src": str(tiny_src),
                    "meta": str(tiny_src),
                    "result_file": str(folder / "result.json"),
                }
                given["out_dir"] = (
                    str(tmp_path / "set") if path.name.startswith("05") else str(folder / "out")
                )
                if path.name.startswith("04"):
                    given["mmproj_dir"] = str(folder / "vision")
                parameters = tuple(sorted((n, v) for n, v in given.items() if n in declared))
                task = NotebookTask(
                    str(path),
                    str(folder),
                    parameters,
                    "",
                    cell_timeout,
                    notebook_timeout,
                    takes_file="file" in declared,
                )
                jobs.append((path.name, task, 1))
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda job: (job[0], run_notebook(job[1], job[2])), jobs))
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert len(runs) == 5 * rounds
    failed = [(name, r.error) for name, r in runs if r.status != "ok"]
    assert not failed, failed
    assert max(r.seconds for _, r in runs) < notebook_timeout / 2, [(n, round(r.seconds)) for n, r in runs]
    assert time.monotonic() - t0 < len(runs) * notebook_timeout / 2
