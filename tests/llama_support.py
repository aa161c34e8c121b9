"""llama.cpp (through llama-cpp-python) is the judge of our GGUFs; skip loudly where it is missing."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
if not HAVE_LLAMA:
    warnings.warn(
        "llama-cpp-python is not installed: the llama.cpp load/tokenize/generate tests are SKIPPED "
        "(`make test` installs it)",
        stacklevel=1,
    )

needs_llama = pytest.mark.skipif(
    not HAVE_LLAMA, reason="llama-cpp-python not installed (make test installs it)"
)


def detokenize(llm, tokens: list[int]) -> bytes:
    """llama.cpp's own llama_detokenize with a buffer that fits (llama-cpp-python's detokenize
    uses 32 bytes per token and silently drops longer pieces, e.g. a long run of Han characters)."""
    import ctypes

    import llama_cpp

    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    size = 64 * len(tokens) + 64
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(tokens), buf, size, False, False)
    assert n >= 0, f"buffer too small: need {-n}"
    return buf.raw[:n]
