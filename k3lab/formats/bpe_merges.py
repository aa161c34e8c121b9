"""BPE merges recovered from tiktoken ranks, fast and exactly as the definition gives them.

The definition (upstream llama.cpp's): for each multi-byte token of rank r, run BPE on its bytes
allowing only ranks below r; if that ends in two parts, they are the token's merge.
``merges_reference`` is that, plainly. ``bpe_merges`` runs the same greedy loop in compiled code,
finding byte strings through a hash table of every token; a hit is confirmed byte by byte, so the
result is exact whatever the hash does. The tests compare the two on vocabularies with ties and
unreachable tokens, and the benchmark on one of the real size.

``cached_merge_ranks`` keeps them in a folder k3lab owns (its cache), one entry per vocabulary, named
by the SHA-256 of the vocabulary's file: ``MAGIC``, the SHA-256 of the rest, then the pairs as
little-endian int32. An entry is used only when its own hash checks out and every pair joins two
tokens into a token of a higher rank, in rising order; anything else is made again and replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from pathlib import Path

import numpy as np

from k3lab.formats.files import InputFileError, read_bounded, write_atomically

MAGIC = b"k3lab-bpe-merges/1 "
_KEY = re.compile(r"[0-9a-f]{64}")


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


def cached_merge_ranks(tokens: list[bytes], key: str, folder: Path | None) -> list[tuple[int, int]]:
    """``bpe_merge_ranks(tokens)``, kept in ``folder`` under ``key`` (the SHA-256 of the file the
    tokens come from): read back when the entry proves itself, else made and written (best effort:
    a folder that cannot be written costs only the next plan the work)."""
    if folder is None or not _KEY.fullmatch(key):
        return bpe_merge_ranks(tokens)
    path = folder / f"{key}.merges"
    found = _read_entry(path, tokens)
    if found is not None:
        return found
    pairs = bpe_merge_ranks(tokens)
    body = np.asarray(pairs, dtype="<i4").reshape(-1, 2).tobytes()
    # best effort: a cache that cannot be written (read-only, full, a link in the way) costs only the
    # next plan this derivation again
    with contextlib.suppress(OSError, InputFileError):
        if not folder.is_symlink():
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(
                path, lambda fh: fh.write(MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
            )
    return pairs


def _read_entry(path: Path, tokens: list[bytes]) -> list[tuple[int, int]] | None:
    """An entry's pairs when it proves itself (its hash, and every pair a real merge in rank order)."""
    head = len(MAGIC) + 65
    try:
        data = read_bounded(path, head + 8 * len(tokens), "merges cache entry", follow=False)
    except (InputFileError, OSError):
        return None
    body = data[head:]
    if data[: len(MAGIC)] != MAGIC or len(body) % 8 or data[head - 1 : head] != b"\n":
        return None
    if data[len(MAGIC) : head - 1].decode("ascii", "replace") != hashlib.sha256(body).hexdigest():
        return None
    pairs = np.frombuffer(body, dtype="<i4").reshape(-1, 2)
    n = len(tokens)
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n):
        return None
    ranks = {t: r for r, t in enumerate(tokens)}
    last = -1
    out = []
    for a, b in pairs.tolist():  # each joins two tokens into a later one; rising by that one's rank
        merged = ranks.get(tokens[a] + tokens[b])
        if merged is None or merged <= max(a, b, last):
            return None
        last = merged
        out.append((a, b))
    return out
