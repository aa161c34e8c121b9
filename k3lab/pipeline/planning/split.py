"""How a set is cut into output files: by the model's units (whole layers, then the output tensors),
never by the source's files, with gguf-split's two limits.

- Default: the whole set in ONE file when it fits under ``max_size`` (a file llama.cpp users expect:
  ``Kimi-K3-0.40B-F16.gguf``), else one unit per file (Moonshot's Kimi-K3: 93 layers and the output
  tensors, 94 files), whatever the checkpoint's own files are.
- ``--split-max-size`` / ``--split-max-tensors`` (``explicit``): consecutive units packed into a file
  while its tensor data stays within ``max_size`` bytes and its tensors within ``max_tensors``; a unit
  is never split, so a unit larger than a limit is a file of its own (gguf-split never splits a tensor
  either).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3lab.errors import K3LabError

HUB_FILE_LIMIT = 50 * 1000**3  # the Hub's largest LFS file: no output file is larger by default
_SIZE = re.compile(r"([0-9]{1,15})([KMG]?)")
_UNIT = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3}


class SplitError(K3LabError):
    """A split option that is not a size or a count."""


@dataclass(frozen=True)
class Split:
    """gguf-split's limits per output file: ``max_size`` bytes of tensor data, ``max_tensors``
    tensors (0: none); ``explicit`` when the user chose them (else the default rule above)."""

    max_size: int = HUB_FILE_LIMIT
    max_tensors: int = 0
    explicit: bool = False
    groups: tuple[tuple[int, ...], ...] = ()  # the files as a set's records show them (verify)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_size": self.max_size, "max_tensors": self.max_tensors}
        out["explicit"] = self.explicit
        return out | ({"groups": [list(g) for g in self.groups]} if self.groups else {})

    @classmethod
    def from_json(cls, data: Any) -> Split:
        groups = tuple(tuple(int(k) for k in g) for g in data.get("groups", ()))
        return cls(int(data["max_size"]), int(data["max_tensors"]), bool(data["explicit"]), groups)


def parse_size(text: str, flag: str = "--split-max-size") -> int:
    """``N`` bytes, or ``N`` with K, M or G (powers of 1000, as gguf-split and llama.cpp's converter
    read them): ``50G``. At least one byte."""
    m = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or int(m[1]) == 0:
        raise SplitError(f"{flag} {text!r}: give a size such as 50G, 500M or 1000000 (bytes)")
    return int(m[1]) * _UNIT[m[2]]


def make_split(max_size: str | int | None = None, max_tensors: int | None = None) -> Split | None:
    """The split the options ask for; None when they ask for none (a folder keeps the split its
    plan has, a new one takes the default)."""
    if max_size is None and max_tensors is None:
        return None
    size = (
        HUB_FILE_LIMIT
        if max_size is None
        else (max_size if isinstance(max_size, int) else parse_size(max_size))
    )
    if max_tensors is not None and not (isinstance(max_tensors, int) and 1 <= max_tensors <= 10**9):
        raise SplitError(f"--split-max-tensors {max_tensors!r}: give a count of at least 1")
    return Split(size, max_tensors or 0, explicit=True)


def group_units(units: Sequence[tuple[int, int]], split: Split) -> list[list[int]]:
    """The output files, as lists of unit indices, for units of (tensor bytes, tensor count)."""
    if split.groups:
        return [list(g) for g in split.groups]
    total_bytes = sum(b for b, _ in units)
    total_tensors = sum(n for _, n in units)
    if total_bytes <= split.max_size and (not split.max_tensors or total_tensors <= split.max_tensors):
        return [list(range(len(units)))] if units else []
    if not split.explicit:
        return [[k] for k in range(len(units))]
    groups: list[list[int]] = []
    size = count = 0
    for k, (b, n) in enumerate(units):
        full = size + b > split.max_size or (split.max_tensors and count + n > split.max_tensors)
        if not groups or full:
            groups.append([])
            size = count = 0
        groups[-1].append(k)
        size, count = size + b, count + n
    return groups
