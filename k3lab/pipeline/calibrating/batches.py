"""The order llama-imatrix hears a batch's products in, kept while k3lab computes a chunk at a time.

llama-imatrix runs ``n_seq = 2048 // chunk size`` chunks side by side (a batch), and llama.cpp cuts
the batch into ubatches of at most 512 tokens holding the same number of tokens of each chunk
(``split_equal``): a chunk's tokens come in slices (``ubatches``). Every product is computed, and its
input handed to llama-imatrix, once per ubatch: the slice of the first chunk, then of the next.
float32 sums depend on the order they are added in, so ``BatchProducts`` holds the inputs of a
batch's chunks as k3lab's chunk-at-a-time graphs make them and hands them to ``Sums`` ubatch by
ubatch when the batch is complete, as llama-imatrix would have: the same additions, the same bits.

A dense product of fewer than 16 rows is not summed (llama-imatrix skips it): the rows of a ubatch's
product, or, for a product made per sequence (each chunk is a KV stream of its own there: the MLA
value projection after attention), the rows of one chunk's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3lab.pipeline.calibrating.sums import MIN_ROWS, Sums

BATCH, UBATCH = 2048, 512  # llama-imatrix's default batch and ubatch


def ubatches(chunk: int, n_chunks: int, n_ctx: int) -> list[tuple[int, int, int]]:
    """The chunk's tokens as llama.cpp's ubatches hold them: slices (a, b, rows of that ubatch's
    products). Its batch holds ``n_seq`` chunks (fewer at the end); each ubatch takes the same number
    of tokens of every chunk, as many as fit in 512 (at least one), the last what remains."""
    n_seq = max(1, BATCH // n_ctx)
    in_batch = min(n_seq, n_chunks - (chunk // n_seq) * n_seq)
    step = min(n_ctx, max(1, UBATCH // in_batch))
    return [(a, min(n_ctx, a + step), in_batch * (min(n_ctx, a + step) - a)) for a in range(0, n_ctx, step)]


@dataclass
class _Piece:
    """One chunk's share of one ubatch's product."""

    x: np.ndarray
    ids: np.ndarray | None = None
    n_expert: int = 0
    per_sequence: bool = False


class BatchProducts:
    """The products' inputs of the chunks of one batch, handed to ``sums`` in llama.cpp's order
    (``chunk(c)`` before each chunk's products; ``flush()`` after the last chunk)."""

    def __init__(self, sums: Sums, n_chunks: int, n_ctx: int):
        self.sums, self.n_chunks, self.n_ctx = sums, n_chunks, n_ctx
        self.n_seq = max(1, BATCH // n_ctx)
        self.cuts: list[tuple[int, int, int]] = []
        self._held: list[dict[str, list[_Piece]]] = []  # per ubatch: weight -> its chunks' pieces

    def chunk(self, c: int) -> list[tuple[int, int, int]]:
        """Chunk ``c`` begins (a batch before it is handed on when ``c`` begins a new one): its slices."""
        if c % self.n_seq == 0:
            self.flush()
        self.cuts = ubatches(c, self.n_chunks, self.n_ctx)
        if not self._held:
            self._held = [{} for _ in self.cuts]
        return self.cuts

    def dense(self, name: str, x: np.ndarray, cut: int | None = None) -> None:
        """The input of ``ggml_mul_mat(W, x)`` for this chunk: all of its rows (x [.., n_ctx, n]), or,
        made per sequence, the rows of slice ``cut`` alone."""
        if not self.sums.collects(name):
            return
        if cut is not None:
            self._hold(cut, name, _Piece(x, per_sequence=True))
            return
        for i, (a, b, _) in enumerate(self.cuts):
            self._hold(i, name, _Piece(x[..., a:b, :]))

    def experts(self, name: str, x: np.ndarray, ids: np.ndarray, n_expert: int) -> None:
        """The input of ``ggml_mul_mat_id(W, x, ids)`` for this chunk: x [n_ctx, 1 or k, n]."""
        if not self.sums.collects(name):
            return
        for i, (a, b, _) in enumerate(self.cuts):
            self._hold(i, name, _Piece(x[a:b], ids[a:b], n_expert))

    def _hold(self, i: int, name: str, piece: _Piece) -> None:
        self._held[i].setdefault(name, []).append(piece)

    def flush(self) -> None:
        """The held batch to ``sums``: ubatch by ubatch, each product once, its rows chunk after chunk."""
        for products in self._held:
            for name, pieces in products.items():
                first = pieces[0]
                if first.ids is not None:
                    x = np.concatenate([p.x for p in pieces], axis=0)
                    ids = np.concatenate([p.ids for p in pieces if p.ids is not None], axis=0)
                    self.sums.experts(name, x, ids, first.n_expert)
                    continue
                rows = first.x.shape[-2] if first.per_sequence else sum(p.x.shape[-2] for p in pieces)
                if rows >= MIN_ROWS:
                    self.sums.dense(name, np.concatenate([p.x for p in pieces], axis=-2))
        self._held = []
