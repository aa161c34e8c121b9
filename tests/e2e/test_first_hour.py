"""The first hour, as a newcomer meets it: help that teaches (a description, an example that runs,
help on every option), `--version`, and flags that do not apply to what was asked refused in one
line naming them."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import PER_LAYER, ROOT, run_cli

from k3lab import __version__
from k3lab.cli import EXAMPLES, build_parser, main


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_subcommand_says_what_it_does_with_an_example_and_every_option_has_help() -> None:
    commands = _subcommands()
    assert set(commands) == set(EXAMPLES)
    for name, p in commands.items():
        assert p.description and p.description.endswith("."), name
        assert p.epilog == "example:\n  " + EXAMPLES[name] and EXAMPLES[name].startswith(f"k3lab {name}")
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"k3lab {name} {'/'.join(action.option_strings) or action.dest}: no help"


def test_version_is_the_packages() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    done = run_cli(None, "--version")
    assert (
        done.returncode == 0
        and done.stdout.strip() == f"k3lab {__version__}" == f"k3lab {project['version']}"
    )
    # `python -m k3lab` is the same command (the benchmarks time it so)
    module = subprocess.run(
        [sys.executable, "-m", "k3lab", "--version"], capture_output=True, text=True, timeout=60
    )
    assert (module.returncode, module.stdout) == (0, done.stdout), module.stderr


def test_the_examples_run_verbatim_after_the_demo(tmp_path: Path) -> None:
    """Each subcommand's example, from a fresh folder where `k3lab demo` ran (those that need the Hub,
    a browser, llama.cpp or minutes of notebooks aside)."""
    demo = run_cli(None, "demo", cwd=tmp_path, timeout=600)
    assert demo.returncode == 0, demo.stderr[-2000:]
    if importlib.util.find_spec("llama_cpp") is not None:  # a chat turn, through the set's own template
        lines = demo.stdout.splitlines()
        # the sizes people run: the imatrix a layer at a time, the IQ2_XXS variant made with it, checked
        assert any(line.startswith("imatrix ") and "a layer at a time" in line for line in lines), lines
        assert any(line.startswith("variant ") and "IQ2_XXS with it" in line for line in lines), lines
        assert any("OK: IQ2_XXS" in line for line in lines), lines
        assert (tmp_path / "k3-demo" / "out" / "IQ2_XXS" / "Kimi-K3-8x1.9M-IQ2_XXS.gguf").is_file()
        at = lines.index("  user: Hello! Who are you?")
        # the reply as Python's repr: quoted either way, never empty
        assert re.fullmatch(r"  assistant: (['\"]).+\1", lines[at + 1]), lines
    skip = {"publish", "lab", "batch", "check-logits", "demo"}
    for name, example in EXAMPLES.items():
        if name in skip:
            continue
        args = shlex.split(example.split(" > ")[0])[1:]
        if name == "convert":
            args += ["--force"]  # (the demo's set is there: made again)
        done = run_cli(None, *args, cwd=tmp_path, timeout=600)
        assert done.returncode == 0, (example, done.stderr[-600:])


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--revision", "v1"], "--revision is for a set on the Hub (ORG/NAME) or a source on it (--repo)"),
        (["--sample", "2", "--all"], "--all and --sample each say which tensors to check: give one"),
        (["--sample", "1", "--tensors", "blk.*"], "--sample and --tensors each say which tensors to check"),
        (["--all", "--tensors", "blk.*"], "--all and --tensors each say which tensors to check"),
        (["--seed", "3"], "--seed is the seed of --sample's choice: it needs --sample"),
        (["--source-revision", "v1"], "--source-revision is for verifying a set on the Hub (ORG/NAME)"),
    ],
)
def test_verify_flags_that_do_not_apply_are_refused(tiny_one: Path, flags: list[str], said: str) -> None:
    done = run_cli(None, "verify", str(tiny_one), *flags)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"k3lab: error: {said}"), (
        done.stderr
    )


def test_verify_with_meta_alone_re_derives(tiny_src: Path, tiny_one: Path) -> None:
    """--src defaults to --meta in every command: in verify too, so --meta alone re-derives."""
    done = run_cli(None, "verify", str(tiny_one), "--meta", str(tiny_src), "--quiet")
    assert done.returncode == 0 and "re-derived from the source" in done.stdout, done.stdout + done.stderr


def test_an_outtype_that_would_change_nothing_is_refused(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On an MXFP4 checkpoint whose float tensors are BF16, --outtype bf16 would make the default's
    file, named for its MXFP4: refused, nothing written; --outtype f32 widens the float tensors."""
    out = tmp_path / "out"
    assert (
        main(["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--outtype", "bf16", "--quiet"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        "k3lab: error: --outtype bf16: the checkpoint's float tensors are BF16 already and its 21 MXFP4 "
        "tensors stay MXFP4 (k3lab never dequantises): the file would be the default's; leave --outtype out"
    )
    assert not out.exists() or not any(out.iterdir())
    assert (
        main(["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--outtype", "f32", "--quiet"]) == 0
    )


def test_a_misspelt_folder_or_an_unreachable_hub_is_one_line_at_once(tmp_path: Path) -> None:
    """Not a 15-minute silence of retries: a name that can only be a misspelt path says what is there;
    a Hub whose name does not resolve, or where nothing listens, is one line on the first try (the
    run's timeout, a minute, is far below the retry budget of 900 s)."""
    import os

    (tmp_path / "k3-demo" / "out").mkdir(parents=True)
    (tmp_path / "k3-demo" / "src").mkdir()
    done = run_cli(None, "verify", "k3-demo/ot", cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == (
        "k3lab: error: k3-demo/ot: no such folder (k3-demo/ holds out, src); a set on the Hub is ORG/NAME "
        "where no folder ORG is here"
    )
    for endpoint, why in (
        ("http://no-such-host.invalid", "Name or service not known"),
        ("http://127.0.0.1:9", "Connection refused"),
    ):
        env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"}
        for args in (
            ["verify", "someone/Kimi-K3-GGUF"],
            ["plan", "--meta", str(tmp_path / "m"), "--repo", "moonshotai/Kimi-K3"],
        ):
            done = run_cli(env, *args, cwd=tmp_path, timeout=60)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1 and len(lines) == 1, (endpoint, args, done.stderr)
            assert "no Hub reachable" in lines[0] and why in lines[0] and "HF_ENDPOINT" in lines[0], lines[0]


def test_a_failing_convert_says_one_line_and_no_note_before_it(tiny_src: Path, tmp_path: Path) -> None:
    """The chat-template note is said once the inputs are checked: a run that fails on an input says
    its one line, nothing before it."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    r = run_cli(None, "convert", "--meta", str(src), "--out-dir", str(tmp_path / "out"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and shard.name in r.stderr, r.stderr
    ok = run_cli(None, "convert", "--meta", str(tiny_src), "--out-dir", str(tmp_path / "ok"))
    assert ok.returncode == 0 and ok.stderr.startswith("k3lab: chat template: k3lab's Kimi-K3 template"), (
        ok.stderr
    )


def test_a_convert_that_finishes_no_file_leaves_nothing_and_one_that_finished_some_keeps_them(
    tiny_src: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A failure past the checks (a transform raising, here) with no file finished: exit 1 and no
    OUT/ (the run made it). With one file finished first, OUT/ and its state stay: the same command
    converts the rest."""
    import k3lab.pipeline.running.task as task_module
    from k3lab.errors import K3LabError

    real = task_module.convert_file

    def failing(plan, number, *args, **kwargs):
        if number >= fail_from:
            raise K3LabError(f"output file {number}: a failure injected by the test")
        return real(plan, number, *args, **kwargs)

    monkeypatch.setattr(task_module, "convert_file", failing)
    out = tmp_path / "out"

    def convert(*extra: str) -> int:
        return main(["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--quiet", *extra])

    fail_from = 1
    assert convert() == 2
    assert "output file 1: a failure injected by the test" in capsys.readouterr().err
    assert not out.exists()
    fail_from = 2
    assert convert(*PER_LAYER) == 2
    assert "8 of 9 output files failed; finished files are kept" in capsys.readouterr().err
    assert (out / ".k3lab" / "00001.json").is_file() and (out / ".k3lab" / "plan.json").is_file()
    fail_from = 99
    assert convert(*PER_LAYER) == 0
    assert "8 written, 1 already complete" in capsys.readouterr().out


def test_bars_end_at_100_percent_in_one_unit_system(tiny_src: Path, tmp_path: Path, monkeypatch) -> None:
    """convert's and verify's bars, drawn as on a terminal: each ends at 100% of its total, and every
    size and rate on them is in tqdm's SI units (kB, MB: a MiB beside a MB/s was two systems)."""
    import io

    import k3lab.pipeline.progress as progress

    frames: list[str] = []

    class Shown(progress.tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.update(disable=False, file=io.StringIO(), mininterval=0)
            super().__init__(*args, **kwargs)
            self.bars = kwargs["file"]

        def close(self):
            if not self.disable:  # (tqdm closes a bar again when it is collected)
                super().close()
                frames.append(self.bars.getvalue().split("\r")[-1].strip())

    monkeypatch.setattr(progress, "tqdm", Shown)
    out = tmp_path / "out"
    assert main(["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--split-max-tensors", "1"]) == 0
    assert main(["verify", str(out), "--src", str(tiny_src)]) == 0
    assert [f.split(":")[0] for f in frames] == ["9 files", "verify", "re-derive"], frames
    for frame in frames:
        assert "100%|" in frame and "iB" not in frame, frame
        done, total = frame.split("| ")[1].split(" ")[0].split("/")
        assert done == total and total.endswith(("k", "M")), frame


def test_make_demo_installs_only_when_pyproject_changed(tmp_path: Path) -> None:
    """The README's first command: pip runs when this environment has no install stamp or
    pyproject.toml is newer than it; otherwise `make demo` is the demo alone (a second run is the
    demo's seconds). Asked of make itself, dry (-n): nothing is installed here."""
    import os
    import subprocess

    venv = tmp_path / "venv"
    venv.mkdir()
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}

    def dry(target: str) -> list[str]:
        r = subprocess.run(
            ["make", "-n", "--no-print-directory", "-C", str(ROOT), target],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        venv_step = 'if [ -n "" ] && [ ! -x "python" ]; then python3 -m venv ""; fi'  # (a no-op in a venv)
        return [line for line in r.stdout.strip().splitlines() if line != venv_step]

    first = dry("demo")
    assert first[0] == "python -m pip install -e . && touch " + str(venv / ".k3lab-installed")
    # llama.cpp built (its progress shown, a failure one line: the demo runs without it), then the demo
    assert first[1].startswith('echo "k3lab: building llama.cpp') and "'.[llama]'" in first[2]
    assert first[-2:] == ["touch " + str(venv / ".k3lab-installed-demo"), "k3lab demo"]
    later = (ROOT / "pyproject.toml").stat().st_mtime + 60
    for name in (".k3lab-installed", ".k3lab-installed-test", ".k3lab-installed-demo"):
        (venv / name).touch()
        os.utime(venv / name, (later, later))
    assert dry("demo") == ["k3lab demo"]
    assert dry("test") == ["python -m pytest"]
    earlier = later - 120
    os.utime(venv / ".k3lab-installed", (earlier, earlier))
    assert dry("demo")[0].startswith("python -m pip install -e . && touch ")


@pytest.mark.slow
def test_the_demo_on_the_oldest_python_the_readme_names(tmp_path: Path) -> None:
    """Python 3.10 (the README's minimum): k3lab installed into a fresh environment of its own (no
    llama extra: its build is the same on every Python), `k3lab demo` runs to its end."""
    import shutil
    import subprocess

    found = [
        shutil.which("python3.10"),
        *sorted(map(str, Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))),
    ]
    runs = [p for p in found if p and subprocess.run([p, "-c", "pass"], capture_output=True).returncode == 0]
    if not runs:
        pytest.skip("SKIPPED LOUDLY: no python3.10 on this machine (pyenv install 3.10)")
    python = runs[0]
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    got = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-e", str(ROOT)], capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    demo = subprocess.run([str(venv / "bin" / "k3lab"), "demo"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "verify OK" in demo.stdout or "OK: 3 files" in demo.stdout, demo.stdout[-2000:]
