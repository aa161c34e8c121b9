"""The `startup` row: `k3lab --help` and `k3lab verify` of the tiny set (whole commands, best of 7), at
this checkout and at K3LAB_BASELINE (a git ref, default the commit before "one way in"): what a command
imports before it does anything"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.common import _median, best_of, row


@row
def bench_startup() -> list[tuple[str, str, str]]:
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    base = os.environ.get("K3LAB_BASELINE", "3155acd")
    with tempfile.TemporaryDirectory(prefix="k3lab-bench-") as tmp:
        tmp_path = Path(tmp)
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "-q", "--detach", str(tmp_path / "base"), base],
            check=True,
        )
        try:
            src = tmp_path / "src"
            subprocess.run(
                [sys.executable, "-m", "k3lab.cli", "synth", "--out", str(src)],
                check=True,
                capture_output=True,
            )

            outs = {root: tmp_path / "out-now", tmp_path / "base": tmp_path / "out-base"}

            def k3lab(tree: Path, *args: str) -> None:
                """That tree's command, run from the tree (``python -m`` puts the working folder
                first on the path, before PYTHONPATH)."""
                env = {**os.environ, "PYTHONPATH": str(tree)}
                cmd = [sys.executable, "-m", "k3lab.cli", *args]
                subprocess.run(cmd, env=env, cwd=tree, capture_output=True, check=True)

            for tree, out in outs.items():  # each verifies a set its own code made
                k3lab(tree, "convert", "--meta", str(src), "--out-dir", str(out), "--quiet")
            rows = []
            for label, args_for in (
                ("k3lab --help", lambda out: ["--help"]),
                ("k3lab verify (tiny set)", lambda out: ["verify", str(out), "--quiet"]),
            ):
                now, before = (best_of(lambda t=tree, a=args_for: k3lab(t, *a(outs[t])), 7) for tree in outs)
                rows.append(
                    (
                        f"startup: {label}",
                        f"{now:.2f} s",
                        f"{before:.2f} s at {base} ({before / now:.2f}x)",
                    )
                )
            rows += _fixed_costs(src, tmp_path / "fixed")
            rows += _edges(tmp_path / "edges")
            return rows
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(tmp_path / "base")], check=False
            )


def _fixed_costs(src: Path, out: Path) -> list[tuple[str, str, str]]:
    """What a command costs besides its work: whole commands on the tiny model (its conversion, its
    verification and its plan take milliseconds), best of 7, against starting Python at all."""
    import subprocess

    k3 = [sys.executable, "-m", "k3lab"]  # (the installed command: main, then a quick exit)
    subprocess.run([*k3, "convert", "--meta", str(src), "--out-dir", str(out), "--quiet"], check=True,
                   capture_output=True)  # fmt: skip
    first = next(out.glob("*.gguf"))

    def convert() -> None:
        first.unlink()
        subprocess.run([*k3, "convert", "--meta", str(src), "--out-dir", str(out), "--quiet"], check=True,
                       capture_output=True)  # fmt: skip

    floor = best_of(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), 7)
    rows = []
    for label, fn in (
        ("convert (the tiny model's one file)", convert),
        (
            "verify (its set)",
            lambda: subprocess.run([*k3, "verify", str(out), "--quiet"], check=True, capture_output=True),
        ),  # fmt: skip
        (
            "plan (its checkpoint)",
            lambda: subprocess.run([*k3, "plan", "--meta", str(src)], check=True, capture_output=True),
        ),  # fmt: skip
    ):
        seconds = best_of(fn, 7)
        rows.append((f"fixed cost: k3lab {label}", f"{seconds:.2f} s", f"`python -c pass` {floor:.3f} s"))
    return rows


def _edges(tmp: Path) -> list[tuple[str, str, str]]:
    """The fixed cost of converting a file already planned, where it lies in a run: from the command's
    start to its first read of the source file, and from its last write of the output file to its
    exit (what a worker pays per file besides the work). ``strace -y`` stamps every read and write
    of the two files (the openat of imports is not traced, so Python's start runs at its own speed);
    the source's pages are dropped before each run (read from the disk, as a worker's next file is)
    and the interpreter's are not (a worker's files are warm after its first). A `layer` checkpoint of
    16 real-size experts, its MoE file (2 of 3), median of 5 runs. (strace slows what lies between:
    the whole command is timed by the `layer` and `dense` rows, never here.)"""
    import shutil
    import subprocess
    import time

    from k3lab.kimi_k3.synth import synthesize

    if shutil.which("strace") is None:
        return [("fixed cost: a planned file's edges", "skipped", "no strace here (Debian: strace)")]
    src, out, log = tmp / "src", tmp / "out", tmp / "trace"
    synthesize("layer", src, experts=16)
    k3 = [sys.executable, "-m", "k3lab"]
    convert = [
        *k3,
        "convert",
        "--meta",
        str(src),
        "--out-dir",
        str(out),
        "--split-max-tensors",
        "1",
        "--quiet",
    ]
    subprocess.run(convert, check=True, capture_output=True)  # (planned, and every file written once)
    shard = next(src.glob("model-00002-of-*.safetensors"))
    target = next(out.glob("*-00002-of-00003.gguf"))
    firsts, tails = [], []
    for _ in range(5):
        target.unlink()
        os.sync()
        fd = os.open(shard, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        trace = ["strace", "-f", "-ttt", "-qq", "-y", "--seccomp-bpf", "-o", str(log),
                 "-e", "trace=pread64,preadv,preadv2,pwrite64,write,exit_group"]  # fmt: skip
        start = time.time()
        subprocess.run([*trace, *convert, "--files", "2"], check=True, capture_output=True)
        first = last = end = None
        for line in log.read_text().splitlines():
            fields = line.split(None, 2)
            if len(fields) < 3:
                continue
            stamp, call = float(fields[1]), fields[2]
            if first is None and call.startswith(("pread", "<... pread")) and f"<{shard}>" in call:
                first = stamp
            if call.startswith(("pwrite64", "write")) and f"<{target}.partial>" in call:
                last = stamp
            if call.startswith("exit_group"):
                end = stamp
        assert first and last and end, log.read_text()[-2000:]
        firsts.append(first - start)
        tails.append(end - last)
    floor = best_of(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), 7)
    return [
        (
            "fixed cost: a planned file, start to its first source read",
            f"{_median(firsts):.3f} s",
            f"{min(firsts):.3f}-{max(firsts):.3f} s in 5 runs; `python -c pass` {floor:.3f} s",
        ),
        (
            "fixed cost: a planned file, its last write to exit",
            f"{_median(tails):.3f} s",
            f"{min(tails):.3f}-{max(tails):.3f} s (the fsync, the rename, the record and the manifest)",
        ),
    ]
