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
    """(the tokens, the BOS id when the vocabulary adds one)."""
    try:
        import llama_cpp
    except ImportError:
        raise K3LabError(
            "the imatrix needs llama-cpp-python (llama.cpp's tokenizer and kernels): pip install 'k3lab[llama]'"
        ) from None
    vocab = llama_cpp.Llama(str(vocab_file), vocab_only=True, verbose=False)
    tokens = np.asarray(vocab.tokenize(text, add_bos=True, special=parse_special), dtype=np.int32)
    adds_bos = bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(vocab.model)))
    return tokens, (int(vocab.token_bos()) if adds_bos else None)


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
