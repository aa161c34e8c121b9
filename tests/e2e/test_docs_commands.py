"""Every command the README and docs/ give, run as written: each ```bash block, in a process of its own,
from a folder where `k3lab demo` ran (as a user would after `make demo`, at the repository's root), with
a loopback Hub standing in for huggingface.co that serves the demo's checkpoint as moonshotai/Kimi-K3.
A block that fails, or that leaves the Hub without what it says it publishes, fails the test. (The
README's quick start is an `sh` block: CI runs `make test` itself, and `make demo` is the demo run here.)"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from hub_server import HubServer

TOKEN = "hf_docs_commands_0123456789"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def bash_blocks() -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), b) for page in PAGES for b in BLOCK.findall(page.read_text())]


def test_the_docs_give_their_commands_in_bash_blocks() -> None:
    """The blocks this test runs are there: the README's local recipe and Hub recipes, converting's,
    publishing's and the notebooks' (a page that moves its commands out of `bash` blocks must say so)."""
    where = [page for page, _ in bash_blocks()]
    assert where.count("README.md") == 2 and {
        "docs/converting.md",
        "docs/publishing.md",
        "docs/notebooks.md",
        "docs/variants.md",
    } <= set(where), where


def test_every_bash_block_of_the_readme_and_docs_runs_as_written_after_the_demo(tmp_path: Path) -> None:
    bin_dir = str(Path(sys.executable).parent)
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")  # (the blocks run at the repository's root)
    shutil.copytree(ROOT / "tests" / "data", tmp_path / "tests" / "data")  # (the variants page's imatrix)
    demo = subprocess.run(
        [sys.executable, "-m", "k3lab.cli", "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    _run_every_block(tmp_path, bin_dir, dict(os.environ))


@pytest.mark.slow
def test_every_bash_block_runs_in_a_fresh_clone_after_only_the_readmes_first_command(tmp_path: Path) -> None:
    """A newcomer's state, not a developer's: a clone of the repository's commit, the README's quick
    start's first command run in it (its own ``.venv``, none of this one's packages: the demo's extras
    only), then every block of the README and docs/ with that environment's commands."""
    clone = tmp_path / "k3lab"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    (quick,) = [b for b in re.findall(r"^```sh\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
                if b.startswith("make demo")]  # fmt: skip
    first = quick.splitlines()[0].split("#")[0].strip()
    venv = os.environ.get("VIRTUAL_ENV", "")
    path = [
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not (venv and p.startswith(venv))
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(path)
    made = subprocess.run(["bash", "-e", "-c", first], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=3600)  # fmt: skip
    assert made.returncode == 0, (made.stdout + made.stderr)[-3000:]
    # a variant made and a chat reply printed, as the README says
    assert (clone / "k3-demo" / "out" / "IQ2_XXS").is_dir(), made.stdout[-3000:]
    assert re.search(r"^  assistant: ['\"]", made.stdout, re.M), made.stdout[-3000:]
    _run_every_block(clone, str(clone / ".venv" / "bin"), env)


def _run_every_block(cwd: Path, bin_dir: str, base_env: dict[str, str]) -> None:
    """Each bash block of the README and docs/, in ``cwd`` (where `k3lab demo` ran), with the commands
    of ``bin_dir`` first on PATH and the loopback Hub serving the demo's checkpoint."""
    with HubServer(cwd / "k3-demo" / "src", token=TOKEN) as hub:
        env = (
            base_env
            | hub.client_env(cwd, TOKEN)
            | {
                "PATH": f"{bin_dir}:{base_env.get('PATH', '')}",
                "K3LAB_HOME": str(
                    cwd
                ),  # (a notebook's relative paths start here: this folder plays the checkout)
            }
        )
        for page, block in bash_blocks():
            log = cwd / "block.log"
            with log.open("w") as said:  # (a file, not a pipe: a background job keeps no reader waiting)
                run = subprocess.Popen(
                    ["bash", "-e", "-c", block],
                    cwd=cwd,
                    env=env,
                    stdout=said,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # (its background jobs, a Dask cluster, go with it)
                )
                try:
                    run.wait(timeout=900)
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(run.pid, signal.SIGKILL)
            assert run.returncode == 0, f"{page}:\n{block}\n{log.read_text()[-3000:]}"
        published = {repo for repo in hub.repos if repo.startswith("k3lab-demo/")}
    assert published == {"k3lab-demo/Kimi-K3-GGUF", "k3lab-demo/Kimi-K3-GGUF-local"}, published
    for folder in ("k3-demo/recipe", "gguf/Kimi-K3", "gguf/Kimi-K3-local"):
        assert (cwd / folder / "MANIFEST.json").is_file(), folder
    assert (cwd / "02-on-the-hub.ipynb").is_file() and (cwd / "k3-meta" / "config.json").is_file()
