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

NOTEBOOK = str(ROOT / "notebooks" / "03-convert-shard.ipynb")


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
