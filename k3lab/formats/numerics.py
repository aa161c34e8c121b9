"""Bit-exact float helpers: bfloat16 is carried as its uint16 bit pattern (numpy has no bf16)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

# safetensors float dtypes and the ggml type holding the same bytes
SAME_TYPE = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}
SIZE = {"BF16": 2, "F16": 2, "F32": 4}
SIZE_OF_TYPE = {GGMLQuantizationType.BF16: 2, GGMLQuantizationType.F16: 2, GGMLQuantizationType.F32: 4}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (NaN kept quiet), as ggml and torch do."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bits -> float32, exact."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """A safetensors holding array of ``dtype`` -> float32 values (exact for BF16, F16, F32)."""
    return bf16_bits_to_f32(a) if dtype == "BF16" else np.asarray(a, dtype=np.float32)


def cast(a: np.ndarray, src_dtype: str, target: GGMLQuantizationType) -> np.ndarray:
    """A holding array of safetensors ``src_dtype`` -> the bytes of ggml float type ``target``
    (returned as it is when they are the same type: a copy is a copy)."""
    if SAME_TYPE.get(src_dtype) == target:
        return a
    values = to_float32(a, src_dtype)
    if target == GGMLQuantizationType.F32:
        return values
    if target == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    if target == GGMLQuantizationType.BF16:
        return f32_to_bf16_bits(values)
    raise ValueError(f"cannot cast {src_dtype} to {target.name}")


def cast_bytes(nbytes: int, src_dtype: str, target: GGMLQuantizationType) -> int:
    """Memory ``cast`` allocates for ``nbytes`` of source (0 when it returns its input)."""
    if SAME_TYPE.get(src_dtype) == target:
        return 0
    n = nbytes // SIZE[src_dtype]
    widened = 4 * n if src_dtype != "F32" else 0
    return widened + (n * SIZE_OF_TYPE[target] if target != GGMLQuantizationType.F32 else 0)
