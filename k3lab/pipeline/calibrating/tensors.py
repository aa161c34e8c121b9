"""A step's tensors, read from the finished files of a set where their records put them, every byte
checked against the record's SHA-256 (a file changed since it was recorded is one line, never used):
matrices into ggml's memory (``formats.ggml_compute``: multiplied by llama.cpp's own kernels, once
loaded for every chunk), the rest widened to float32. Each product's input is handed to the step's
``Sums`` first, as llama-imatrix's callback sees it."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.ggml import TYPE_IDS, ggml
from k3lab.formats.ggml_compute import WeightInfo, Weights
from k3lab.pipeline.calibrating.sums import Sums
from k3lab.pipeline.state.record import TensorRecord

ReadAt = Callable[[int, int, np.ndarray | None], np.ndarray]  # (offset, n, into) -> the bytes


class TensorChanged(K3LabError):
    """A set's file does not hold the bytes its record says."""


@dataclass(frozen=True)
class Located:
    """Where one tensor of the set is: its file (a name to say), how to read it, its record."""

    file: str
    read: ReadAt
    record: TensorRecord


def _checked(loc: Located, into: np.ndarray | None = None) -> np.ndarray:
    t = loc.record
    data = loc.read(t.offset, t.nbytes, into)
    if hashlib.sha256(data).hexdigest() != t.sha256:
        raise TensorChanged(
            f"{loc.file}: tensor {t.name}: its bytes are not the ones its record hashed (changed since?)"
        )
    return data


def widen(t: TensorRecord, data: np.ndarray) -> np.ndarray:
    """A tensor's bytes as float32 in numpy order (``ne`` reversed)."""
    shape = tuple(reversed(t.ne))
    if t.type == "F32":
        return data.view(np.float32).reshape(shape).copy()
    out = np.empty(math.prod(t.ne), dtype=np.float32)
    ggml().to_float(TYPE_IDS[t.type], data, out)
    return out.reshape(shape)


class StepTensors:
    """The tensors one step reads (``located``: by name), for all the chunks it runs; ``sums`` hears
    every product's input; ``batch_rows``: the rows of llama.cpp's product for the chunk at hand (its
    batch: several chunks run side by side there)."""

    def __init__(self, located: dict[str, Located], sums: Sums, threads: int = 1):
        self.located, self.sums, self.threads = located, sums, threads
        self.batch_rows = 1 << 30
        self._vectors: dict[str, np.ndarray] = {}
        self._weights: dict[str, Weights] = {}

    def has(self, name: str) -> bool:
        return name in self.located

    def _loc(self, name: str) -> Located:
        loc = self.located.get(name)
        if loc is None:
            raise K3LabError(f"tensor {name}: not in the set (a set of another model?)")
        return loc

    def vector(self, name: str) -> np.ndarray:
        if name not in self._vectors:
            loc = self._loc(name)
            self._vectors[name] = widen(loc.record, _checked(loc))
        return self._vectors[name]

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows of a matrix (each read by offset: the embedding is read a token's row at a time)."""
        loc = self._loc(name)
        t = loc.record
        row_bytes = t.nbytes // math.prod(t.ne[1:])
        out = np.empty((len(ids), t.ne[0]), np.float32)
        wanted = {int(i) for i in ids}
        if any(not 0 <= i < math.prod(t.ne[1:]) for i in wanted):
            raise K3LabError(f"tensor {name}: a token id outside its {math.prod(t.ne[1:])} rows")
        cache = {
            i: widen(TensorRecord(name, t.type, (t.ne[0], 1), row_bytes, 0, ""), loc.read(t.offset + i * row_bytes, row_bytes, None)).reshape(-1)
            for i in sorted(wanted)
        }  # fmt: skip
        for j, i in enumerate(ids):
            out[j] = cache[int(i)]
        return out

    def _weight(self, name: str) -> Weights:
        if name not in self._weights:
            loc = self._loc(name)
            t = loc.record
            info = WeightInfo(name, TYPE_IDS[t.type], tuple(t.ne))
            self._weights[name] = Weights([info], lambda _, into: _checked(loc, into), self.threads)
        return self._weights[name]

    def matmul(self, name: str, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.sums.dense(name, x, self.batch_rows)
        return self._weight(name).matmul(name, x)

    def matmul_id(self, name: str, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        w = self._weight(name)
        self.sums.experts(name, x, ids, w.infos[name].ne[2])
        return w.matmul_id(name, x, ids)

    def close(self) -> None:
        for w in self._weights.values():
            w.close()
        self._weights.clear()
        self._vectors.clear()
