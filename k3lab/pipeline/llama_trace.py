"""Intermediate tensors of a llama.cpp forward pass, through its graph evaluation callback.

llama.cpp names the tensors of its graph (``attn_norm-3``, ``kda_out-3``, ``ffn_out-3``, ...; see
``src/models/kimi-k3.cpp``). ``trace`` runs one batch with a callback that copies the named F32
tensors out, so the reference can be fed llama.cpp's *own* block inputs and each block compared
on its own: a wrong transform then shows up in its layer, undisturbed by rounding elsewhere.
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
    lib.ggml_get_data_f32.restype = ctypes.POINTER(ctypes.c_float)
    lib.ggml_get_data_f32.argtypes = [ctypes.c_void_p]
    return lib


def trace(
    gguf_path: str | Path, tokens: list[int], names: set[str], threads: int = 2
) -> dict[str, np.ndarray]:
    """Run ``tokens`` through llama.cpp (F32 KV cache) and return the named tensors as (T, width) arrays."""
    import llama_cpp
    from llama_cpp import llama_cpp as C

    lib = _ggml()
    found: dict[str, np.ndarray] = {}

    @C.ggml_backend_sched_eval_callback
    def callback(t: int, ask: bool, _user: int) -> bool:
        name = lib.ggml_get_name(t).decode()
        if ask:
            return name in names
        head = _TensorHead.from_address(t)
        if head.type == 0:  # F32
            n = lib.ggml_nelements(t)
            found[name] = (
                np.ctypeslib.as_array(lib.ggml_get_data_f32(t), shape=(n,)).copy().reshape(len(tokens), -1)
            )
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
