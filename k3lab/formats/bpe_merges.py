"""BPE merges recovered from tiktoken ranks, fast and exactly as the definition gives them.

The definition (upstream llama.cpp's): for each multi-byte token of rank r, run BPE on its bytes
allowing only ranks below r; if that ends in two parts, they are the token's merge.
``merges_reference`` is that, plainly. ``bpe_merges`` runs the same greedy loop in compiled code,
finding byte strings through a hash table of every token; a hit is confirmed byte by byte, so the
result is exact whatever the hash does. The tests compare the two on vocabularies with ties and
unreachable tokens, and the benchmark on one of the real size.

They are derived each time they are needed (0.3 s for Kimi-K3's 163,584 ranks; by a child process
where this one has not loaded numba): an earlier cache of
them could hold pairs that check out as merges yet are not the derivation's, and proving an entry
cost about what deriving it does.
"""

from __future__ import annotations

import os

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
    """The merges as (left rank, right rank) pairs, in the order of the merged token's rank.

    Compiled code does it; a process that has not loaded numba yet (a plan, a tokenizer file: they
    need nothing else of it) has it done by a child that does (``_in_child``), so that LLVM's 110 MB
    never join the process's memory; where the child cannot run, it is done here."""
    import sys

    if "numba" not in sys.modules:
        got = _in_child(tokens)
        if got is not None:
            return got
    return _merge_ranks_here(tokens)


def _packed(tokens: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    offs = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    return np.frombuffer(b"".join(tokens), dtype=np.uint8), offs


def _merge_ranks_here(tokens: list[bytes]) -> list[tuple[int, int]]:
    try:  # numba is a dependency; without it the reference definition is used
        from k3lab.formats._bpe_kernels import _merges_kernel
    except ImportError:  # pragma: no cover
        ranks = {t: r for r, t in enumerate(tokens)}
        return [(ranks[a], ranks[b]) for a, b in merges_reference(tokens)]
    buf, offs = _packed(tokens)
    left, right = _merges_kernel(buf, offs)
    keep = left >= 0
    return list(zip(left[keep].tolist(), right[keep].tolist()))


CHILD_SECONDS = 300  # a vocabulary of millions of tokens derives in seconds; past this, done here


def _in_child(tokens: list[bytes]) -> list[tuple[int, int]] | None:
    """``_merge_ranks_here`` in an isolated child (``children.python_command``), the tokens sent on its
    standard input and the pairs read back, every count checked; None when the child cannot run or
    says anything else (then it is done here). The child dies with this process."""
    import subprocess

    from k3lab.children import python_command

    buf, offs = _packed(tokens)
    head = np.array([len(tokens), buf.size], dtype="<i8").tobytes()
    try:
        done = subprocess.run(
            python_command(
                "from k3lab.formats.bpe_merges import _child_main; _child_main()", str(os.getpid())
            ),
            input=head + offs.astype("<i8").tobytes() + buf.tobytes(),
            capture_output=True,
            timeout=CHILD_SECONDS,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    out = done.stdout
    if done.returncode != 0 or len(out) < 8:
        return None
    n = int(np.frombuffer(out[:8], dtype="<i8")[0])
    if not 0 <= n <= len(tokens) or len(out) != 8 + 16 * n:
        return None
    pairs = np.frombuffer(out[8:], dtype="<i8").reshape(2, n)
    if n and (pairs.min() < 0 or pairs.max() >= len(tokens)):
        return None
    return list(zip(pairs[0].tolist(), pairs[1].tolist()))


def _child_main() -> None:  # pragma: no cover - run in the child
    """The child's side of ``_in_child``: dies with its parent (Linux), reads the tokens, writes the pairs."""
    import sys

    _die_with(int(sys.argv[1]))
    data = sys.stdin.buffer.read()
    count, size = (int(x) for x in np.frombuffer(data[:16], dtype="<i8"))
    offs = np.frombuffer(data[16 : 16 + 8 * (count + 1)], dtype="<i8")
    buf = data[16 + 8 * (count + 1) : 16 + 8 * (count + 1) + size]
    pairs = _merge_ranks_here([buf[offs[k] : offs[k + 1]] for k in range(count)])
    left = np.array([a for a, _ in pairs], dtype="<i8")
    right = np.array([b for _, b in pairs], dtype="<i8")
    sys.stdout.buffer.write(np.array([len(pairs)], dtype="<i8").tobytes() + left.tobytes() + right.tobytes())


def _die_with(parent: int) -> None:  # pragma: no cover - run in the child
    """SIGKILL when the parent goes (prctl PR_SET_PDEATHSIG), and out now if it went already."""
    import contextlib
    import ctypes
    import signal

    with contextlib.suppress(
        OSError, AttributeError
    ):  # (no prctl: not Linux; the parent's exit still ends stdin)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def bpe_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The same merges as ``merges_reference``, computed in compiled code."""
    return [(tokens[a], tokens[b]) for a, b in bpe_merge_ranks(tokens)]
