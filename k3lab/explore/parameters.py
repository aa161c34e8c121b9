"""A notebook's parameters checked as the CLI checks its flags, before anything reads or fetches: a
value that cannot mean anything is one line naming the parameter (papermill, a batch run or a person
editing the cell sees that line, never a widget's or a Hub client's traceback; IPython shows a k3lab
error as its line: ``errors.K3LabError._render_traceback_``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3lab import values
from k3lab.errors import K3LabError, printable

MAX_TEXT = 1 << 20  # characters of text a notebook tokenizes
MAX_LAYERS = 1024  # layers a notebook compares at once


class ParameterError(K3LabError):
    """A notebook parameter that cannot mean anything: one line naming it."""


def _whole(low: int, optional: bool = False) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"give a whole number from {low}" + (" (or None)" if optional else "")
        return None

    return check


def _path(optional: bool = False) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, (str, bytes)) and not hasattr(value, "__fspath__"):
            return "give a folder or file path"
        text = str(value)
        if not text or "\0" in text or len(text) > 4096:
            return "give a folder or file path"
        return None

    return check


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "give True or False"


def _cli(check: Callable[[Any, str], Any], why: str) -> Callable[[Any], str | None]:
    """The CLI's own check of the flag of that name (None: the default)."""

    def run(value: Any) -> str | None:
        if value is None:
            return None
        try:
            check(value, "")
        except K3LabError:
            return why
        return None

    return run


def _layers(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_LAYERS:
        return f"give a list of layer numbers (at most {MAX_LAYERS})"
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        return "give layer numbers from 0"
    return None


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in choices else f"give one of {', '.join(choices)}"

    return check


def _text(optional: bool = False, limit: int = MAX_TEXT) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None and optional:
            return None
        return (
            None
            if isinstance(value, str) and len(value) <= limit
            else f"give text of at most {limit} characters"
        )

    return check


def _names(value: Any) -> str | None:
    """Variants: llama-quantize's types or k3lab's recipes (each checked where it is built)."""
    ok = isinstance(value, (list, tuple)) and 0 < len(value) <= 16
    return (
        None
        if ok and all(isinstance(v, str) and 0 < len(v) <= 64 for v in value)
        else ("give a list of 1 to 16 types or recipes (e.g. ['Q2_K', 'MoE-Q2_K'])")
    )


def _experts(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and 0 < len(value) <= 16
    return (
        None
        if ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        else ("give a list of 1 to 16 expert numbers from 0")
    )


RULES: dict[str, Callable[[Any], str | None]] = {
    "src": _path(),
    "meta": _path(),
    "out_dir": _path(),
    "mmproj_dir": _path(),
    "image": _path(optional=True),
    "result_file": _path(optional=True),
    "repo": _cli(values.repo_id, "give a Hub repo as ORG/NAME (letters, digits, '.', '_', '-')"),
    "revision": _cli(
        values.revision, "give a branch, tag or commit (letters, digits, '.', '_', '/', '+', '-')"
    ),
    "shard": _whole(1),
    "file": _whole(1, optional=True),
    "layers": _layers,
    "proj": _one_of("w1", "w2", "w3"),
    "expert": _whole(0),
    "sample_rows": _whole(1, optional=True),
    "sample": _whole(0),
    "seed": _whole(0),
    "check": _flag,
    "force": _flag,
    "text": _text(),
    "tensor": _text(optional=True, limit=1024),
    "run_token": _text(optional=True, limit=128),
    "types": _names,
    "imatrix": _text(optional=True, limit=4096),
    "layer": _whole(0),
    "experts": _experts,
    "kl": _flag,
    "calibration": _text(optional=True, limit=4096),
    "chunks": _whole(1),
    "chunk_size": _whole(1),
}


def check_parameters(**params: Any) -> None:
    """Each parameter by its rule (``RULES``, the CLI's where there is a flag of that name); the
    first that fails is one ``ParameterError`` naming it. Upper bounds a checkpoint decides (the
    number of shards, of experts) are checked where they are known, as the helpers read it."""
    for name, value in params.items():
        rule = RULES.get(name)
        if rule is None:
            raise ParameterError(f"notebook parameter {name}: k3lab does not know it (a typo?)")
        why = rule(value)
        if why:
            raise ParameterError(f"notebook parameter {name}={printable(repr(value))[:200]}: {why}")


def check_index(name: str, value: int, count: int, first: int = 0) -> int:
    """A parameter that picks one of ``count`` things the checkpoint has (a shard from 1, an expert
    from 0): one line naming it when there is no such thing (never clamped, never wrapped)."""
    if isinstance(value, bool) or not isinstance(value, int) or not first <= value < first + count:
        raise ParameterError(
            f"notebook parameter {name}={printable(repr(value))[:200]}: this checkpoint has "
            f"{first} to {first + count - 1}"
        )
    return value
