"""BPE merges recovered from tiktoken ranks, fast and exactly as the definition gives them.

The definition (upstream llama.cpp's): for each multi-byte token of rank r, run BPE on its bytes
allowing only ranks below r; if that ends in two parts, they are the token's merge.
``merges_reference`` is that, plainly. ``bpe_merges`` runs the same greedy loop in compiled code,
finding byte strings through a hash table of every token; a hit is confirmed byte by byte, so the
result is exact whatever the hash does. The tests compare the two on vocabularies with ties and
unreachable tokens, and the benchmark on one of the real size.

They are derived each time they are needed (0.3 s for Kimi-K3's 163,584 ranks): an earlier cache of
them could hold pairs that check out as merges yet are not the derivation's, and proving an entry
cost about what deriving it does.
"""

from __future__ import annotations

import numpy as np


def _bpe_reference(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best_i, best_rank = i, r
        if best_rank is None or best_rank >= max_rank:
            return parts
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def merges_reference(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The definition, plainly: per token, BPE on its bytes with only lower ranks; two parts -> a merge."""
    ranks = {t: r for r, t in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        if len(token) > 1:
            parts = _bpe_reference(ranks, token, rank)
            if len(parts) == 2:
                merges.append((parts[0], parts[1]))
    return merges


def bpe_merge_ranks(tokens: list[bytes]) -> list[tuple[int, int]]:
    """The merges as (left rank, right rank) pairs, in the order of the merged token's rank."""
    try:  # numba is a dependency; without it the reference definition is used
        from k3lab.formats._bpe_kernels import _merges_kernel
    except ImportError:  # pragma: no cover
        ranks = {t: r for r, t in enumerate(tokens)}
        return [(ranks[a], ranks[b]) for a, b in merges_reference(tokens)]
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    offs = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    buf = np.frombuffer(b"".join(tokens), dtype=np.uint8)
    left, right = _merges_kernel(buf, offs)
    keep = left >= 0
    return list(zip(left[keep].tolist(), right[keep].tolist()))


def bpe_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The same merges as ``merges_reference``, computed in compiled code."""
    return [(tokens[a], tokens[b]) for a, b in bpe_merge_ranks(tokens)]
