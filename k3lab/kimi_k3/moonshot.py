"""Where Moonshot's own Kimi-K3 code is, when it is on this machine: the files of PyPI's
``llmcompressor==0.14.0.1`` wheel (``llmcompressor/modeling/kimi_k3/``), which ship Moonshot's modeling,
tokenizer and chat-format code unchanged. k3lab never needs them to convert; a notebook shows them
beside k3lab's own work (the chat format as Moonshot renders it), and the tests use them as judges.

They are found in an installed ``llmcompressor``, or unpacked in k3lab's cache
(``$K3LAB_JUDGE_CACHE``, default ``~/.cache/k3lab``, then ``llmcompressor-0.14.0.1/src``), where the
tests unpack the wheel (``pip download --no-deps llmcompressor==0.14.0.1``). Only ``encoding_k3.py`` is
imported here: it needs nothing but the standard library.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

WHEEL = "llmcompressor==0.14.0.1"
FILES = Path("llmcompressor") / "modeling" / "kimi_k3"
HOW = f"pip download --no-deps {WHEEL}, then unpack its {FILES}/ into {{cache}}"


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
    return "Moonshot's encoding_k3.py is not on this machine: " + HOW.format(cache=cache() / "src")
