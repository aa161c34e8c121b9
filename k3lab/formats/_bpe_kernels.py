"""The compiled kernel behind ``bpe_merges.bpe_merge_ranks`` (imported on first use: numba costs ~70 MB
and a few hundred ms to import, which only the vocabulary's writer should pay)."""

from __future__ import annotations

import numba
import numpy as np

# Byte strings are found by a polynomial hash: with prefix hashes of the token being split,
# the hash of any span costs O(1), so a miss (most lookups) never touches the bytes. A hit is
# confirmed byte by byte, so the result is exact whatever the hash does.
_B = np.uint64(0x100000001B3)
_EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)


@numba.njit(cache=True, inline="always")
def _mix(h):  # pragma: no cover - compiled
    """splitmix64's finaliser: the polynomial hash of a short string has empty high bits."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


@numba.njit(cache=True, inline="always")
def _slot(h, mask):  # pragma: no cover - compiled
    return _mix(h) & mask


@numba.njit(cache=True, inline="always")
def _find(buf, offs, table, bits, mask, h, start, end):  # pragma: no cover - compiled
    """Rank of buf[start:end] (whose hash is h), or -1. table[slot] = (hash, rank | length << 32);
    ``bits`` is a bitset of all token hashes that stays in cache and answers most misses at once."""
    bit = _mix(h) >> np.uint64(41)
    if not (bits[bit >> np.uint64(6)] >> (bit & np.uint64(63))) & np.uint64(1):
        return -1
    slot = _slot(h, mask)
    n = np.uint64(end - start)
    while True:
        word = table[slot, 1]
        if word == _EMPTY:
            return -1
        if table[slot, 0] == h and (word >> np.uint64(32)) == n:
            r = np.int64(word & np.uint64(0xFFFFFFFF))
            o, same = offs[r], True
            for i in range(end - start):
                if buf[o + i] != buf[start + i]:
                    same = False
                    break
            if same:
                return r
        slot = (slot + np.uint64(1)) & mask


@numba.njit(cache=True)
def _merges_kernel(buf, offs):  # pragma: no cover - compiled
    n_tok = offs.shape[0] - 1
    max_len = 1
    byte_rank = np.full(256, -1, dtype=np.int64)
    for r in range(n_tok):
        max_len = max(max_len, offs[r + 1] - offs[r])
        if offs[r + 1] - offs[r] == 1:
            byte_rank[buf[offs[r]]] = r
    power = np.empty(max_len + 1, dtype=np.uint64)
    power[0] = 1
    for i in range(max_len):
        power[i + 1] = power[i] * _B
    hashes = np.empty(n_tok, dtype=np.uint64)
    for r in range(n_tok):
        h = np.uint64(0)
        for i in range(offs[r], offs[r + 1]):
            h = h * _B + np.uint64(buf[i]) + np.uint64(1)
        hashes[r] = h
    cap = 1
    while cap < 2 * n_tok:
        cap *= 2
    mask = np.uint64(cap - 1)
    table = np.zeros((cap, 2), dtype=np.uint64)
    table[:, 1] = _EMPTY
    for r in range(n_tok):
        slot = _slot(hashes[r], mask)
        while table[slot, 1] != _EMPTY:
            slot = (slot + np.uint64(1)) & mask
        table[slot, 0] = hashes[r]
        table[slot, 1] = np.uint64(r) | (np.uint64(offs[r + 1] - offs[r]) << np.uint64(32))
    bits = np.zeros(1 << 17, dtype=np.uint64)  # 2**23 bits, 1 MiB
    for r in range(n_tok):
        bit = _mix(hashes[r]) >> np.uint64(41)
        bits[bit >> np.uint64(6)] |= np.uint64(1) << (bit & np.uint64(63))
    left = np.full(n_tok, -1, dtype=np.int64)  # ranks of a token's two merge parts, or -1
    right = np.full(n_tok, -1, dtype=np.int64)
    prefix = np.empty(max_len + 1, dtype=np.uint64)
    bounds = np.empty(max_len + 1, dtype=np.int64)  # parts are [bounds[i], bounds[i+1])
    part_rank = np.empty(max_len, dtype=np.int64)  # rank of part i
    pair_rank = np.empty(max_len, dtype=np.int64)  # rank of parts i and i+1 joined, or -1
    for r in range(n_tok):
        start, n = offs[r], offs[r + 1] - offs[r]
        if n < 2:
            continue
        prefix[0] = 0
        for i in range(n):
            prefix[i + 1] = prefix[i] * _B + np.uint64(buf[start + i]) + np.uint64(1)
            bounds[i] = i
            part_rank[i] = byte_rank[buf[start + i]]
        bounds[n] = n
        n_parts = n
        for i in range(n_parts - 1):
            a, b = bounds[i], bounds[i + 2]
            pair_rank[i] = _find(
                buf, offs, table, bits, mask, prefix[b] - prefix[a] * power[b - a], start + a, start + b
            )
        while n_parts > 1:
            best, best_i = -1, -1
            for i in range(n_parts - 1):
                pr = pair_rank[i]
                if pr >= 0 and (best < 0 or pr < best):
                    best, best_i = pr, i
            if best < 0 or best >= r:
                break
            part_rank[best_i] = best
            for i in range(best_i + 1, n_parts):  # drop the boundary between the merged parts
                bounds[i] = bounds[i + 1]
            for i in range(best_i + 1, n_parts - 1):
                part_rank[i] = part_rank[i + 1]
            for i in range(best_i, n_parts - 2):
                pair_rank[i] = pair_rank[i + 1]
            n_parts -= 1
            for i in (best_i - 1, best_i):
                if 0 <= i < n_parts - 1:
                    a, b = bounds[i], bounds[i + 2]
                    pair_rank[i] = _find(
                        buf,
                        offs,
                        table,
                        bits,
                        mask,
                        prefix[b] - prefix[a] * power[b - a],
                        start + a,
                        start + b,
                    )
        if n_parts == 2:  # the parts' ranks are known: no lookup needed
            left[r] = part_rank[0]
            right[r] = part_rank[1]
    return left, right
