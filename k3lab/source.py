"""Source tensors by name: the index, the safetensors headers and memory-mapped tensor bytes.

``LocalSource`` reads a folder. The index must agree with the files: every file it names
exists, every tensor it names is in that file's header and every tensor in a header is in the
index. Headers are validated by ``safetensors_format`` (offsets inside the file, dtype x shape
= byte length). ``hub.HubSource`` has the same interface and fetches files first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import K3LabError
from .safetensors_format import TensorEntry, read_header, read_tensor

INDEX_NAME = "model.safetensors.index.json"


class SourceError(K3LabError):
    """The index and the files disagree, or a file is missing."""


def read_index(*dirs: str | Path) -> tuple[Path, dict[str, str]]:
    """The first ``model.safetensors.index.json`` found in ``dirs``: (its path, weight_map)."""
    for d in dirs:
        path = Path(d) / INDEX_NAME
        if path.exists():
            try:
                index = json.loads(path.read_text(encoding="utf-8"))
                return path, dict(index["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SourceError(f"{path}: not a safetensors index ({e})") from None
    raise SourceError(f"{INDEX_NAME} not found in {', '.join(str(d) for d in dirs)}")


class SourceBase:
    """What the planner and the converter use: the index, per-file headers, tensors by name.
    Subclasses provide ``weight_map``, ``index_path``, ``header(file)`` and ``array(name)``."""

    weight_map: dict[str, str]
    index_path: Path
    header: Callable[[str], dict[str, TensorEntry]]
    _headers: dict[str, dict[str, TensorEntry]]

    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def entry(self, name: str) -> TensorEntry:
        if name not in self.weight_map:
            raise SourceError(f"{self.index_path}: no tensor {name}")
        return self.header(self.weight_map[name])[name]

    def release_header(self, file: str) -> None:
        """Forget a parsed header (it is read again when needed): bounded memory while planning."""
        self._headers.pop(file, None)


class LocalSource(SourceBase):
    """A checkpoint in a local folder (the index may live in a separate ``meta`` folder)."""

    def __init__(self, src_dir: str | Path, meta_dir: str | Path | None = None):
        self.src_dir = Path(src_dir)
        self.index_path, self.weight_map = read_index(*(d for d in (meta_dir, src_dir) if d is not None))
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._listed: dict[str, set[str]] = {}
        for name, file in self.weight_map.items():
            self._listed.setdefault(file, set()).add(name)

    def path(self, file: str) -> Path:
        return self.src_dir / file

    def header(self, file: str) -> dict[str, TensorEntry]:
        entries = self._headers.get(file)  # one lookup: another thread may release it meanwhile
        if entries is None:
            path = self.path(file)
            if not path.exists():
                raise SourceError(f"{self.index_path}: names {file}, which is not in {self.src_dir}")
            entries, _ = read_header(path)
            listed = self._listed.get(file, set())
            missing = sorted(listed - entries.keys())
            if missing:
                raise SourceError(f"{path}: tensor {missing[0]} is in the index but not in this file")
            extra = sorted(entries.keys() - listed)
            if extra:
                raise SourceError(
                    f"{path}: tensor {extra[0]} is in this file but the index does not list it here"
                )
            self._headers[file] = entries
        return entries

    def array(self, name: str) -> np.ndarray:
        return read_tensor(self.entry(name))
