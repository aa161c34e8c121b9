"""Intermediate tensors of a llama.cpp forward pass, through its graph evaluation callback.

llama.cpp names the tensors of its graph (``attn_norm-3``, ``kda_out-3``, ``ffn_out-3``, ...; see
``src/models/kimi-k3.cpp``). ``trace`` runs one batch with a callback that copies the named F32
and I32 tensors out (views included, read through their strides; a name used twice in a layer, as
``res_probs`` is, keeps every occurrence in graph order), so the reference can be fed llama.cpp's
*own* stage inputs and each stage compared on its own: a wrong transform then shows up where it is,
undisturbed by rounding elsewhere.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np


class _TensorHead(ctypes.Structure):
    # the first fields of ggml's struct ggml_tensor: type, buffer, ne[4], nb[4]
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def _ggml() -> ctypes.CDLL:
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_get_name.restype, lib.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    lib.ggml_nelements.restype, lib.ggml_nelements.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    lib.ggml_get_data.restype, lib.ggml_get_data.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    return lib


GGML_F32, GGML_I32 = 0, 26
_DTYPES = {GGML_F32: np.float32, GGML_I32: np.int32}


def _copy_out(lib: ctypes.CDLL, t: int) -> np.ndarray | None:
    """A tensor's values as (n_tokens, width), read through its strides (a view need not be
    contiguous); None for a type not read here."""
    head = _TensorHead.from_address(t)
    dtype = _DTYPES.get(head.type)
    if dtype is None:
        return None
    ne, nb = list(head.ne), list(head.nb)
    item = np.dtype(dtype).itemsize
    span = sum((n - 1) * b for n, b in zip(ne, nb)) + item
    base = np.frombuffer((ctypes.c_uint8 * span).from_address(lib.ggml_get_data(t)), dtype=np.uint8)
    values = np.lib.stride_tricks.as_strided(
        base.view(dtype), shape=tuple(reversed(ne)), strides=tuple(reversed(nb)), writeable=False
    )
    return values.copy().reshape(-1, ne[0])  # (rows: tokens, or the output rows; width)


def trace(
    gguf_path: str | Path, tokens: list[int], names: set[str], threads: int = 2
) -> dict[str, list[np.ndarray]]:
    """Run ``tokens`` through llama.cpp (F32 KV cache) and return every occurrence of the named
    tensors, in graph order, as (T, width) arrays."""
    import llama_cpp
    from llama_cpp import llama_cpp as C

    lib = _ggml()
    found: dict[str, list[np.ndarray]] = {}

    @C.ggml_backend_sched_eval_callback
    def callback(t: int, ask: bool, _user: int) -> bool:
        name = lib.ggml_get_name(t).decode()
        if ask:
            return name in names
        values = _copy_out(lib, t)
        if values is not None:
            found.setdefault(name, []).append(values)
        return True

    llm = llama_cpp.Llama(
        str(gguf_path), n_ctx=max(64, 2 * len(tokens)), n_threads=threads, verbose=False, type_k=0, type_v=0
    )
    params = llm.context_params
    params.cb_eval, params.cb_eval_user_data = callback, None
    params.n_ctx = params.n_batch = params.n_ubatch = max(64, 2 * len(tokens))
    ctx = C.llama_init_from_model(llm.model, params)
    try:
        ids = (C.llama_token * len(tokens))(*tokens)
        if C.llama_decode(ctx, C.llama_batch_get_one(ids, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")
    finally:
        C.llama_free(ctx)
    return found
