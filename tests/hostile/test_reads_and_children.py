"""Nothing k3lab reads changes what it writes unproven: a template or a config that is a link into
``/proc`` (its size 0, its bytes the process's environment), a template too large in any of the
places a template comes from, a template nested deeper than a parser recurses, a checkpoint's own
template that is not Jinja; and modules planted in the folder k3lab is run from, for every Python
child it starts (the template's check, ``--jobs`` workers, a batch's Dask workers, papermill and its
kernel, JupyterLab). Each: one line, exit 2 (or the run unharmed), nothing written, no secret kept."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SECRET = "hf_this_secret_must_never_be_written_0123456789"
K3LAB = Path(sys.executable).parent / "k3lab"  # the console script: its own folder first on its path


def _k3lab(args: list[str], cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``k3lab ARGS`` as a user runs it, with a token in the environment."""
    import os

    assert K3LAB.exists(), "the tests need k3lab installed (its console script)"
    env = {**os.environ, "HF_TOKEN": SECRET}
    return subprocess.run(
        [str(K3LAB), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _nothing_kept(root: Path) -> None:
    """No file under ``root`` holds the secret (the environment never went anywhere)."""
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert SECRET.encode() not in p.read_bytes(), p


def _meta(tiny_src: Path, tmp_path: Path) -> Path:
    meta = tmp_path / "meta"
    shutil.copytree(tiny_src, meta)
    return meta


# --- files that yield more than their size ----------------------------------------------------------


@pytest.mark.parametrize("where", ["--chat-template", "tokenizer_config.json", "config.json"])
def test_a_file_the_kernel_fills_as_it_is_read_is_refused(tiny_src: Path, tmp_path: Path, where: str) -> None:
    """A link to ``/proc/self/environ`` (size 0; it yields the environment, HF_TOKEN included) as the
    template given by flag, or in place of the checkpoint's tokenizer config or config."""
    meta = _meta(tiny_src, tmp_path)
    out = tmp_path / "out"
    extra = []
    if where == "--chat-template":
        link = tmp_path / "t.jinja"
        link.symlink_to("/proc/self/environ")
        extra = ["--chat-template", str(link)]
    else:
        (meta / where).unlink()
        (meta / where).symlink_to("/proc/self/environ")
    r = _k3lab(["convert", "--meta", str(meta), "--out-dir", str(out), "--quiet", *extra])
    _one_line(r, "yields more than the 0 bytes its size says")
    assert not out.exists()
    _nothing_kept(tmp_path)


# --- a template too large, from any source -----------------------------------------------------------


def _plant_template(meta: Path, given: Path, where: str, template: str) -> list[str]:
    """``template`` where a conversion finds one: a ``--chat-template`` file (``given``; the flags
    returned), the checkpoint's ``chat_template.jinja``, or its ``tokenizer_config.json``."""
    if where == "flag":
        given.write_text(template)
        return ["--chat-template", str(given)]
    if where == "chat_template.jinja":
        (meta / "chat_template.jinja").write_text(template)
    else:
        cfg = json.loads((meta / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (meta / "tokenizer_config.json").write_text(json.dumps(cfg))
    return []


@pytest.mark.parametrize("where", ["flag", "chat_template.jinja", "tokenizer_config.json"])
def test_a_template_over_4_mib_is_refused_from_every_source(
    tiny_src: Path, tmp_path: Path, where: str
) -> None:
    meta = _meta(tiny_src, tmp_path)
    extra = _plant_template(
        meta, tmp_path / "big.jinja", where, "{{ messages[0].content }}" + " " * (4 << 20)
    )
    out = tmp_path / "out"
    r = _k3lab(["convert", "--meta", str(meta), "--out-dir", str(out), "--quiet", *extra])
    line = _one_line(r)
    assert "4194304 bytes" in line and ("big.jinja" in line if where == "flag" else where in line), line
    assert not out.exists()


# --- a template that is a program: parsed only in the bounded child ------------------------------------


@pytest.mark.parametrize("where", ["flag", "tokenizer_config.json"])
def test_a_template_nested_thousands_deep_is_one_line(tiny_src: Path, tmp_path: Path, where: str) -> None:
    meta = _meta(tiny_src, tmp_path)
    deep = "{% if true %}" * 4000 + "{{ messages[0].content }}" + "{% endif %}" * 4000
    extra = _plant_template(meta, tmp_path / "deep.jinja", where, deep)
    out = tmp_path / "out"
    r = _k3lab(["convert", "--meta", str(meta), "--out-dir", str(out), "--quiet", *extra])
    _one_line(r, "nests deeper than Python's parser recurses")
    assert not out.exists()


def test_a_checkpoints_own_template_is_checked_as_a_given_one_is(tiny_src: Path, tmp_path: Path) -> None:
    """The checkpoint's own template, not Jinja: refused before anything is written (it used to be
    embedded unchecked); given a template by flag instead, the checkpoint's is not what is embedded,
    and not what stops the run."""
    meta = _meta(tiny_src, tmp_path)
    cfg = json.loads((meta / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }}"
    (meta / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    r = _k3lab(["convert", "--meta", str(meta), "--out-dir", str(out), "--quiet"])
    _one_line(r, "tokenizer_config.json: not a Jinja template (line 1")
    assert not out.exists()
    (tmp_path / "good.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    r = _k3lab(
        [
            "convert",
            "--meta",
            str(meta),
            "--out-dir",
            str(out),
            "--quiet",
            "--chat-template",
            str(tmp_path / "good.jinja"),
        ]
    )
    assert r.returncode == 0, r.stderr


# --- children isolated from the folder k3lab runs in ---------------------------------------------------

PLANTED = (
    "json",
    "resource",
    "jinja2",
    "multiprocessing",
    "papermill",
    "ipykernel_launcher",
    "jupyterlab",
    "numpy",
)


def _plant(folder: Path) -> Path:
    """Modules that, imported from ``folder``, leave a mark there and stop their process."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in PLANTED:
        code = f"open({str(folder / ('PLANTED-' + name))!r}, 'w').close()\nraise SystemExit(97)\n"
        if name in ("multiprocessing", "jinja2", "jupyterlab"):
            (folder / name).mkdir()
            (folder / name / "__init__.py").write_text(code)
        else:
            (folder / f"{name}.py").write_text(code)
    return folder


def _marks(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("PLANTED-*"))


def test_a_template_check_and_jobs_workers_never_import_the_current_folders_modules(
    tiny_src: Path, tmp_path: Path
) -> None:
    here = _plant(tmp_path / "downloaded-checkpoint")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    out = tmp_path / "out"
    args = ["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--quiet", "--jobs", "2"]
    r = _k3lab([*args, "--split-max-tensors", "40", "--chat-template", str(tmp_path / "t.jinja")], cwd=here)
    assert r.returncode == 0 and not _marks(here), (r.stderr, _marks(here))
    assert len(list(out.glob("*.gguf"))) > 1


def test_a_batch_its_workers_papermill_and_kernel_never_import_the_current_folders_modules(
    tiny_src: Path, tmp_path: Path
) -> None:
    here = _plant(tmp_path / "downloaded-checkpoint")
    notebook = ROOT / "notebooks" / "03-convert-a-file.ipynb"
    r = _k3lab(
        ["batch", "--notebook", str(notebook), "--meta", str(tiny_src), "--out-dir", str(tmp_path / "out"),
         "--workers", "1", "--runs-dir", str(tmp_path / "runs"), "--run-id", "x", "--files", "1"],
        cwd=here,
    )  # fmt: skip
    assert r.returncode == 0 and not _marks(here), (r.stdout[-2000:], r.stderr[-2000:], _marks(here))
    assert "1 ok, 0 failed" in r.stdout, r.stdout


def test_jupyterlab_started_by_k3lab_never_imports_the_current_folders_modules(tmp_path: Path) -> None:
    from k3lab import lab

    here = _plant(tmp_path / "downloaded-checkpoint")
    cmd, env = lab.lab_command(["--version"])
    r = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip()[:1].isdigit() and not _marks(here), (r.stderr, _marks(here))
