"""The `startup` row: `k3lab --help` and `k3lab verify` of the tiny set (whole commands, best of 7), at
this checkout and at K3LAB_BASELINE (a git ref, default the commit before "one way in"): what a command
imports before it does anything"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.common import best_of, row


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
            return rows
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(tmp_path / "base")], check=False
            )


def _fixed_costs(src: Path, out: Path) -> list[tuple[str, str, str]]:
    """What a command costs besides its work: whole commands on the tiny model (its conversion, its
    verification and its plan take milliseconds), best of 7, against starting Python at all."""
    import subprocess

    k3 = [sys.executable, "-m", "k3lab.cli"]
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
