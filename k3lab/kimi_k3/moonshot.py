"""Where Moonshot's own Kimi-K3 code is, when it is on this machine: the files of PyPI's
``llmcompressor==0.14.0.1`` wheel (``llmcompressor/modeling/kimi_k3/``), which ship Moonshot's modeling,
tokenizer and chat-format code unchanged. k3lab never needs them to convert; a notebook shows them
beside k3lab's own work (the chat format as Moonshot renders it), and the tests use them as judges.

They are found in an installed ``llmcompressor``, or unpacked in k3lab's cache
(``$K3LAB_JUDGE_CACHE``, default ``~/.cache/k3lab``, then ``llmcompressor-0.14.0.1/src``), where
``k3lab setup-judge`` (``setup``) unpacks them from the wheel: ``pip download --no-deps`` in an isolated
interpreter, the wheel's SHA-256 checked against the one pinned here, then the ``kimi_k3`` files and
the one module they import (``moe/context.py``), and nothing else. Only ``encoding_k3.py`` is imported
here: it needs nothing but the standard library.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

WHEEL = "llmcompressor==0.14.0.1"
FILES = Path("llmcompressor") / "modeling" / "kimi_k3"
WHEEL_FILE = "llmcompressor-0.14.0.1-py3-none-any.whl"
WHEEL_SHA256 = "fedc804a45bf3e353b84b8181147474c324ffba3356c9ecebceae29dfc3c5f00"  # PyPI's, pinned
UNPACKED = (f"{FILES.as_posix()}/", "llmcompressor/modeling/moe/context.py")  # what the files import
SETUP = "k3lab setup-judge"


def cache() -> Path:
    return (
        Path(os.environ.get("K3LAB_JUDGE_CACHE", Path.home() / ".cache" / "k3lab")) / "llmcompressor-0.14.0.1"
    )


def folder() -> Path | None:
    """Moonshot's ``kimi_k3`` folder on this machine, or None."""
    try:
        spec = importlib.util.find_spec("llmcompressor")
        found = list(spec.submodule_search_locations or []) if spec else []
    except ValueError:  # (a stand-in parent package with no spec, made by code loading the files)
        found = list(getattr(sys.modules.get("llmcompressor"), "__path__", []))
    places = [Path(p).parent / FILES for p in found]
    places.append(cache() / "src" / FILES)
    return next((p for p in places if (p / "encoding_k3.py").is_file()), None)


def encoding() -> ModuleType | None:
    """Moonshot's ``encoding_k3`` module (``build_chat_segments``), or None when it is not here."""
    found = folder()
    if found is None:
        return None
    name = "k3lab_moonshot_encoding_k3"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, found / "encoding_k3.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up while it runs)
    spec.loader.exec_module(module)
    return module


def missing() -> str:
    """One line: how to put Moonshot's files where k3lab finds them."""
    return (
        f"Moonshot's encoding_k3.py is not on this machine: run `{SETUP}` (it unpacks them from PyPI's "
        f"{WHEEL} into {cache() / 'src'})"
    )


def complete() -> bool:
    """Whether Moonshot's files are here whole: the ``kimi_k3`` folder and the module it imports."""
    found = folder()
    return found is not None and all(
        (found / n).is_file() for n in ("modeling_kimi_linear.py", "modeling_kimi_k3.py", "../moe/context.py")
    )


def setup(say: object = None) -> Path:
    """Moonshot's files from PyPI's wheel into k3lab's cache, unless they are here whole: the wheel
    fetched by ``pip download --no-deps`` (an isolated interpreter, a bounded wait), its SHA-256 checked
    against ``WHEEL_SHA256``, the files it holds under ``UNPACKED`` unpacked (into a partial folder,
    renamed whole). Returns the ``kimi_k3`` folder."""
    import hashlib
    import shutil
    import subprocess
    import tempfile
    import zipfile

    from k3lab.errors import K3LabError, MachineError

    if complete():
        return folder()  # type: ignore[return-value]
    root = cache()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="k3lab-judge-", dir=root) as tmp:
        cmd = [
            sys.executable,
            "-I",
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-q",
            "-d",
            tmp,
            WHEEL,
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise MachineError(f"pip download {WHEEL}: no answer in 600 s") from None
        wheel = Path(tmp) / WHEEL_FILE
        if done.returncode or not wheel.is_file():
            said = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise MachineError(f"pip download {WHEEL}: {said[:300]}")
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if sha != WHEEL_SHA256:
            raise K3LabError(f"{WHEEL_FILE}: SHA-256 {sha}, not PyPI's {WHEEL_SHA256}: not unpacked")
        partial = Path(tmp) / "src"
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(UNPACKED) and ".." not in name.split("/") and not name.startswith("/"):
                    z.extract(name, partial)
        shutil.rmtree(root / "src", ignore_errors=True)
        os.replace(partial, root / "src")
    if not complete():
        raise K3LabError(f"{root / 'src'}: the wheel did not hold Moonshot's files")
    if callable(say):
        say(f"Moonshot's files unpacked into {folder()} (from {WHEEL}, SHA-256 checked)")
    return folder()  # type: ignore[return-value]


def setup_command(req: object, args: object) -> int:
    """``k3lab setup-judge``."""
    found = folder() if complete() else None
    where = setup(print)
    if found is not None:
        print(f"Moonshot's files are here already: {where}")
    return 0
