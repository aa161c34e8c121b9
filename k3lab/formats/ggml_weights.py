"""Weights held for ggml's products as llama.cpp's CPU backend holds them (``Weights``): tensors of any
ggml type in one context of their own, their bytes read straight into its memory once, and the one
type llama.cpp repacks on this CPU (MXFP4) in a buffer of ggml's ``CPU_REPACK`` type, whose kernels
add in their own order (``repacked``). For the graphs of ``ggml_compute``."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from k3lab.formats.ggml import TYPE_IDS, GGMLError
from k3lab.formats.ggml_compute import Tensor, _Context, _memory
from k3lab.formats.ggml_lib import _SILENT, lib, row_size


@dataclass(frozen=True)
class WeightInfo:
    """A weight as ggml holds it: its name (the caller's), ggml type and ``ne`` (ne[0]: one row's values)."""

    name: str
    type_id: int
    ne: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return row_size(self.type_id, self.ne[0]) * math.prod(self.ne[1:])


def repacked(type_id: int, ne: tuple[int, ...]) -> bool:
    """Whether llama.cpp's CPU backend keeps this weight repacked for its products (a buffer of the
    ``CPU_REPACK`` type, whose kernels add in another order): ggml's ``ggml_repack_get_optimal_repack_type``
    for the one type of a lossless set it repacks, MXFP4 (AVX2: rows in eights; NEON with dot
    products: in fours). A weight of another type is multiplied as it is stored."""
    L = lib()
    if type_id != TYPE_IDS["MXFP4"] or L.repack_buffer_type is None or len(ne) < 2:
        return False
    if L.cpu.ggml_cpu_has_avx2():
        return ne[1] % 8 == 0
    return bool(L.cpu.ggml_cpu_has_neon() and L.cpu.ggml_cpu_has_dotprod() and ne[1] % 4 == 0)


class Weights:
    """Weights held for ggml's products as llama.cpp holds them: in one context of their own, each
    filled once by ``fill(info, into)`` (``into``: a uint8 array of the tensor's bytes; read the file
    straight into it); a weight llama.cpp's CPU backend repacks (``repacked``) in a buffer of that
    type, its bytes handed to ggml (which repacks them) through one reused buffer. ``tensor(name)``
    for a graph; ``close`` frees the memory."""

    def __init__(self, infos: Iterable[WeightInfo], fill: Callable[[WeightInfo, np.ndarray], None]):
        self.infos = {w.name: w for w in infos}
        plain = [w for w in self.infos.values() if not repacked(w.type_id, w.ne)]
        packed = [w for w in self.infos.values() if repacked(w.type_id, w.ne)]
        self._ctx = _Context(sum(w.nbytes + 64 for w in plain), len(plain))
        self._packed_ctx = _Context(0, len(packed), no_alloc=True) if packed else None
        self._buffer = None
        self._tensors: dict[str, Tensor] = {}
        self._names: dict[int, str] = {}
        try:
            for w in plain:
                t = self._ctx.new(w.type_id, w.ne)
                fill(w, _memory(t))
                self._add(w, t)
            if packed:
                self._fill_packed(packed, fill)
        except BaseException:
            self.close()
            raise

    def _add(self, w: WeightInfo, t: int) -> None:
        self._tensors[w.name] = Tensor(t)
        self._names[t] = w.name

    def _fill_packed(self, packed: list[WeightInfo], fill: Callable[[WeightInfo, np.ndarray], None]) -> None:
        L = lib()
        assert self._packed_ctx is not None
        made = [(w, self._packed_ctx.new(w.type_id, w.ne)) for w in packed]
        self._buffer = L.base.ggml_backend_alloc_ctx_tensors_from_buft(
            self._packed_ctx.ptr, L.repack_buffer_type()
        )
        if not self._buffer:
            raise GGMLError(
                f"ggml could not allocate {sum(w.nbytes for w in packed):,} bytes of repacked weights"
            )
        staging = np.empty(max(w.nbytes for w in packed), dtype=np.uint8)
        callback, data = ctypes.c_void_p(), ctypes.c_void_p()
        L.base.ggml_log_get(ctypes.byref(callback), ctypes.byref(data))
        L.base.ggml_log_set(ctypes.cast(_SILENT, ctypes.c_void_p), None)
        try:
            for w, t in made:
                fill(w, staging[: w.nbytes])
                L.base.ggml_backend_tensor_set(t, staging.ctypes.data, 0, w.nbytes)
                self._add(w, t)
        finally:
            L.base.ggml_log_set(callback, data)

    def tensor(self, name: str) -> Tensor:
        return self._tensors[name]

    def has(self, name: str) -> bool:
        return name in self._tensors

    def name_of(self, t: Tensor) -> str | None:
        """The name of one of these weights (None: a tensor of another context)."""
        return self._names.get(t.ptr)

    def close(self) -> None:
        if self._buffer:
            lib().base.ggml_backend_buffer_free(self._buffer)
            self._buffer = None
        self._ctx.close()
        if self._packed_ctx is not None:
            self._packed_ctx.close()

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
