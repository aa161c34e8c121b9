"""The calibration text as llama-imatrix cuts it: tokenised once by llama.cpp's own tokenizer (the
vocabulary of the set's file 1, loaded alone), the special tokens the vocabulary adds (BOS, when it
adds one), then cut into chunks of ``n_ctx`` tokens, each the first token replaced by BOS when the
vocabulary adds one; ``--chunks`` of them at most; at least two chunks' worth of tokens (llama-imatrix
refuses fewer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from k3lab.errors import K3LabError


class TooShort(K3LabError):
    """The text gives fewer tokens than llama-imatrix asks for."""


def tokenize(vocab_file: Path, text: bytes, parse_special: bool) -> tuple[np.ndarray, int | None]:
    """(the tokens, the BOS id when the vocabulary adds one): llama.cpp's ``common_tokenize(ctx, text,
    add_special=true, parse_special)``, on the vocabulary alone (no context made, its notes silenced)."""
    import ctypes

    try:
        from llama_cpp import llama_cpp as C
    except ImportError:
        raise K3LabError(
            "the imatrix needs llama-cpp-python (llama.cpp's tokenizer and kernels): pip install 'k3lab[llama]'"
        ) from None
    from llama_cpp._logger import llama_log_callback

    silent = C.llama_log_callback(lambda level, text, data: None)
    C.llama_log_set(silent, ctypes.c_void_p(0))
    try:
        params = C.llama_model_default_params()
        params.vocab_only = True
        model = C.llama_model_load_from_file(str(vocab_file).encode(), params)
        if not model:
            raise K3LabError(f"{vocab_file}: llama.cpp cannot load its vocabulary")
        try:
            vocab = C.llama_model_get_vocab(model)
            room = len(text) + 16  # (a token is at least one byte; BOS and EOS at most besides)
            out = (C.llama_token * room)()
            n = C.llama_tokenize(vocab, text, len(text), out, room, True, parse_special)
            if n < 0:
                raise K3LabError(f"{vocab_file}: llama.cpp made more tokens of the text than it has bytes")
            tokens = np.frombuffer(out, dtype=np.int32, count=n).copy()
            bos = int(C.llama_vocab_bos(vocab)) if C.llama_vocab_get_add_bos(vocab) else None
        finally:
            C.llama_model_free(model)
    finally:
        C.llama_log_set(llama_log_callback, ctypes.c_void_p(0))
    return tokens, bos


def chunks(tokens: np.ndarray, n_ctx: int, n_chunks: int | None, bos: int | None, where: str) -> np.ndarray:
    """The chunks [n, n_ctx] as llama-imatrix makes them."""
    if len(tokens) < 2 * n_ctx:
        raise TooShort(
            f"{where}: {len(tokens)} tokens, fewer than two chunks of {n_ctx} (llama-imatrix asks for "
            f"at least {2 * n_ctx}: a longer text, or --chunk-size below {len(tokens) // 2 + 1})"
        )
    n = len(tokens) // n_ctx
    n = n if n_chunks is None else min(n, n_chunks)
    out = tokens[: n * n_ctx].reshape(n, n_ctx).copy()
    if bos is not None:
        out[:, 0] = bos
    return out
