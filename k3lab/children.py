"""Python processes k3lab starts, isolated from the folder it is run in and from the user's site.

k3lab is often run from a downloaded checkpoint's folder, a stranger's. A Python child started as
``python -c CODE`` or ``python -m MODULE`` puts its current folder first on its path, so a module
named ``json`` or ``resource`` there would be imported and run in place of the standard library's. Every Python
child k3lab starts therefore runs isolated (``-I``: no current folder, no ``PYTHON*`` variables, no
user site), with the one folder it needs passed explicitly: the one k3lab itself is imported from.

- ``python_command``: a ``-c`` child (the chat template's check, papermill's runner, JupyterLab);
- ``isolated_spawning``: multiprocessing's spawned children (``--jobs`` workers, a Dask
  ``LocalCluster``'s, their resource tracker) start with ``-I`` too, and the path they are given
  (the parent's) without the current folder;
- ``kernel_spec``: the Jupyter kernel papermill starts for a batch run, isolated the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

ISOLATED = "-I"

_spawn_lock = threading.Lock()


def k3lab_root() -> str:
    """The folder k3lab is imported from (a site-packages, or a checkout)."""
    return str(Path(__file__).resolve().parents[1])


def _prelude() -> str:
    return f"import sys; sys.path.insert(0, {k3lab_root()!r})\n"


def python_command(code: str, *args: str) -> list[str]:
    """``python -I -c CODE ARGS...`` with k3lab importable: the command of an isolated child."""
    return [sys.executable, ISOLATED, "-c", _prelude() + code, *args]


def _unsafe(entry: str, cwd: str) -> bool:
    """A path entry that is the current folder ('' or it, spelt any way), unless k3lab lives there."""
    if entry == "":
        return True
    try:
        real = os.path.realpath(entry)
    except (OSError, ValueError):
        return False
    return real == os.path.realpath(cwd) and real != os.path.realpath(k3lab_root())


@contextlib.contextmanager
def isolated_spawning() -> Iterator[None]:
    """While it lasts, children spawned by multiprocessing (and its resource tracker) start with
    ``-I`` and without the current folder on the path they are given. multiprocessing builds their
    command from ``util._args_from_interpreter_flags`` and their path from the parent's
    (``spawn.get_preparation_data``): both are wrapped here and put back after."""
    from multiprocessing import spawn, util

    with _spawn_lock:
        flags, preparation = util._args_from_interpreter_flags, spawn.get_preparation_data

        def isolated_flags() -> list[str]:
            args = flags()
            return args if ISOLATED in args else [*args, ISOLATED]

        def preparation_without_cwd(name: str) -> dict:
            data = preparation(name)
            cwd = os.getcwd()
            data["sys_path"] = [p for p in data.get("sys_path", []) if not _unsafe(p, cwd)]
            return data

        util._args_from_interpreter_flags = isolated_flags
        spawn.get_preparation_data = preparation_without_cwd
        try:
            yield
        finally:
            util._args_from_interpreter_flags, spawn.get_preparation_data = flags, preparation


KERNEL_NAME = "k3lab-isolated"


def kernel_spec() -> dict[str, str]:
    """Write a Jupyter kernel spec into k3lab's cache whose kernel runs isolated (``-I``, so IPython
    adds no current folder either; k3lab importable) and return the environment that makes Jupyter
    find it (``JUPYTER_PATH``); papermill starts it by ``KERNEL_NAME``."""
    from k3lab.formats.files import cache_home, partial_path

    folder = cache_home() / "jupyter"
    spec_dir = folder / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    launch = _prelude() + "from ipykernel import kernelapp\nkernelapp.launch_new_instance()\n"
    spec = {
        "argv": [sys.executable, ISOLATED, "-c", launch, "-f", "{connection_file}"],
        "display_name": "Python 3 (k3lab, isolated)",
        "language": "python",
        "metadata": {"debugger": False},
    }
    path = spec_dir / "kernel.json"
    partial = partial_path(path, os.getpid())
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(spec, fh, indent=1)
    os.replace(partial, path)
    return {"JUPYTER_PATH": str(folder)}
