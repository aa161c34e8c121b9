"""Values from a user, checked against what they can mean before anything uses them: the CLI's
argument types and ``request.Request`` (which notebooks make directly) check them the same way, and
a bad one is one line naming the flag."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError, printable

MAX_JOBS = 256  # processes on one machine
MAX_SECONDS = 7 * 86400.0  # a week: no wait k3lab takes is meant to be longer
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(f"{_NAME}/{_NAME}")


class ValueProblem(K3LabError):
    """A value that cannot mean anything here; the message names the flag."""


def basename(name: str, flag: str = "--name") -> str:
    """An output basename: a plain file-name stem (letters, digits, ``.``, ``_``, ``-``; not starting
    with a dot), never a path: files are written inside the output folder."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", name or ""):
        raise ValueProblem(
            f"{flag} {name!r}: give a plain name (letters, digits, '.', '_', '-'), not a path; "
            "files are written inside --out-dir"
        )
    return name


def count(value: object, low: int, high: int, flag: str) -> int:
    """A whole number in [low, high] (text in ASCII digits, or an int)."""
    text = str(value).strip()
    ok = (isinstance(value, int) and not isinstance(value, bool)) or bool(re.fullmatch(r"[0-9]{1,12}", text))
    if not ok or not low <= int(text) <= high:
        raise ValueProblem(f"argument {flag}: {value!r} is outside {low}..{high}")
    return int(text)


def seconds(value: object, flag: str, positive: bool = False) -> float:
    """A number of seconds, 0 (or above 0 when ``positive``) to a week: 0 means zero (no wait, no
    retry), never a default."""
    text = str(value).strip().lower()
    try:
        number = float(text) if re.fullmatch(r"[0-9.e+-]+", text) else math.nan
    except ValueError:
        number = math.nan
    if not 0 <= number <= MAX_SECONDS or (positive and number == 0):
        raise ValueProblem(f"argument {flag}: {value!r} is not a number of seconds (0 to {MAX_SECONDS:.0f})")
    return number


def repo_id(value: object, flag: str) -> str:
    """A Hub repo as ORG/NAME (huggingface_hub's rules for the names)."""
    text = str(value)
    if REPO_ID.fullmatch(text) and ".." not in text and "--" not in text and not text.endswith(".git"):
        return text
    raise ValueProblem(
        f"argument {flag}: {text!r} is not a Hub repo: give ORG/NAME (letters, digits, '.', '_', '-')"
    )


_REVISION = re.compile(r"[A-Za-z0-9._/+-]{1,255}")


def revision(value: object, flag: str) -> str:
    """A branch, tag or commit of a Hub repo, as git names them: printable, no spaces, no ``..``."""
    text = str(value)
    if (
        isinstance(value, str)
        and _REVISION.fullmatch(text)
        and ".." not in text
        and not text.startswith(("-", "/"))
    ):
        return text
    raise ValueProblem(
        f"argument {flag}: {printable(text)!r} is not a branch, tag or commit (letters, digits, '.', '_', '/', '+', '-')"
    )


def token_ids(value: str, flag: str) -> list[int]:
    """Token ids as ``1,2,3`` or ``1 2 3``."""
    try:
        return [count(t, 0, 2**31 - 1, flag) for t in value.replace(",", " ").split()]
    except ValueProblem:
        raise ValueProblem(f"argument {flag}: {value!r}: give token ids, e.g. 1,2,3") from None


def positive(value: object, flag: str) -> float:
    """A finite number above 0."""
    try:
        number = float(str(value))
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueProblem(f"argument {flag}: {value!r} is not a number above 0")
    return number


def argument(check: Callable[..., Any], *bounds: object) -> Callable[[str], Any]:
    """One of these checks as an argparse type (argparse names the flag in its message)."""
    import argparse

    def parse(text: str) -> Any:
        try:
            return check(text, *bounds, "")
        except ValueProblem as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None

    return parse


_SHARD_PART = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?")


class ShardSpecError(ValueProblem):
    """A --files value that is not N, A-B or a comma mix of them within the set."""


def output_files(chosen: str | None, n: int) -> list[int]:
    """``--files`` (``--shards``): ``N``, ``A-B`` or a comma mix of output files (1-based, inclusive,
    ASCII digits); None or 'all' means every output file. Every number is checked against ``n``
    before any range is expanded, so the list is never longer than the set."""
    if chosen is None or chosen.strip().lower() == "all":
        return list(range(1, n + 1))
    if len(chosen) > 10_000:
        raise ShardSpecError(f"--files: {len(chosen)} characters; give N, A-B or a comma mix")
    out: set[int] = set()
    for part in chosen.split(","):
        m = _SHARD_PART.fullmatch(part.strip())
        if m is None:
            raise ShardSpecError(f"--files {chosen!r}: {part.strip()!r} is not N or A-B (digits 0-9)")
        a = int(m[1])
        b = int(m[2]) if m[2] else a
        if a > b:
            raise ShardSpecError(f"--files {chosen!r}: {part.strip()!r} runs backwards")
        for k in (a, b):
            if not 1 <= k <= n:
                raise ShardSpecError(f"--files {chosen!r}: file {k} is outside 1..{n}")
        out.update(range(a, b + 1))
    return sorted(out)


REPO_FOLDER = re.compile(f"{_NAME}/{_NAME}(?:/{_NAME})?")  # a repo, or a folder of it (a variant's)


def is_repo(target: str) -> bool:
    """Whether ``verify``'s target is a Hub repo (``ORG/NAME``, or ``ORG/NAME/FOLDER``: a variant's
    folder in it, that is no local folder). ORG/NAME where ORG is a local folder can only be a
    misspelt path: one line, naming what is there."""
    path = Path(target)
    if path.exists() or not REPO_FOLDER.fullmatch(target):
        return False
    if target.count("/") == 2:
        path = Path(target.split("/", 1)[0] + "/" + target.split("/")[1])
    if path.parent.is_dir() and not path.parent.is_symlink():
        there = sorted(p.name for p in list(path.parent.iterdir())[:1000] if p.is_dir())[:8]
        raise K3LabError(
            f"{target}: no such folder ({path.parent}/ holds {', '.join(there) or 'no folders'}); "
            "a set on the Hub is ORG/NAME where no folder ORG is here"
        )
    return True


def verify_choice(
    remote: bool,
    revision: str | None,
    repo: str | None,
    source_revision: str | None,
    every: bool,
    sample: int | None,
    tensors: str | None,
    seed: int | None,
) -> None:
    """``verify``'s flags that cannot go together, or do not apply to what it checks: one line."""
    if source_revision is not None and not remote:
        raise K3LabError("--source-revision is for verifying a set on the Hub (ORG/NAME): give --revision")
    if revision is not None and not remote and repo is None:
        raise K3LabError(
            "--revision is for a set on the Hub (ORG/NAME) or a source on it (--repo); a folder has none"
        )
    picked = [
        flag for flag, given in (("--all", every), ("--sample", sample), ("--tensors", tensors)) if given
    ]
    if len(picked) > 1:
        raise K3LabError(f"{' and '.join(picked)} each say which tensors to check: give one")
    if seed is not None and not sample:
        raise K3LabError("--seed is the seed of --sample's choice: it needs --sample")
