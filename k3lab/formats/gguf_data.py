"""GGUF's metadata keys and tensor infos as plain data (what a plan saves and a task sends), and the
bytes they take in a file as gguf-py packs them (``file_size``: a file's size, counted without
writing it). ``gguf_stream`` writes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    Keys,
)

ALIGNMENT = GGUF_DEFAULT_ALIGNMENT  # (k3lab writes no general.alignment)


@dataclass(frozen=True)
class KV:
    """One metadata key as plain data: full key, value, GGUF value type (and element type of an array)."""

    key: str
    value: Any
    type: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first); GGUF's ne is the reverse

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.type]
        n = 1
        for d in self.shape:
            n *= d
        if self.shape[-1] % block:
            raise ValueError(
                f"{self.name}: last dim {self.shape[-1]} is not a multiple of {self.type.name}'s "
                f"block of {block}"
            )
        return n // block * type_size


def kvs_to_json(kvs: Sequence[KV]) -> list[list[Any]]:
    """KVs as JSON-able rows [key, type, value, element type] (Python floats keep F32 values exactly)."""
    return [[kv.key, kv.type.name, kv.value, kv.sub_type.name if kv.sub_type else None] for kv in kvs]


def kvs_from_json(rows: Sequence[Sequence[Any]]) -> list[KV]:
    return [KV(k, v, GGUFValueType[t], GGUFValueType[st] if st else None) for k, t, v, st in rows]


def split_kvs(split_no: int, split_count: int, tensors_total: int) -> list[KV]:
    """The keys that make a file one member of a llama.cpp split set."""
    return [
        KV(Keys.Split.LLM_KV_SPLIT_NO, split_no, GGUFValueType.UINT16),
        KV(Keys.Split.LLM_KV_SPLIT_COUNT, split_count, GGUFValueType.UINT16),
        KV(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, tensors_total, GGUFValueType.INT32),
    ]


def _raw_string(kv: KV) -> Any:
    """A string value as its bytes go into the file (not UTF-8: kept in a ``str`` as surrogate escapes)."""
    if kv.type == GGUFValueType.STRING and isinstance(kv.value, str):
        try:
            kv.value.encode("utf-8")
        except UnicodeEncodeError:
            return kv.value.encode("utf-8", errors="surrogateescape")
    return kv.value


def _writer(
    path: Path | None, arch: str | None, kvs: Sequence[KV], infos: Sequence[TensorInfo]
) -> GGUFWriter:
    """gguf-py's writer holding these keys (exactly as given) and tensor infos."""
    writer = GGUFWriter(path, arch or "")
    if arch is None:  # the keys exactly as given (a split file of llama-quantize's has no architecture)
        writer.kv_data[0].pop(Keys.General.ARCHITECTURE, None)
    for kv in kvs:
        if kv.key == Keys.General.ARCHITECTURE and arch is not None:
            continue  # GGUFWriter adds it
        writer.add_key_value(kv.key, _raw_string(kv), kv.type, sub_type=kv.sub_type)
    for ti in infos:
        # the placeholder dtype only tells GGUFWriter "not raw bytes": shape is taken as given
        writer.add_tensor_info(ti.name, ti.shape, np.dtype(np.float32), ti.nbytes, raw_dtype=ti.type)
    return writer


def file_size(arch: str | None, kvs: Sequence[KV], infos: Sequence[TensorInfo]) -> int:
    """The bytes of the file ``GGUFStream(path, arch, kvs, infos)`` writes, counted without writing:
    its header, keys and tensor infos as gguf-py packs them, then the tensors' data, aligned."""
    w = _writer(None, arch, kvs, infos)
    pos = 24  # magic, version, tensor count, key count
    for key, val in w.kv_data[0].items():
        pos += len(w._pack_val(key, GGUFValueType.STRING, add_vtype=False))
        pos += len(w._pack_val(val.value, val.type, add_vtype=True, sub_type=val.sub_type))
    for ti in infos:
        pos += (
            len(w._pack_val(ti.name, GGUFValueType.STRING, add_vtype=False)) + 4 + 8 * len(ti.shape) + 4 + 8
        )
    for ti in infos:
        pos += -pos % ALIGNMENT + ti.nbytes
    return pos + (-pos % ALIGNMENT if infos else 0)
