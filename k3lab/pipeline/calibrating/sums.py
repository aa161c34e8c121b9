"""What ``llama-imatrix`` accumulates for each weight (``collect_imatrix`` in tools/imatrix of the tree
llama-cpp-python vendors), fed with the inputs of the products that weight takes part in:

- a ``MUL_MAT`` (a dense weight; of 3 dims: a matrix per outer index, as MLA's ``attn_k_b``): the
  squares of each input row, column by column, per matrix; one count, the rows per matrix. Only
  weights named ``blk.*`` (and ``output.weight`` with ``--process-output``), and only when the
  product has 16 rows or more (llama-imatrix skips smaller batches);
- a ``MUL_MAT_ID`` (an expert stack): for each (token, chosen expert), the squares of the input that
  expert took (the token's, or its slot's), into that expert's row; a count per expert: the tokens
  that chose it. Always collected;
- a value that is not finite stops the run (llama-imatrix exits there).

Sums are float32 as llama-imatrix keeps them, each row's squares added in the order llama-imatrix
adds them (float32 addition does not commute with regrouping: the same order gives the same bits);
counts are integers. Nothing here knows a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3lab.errors import K3LabError

MIN_ROWS = 16  # llama-imatrix: "why are small batches ignored (<16 tokens)?"


class NotFinite(K3LabError):
    """A product's input holds a value that is not finite (llama-imatrix stops there too)."""


@dataclass
class Entry:
    """One weight's sums: ``values`` float32 [m, n] and ``counts`` int64 [m]: m experts of n columns,
    or m = 1 for a dense weight (a 3-D one's matrices side by side in its one row)."""

    values: np.ndarray
    counts: np.ndarray

    @property
    def n(self) -> int:
        return int(self.values.shape[1])


@dataclass
class Sums:
    """The entries of the weights one step multiplies by (``collects(name)``: which are summed),
    each begun from ``start``'s entry of that weight when it has one (``--in-file``: llama-imatrix
    loads those files first and adds on top)."""

    process_output: bool = False
    entries: dict[str, Entry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)  # an imatrix file's, when these came from one
    chunk_count: int = 0
    start: dict[str, Entry] = field(default_factory=dict)

    def collects(self, name: str) -> bool:
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    def _entry(self, name: str, m: int, n: int) -> Entry:
        e = self.entries.get(name)
        if e is None:
            begun = self.start.get(name)
            if begun is None:
                e = Entry(np.zeros((m, n), np.float32), np.zeros(1 if m == 1 else m, np.int64))
            else:
                e = Entry(begun.values.astype(np.float32).reshape(-1, n).copy(), begun.counts.copy())
            self.entries[name] = e
        if e.values.shape != (m, n):
            raise K3LabError(
                f"tensor {name}: {m * n} sums here, {e.values.size} in --in-file (another model's imatrix?)"
            )
        return e

    def dense(self, name: str, x: np.ndarray) -> None:
        """One ``ggml_mul_mat(W, x)``'s input as llama-imatrix hears it (the caller keeps llama.cpp's
        rule: a product of 16 rows or more): x [rows, n], or [n_mat, rows, n] for a weight of 3 dims
        (its matrices' sums side by side in one row); each row's squares added in turn, in float32."""
        if not self.collects(name):
            return
        x3 = x if x.ndim == 3 else x.reshape(1, -1, x.shape[-1])
        n_mat, rows, n = x3.shape
        e = self._entry(name, 1, n_mat * n)
        if e.counts.size > 1 and (e.counts == e.counts[0]).all():
            e.counts = e.counts[:1].copy()  # (llama-imatrix: one count for a dense weight)
        acc = e.values.reshape(n_mat, n)
        for m in range(n_mat):
            _add_rows(acc[m], x3[m] * x3[m])
        e.counts += rows
        if not np.isfinite(e.values).all():
            raise NotFinite(
                f"tensor {name}: its input holds a value that is not finite (llama-imatrix stops too)"
            )

    def experts(self, name: str, x: np.ndarray, ids: np.ndarray, n_expert: int) -> None:
        """One ``ggml_mul_mat_id(W, x, ids)``'s input: x [tokens, 1 or k, n], ids [tokens, k]; in
        llama-imatrix's order: slot by slot, token by token, into the chosen expert's row."""
        if not self.collects(name):
            return
        tokens, k = ids.shape
        e = self._entry(name, n_expert, x.shape[-1])
        if e.counts.size == 1:
            e.counts = np.full(n_expert, e.counts[0])  # (an old file's one count, for every expert)
        flat = ids.T.reshape(-1).astype(np.int64)  # (slot-major: llama-imatrix's loops)
        if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
            raise K3LabError(f"tensor {name}: an expert id outside its {n_expert} experts")
        squares = (x * x).transpose(1, 0, 2)  # [1 or k, tokens, n]
        order = np.argsort(flat, kind="stable")
        touched, starts = np.unique(flat[order], return_index=True)
        for ex, a, b in zip(touched, starts, [*starts[1:], len(order)]):
            picked = order[a:b]
            _add_rows(e.values[ex], squares[(picked // tokens) % squares.shape[0], picked % tokens])
        e.counts += np.bincount(flat, minlength=n_expert)
        if not np.isfinite(e.values[touched]).all():
            raise NotFinite(
                f"tensor {name}: its input holds a value that is not finite (llama-imatrix stops too)"
            )

    def add(self, other: Sums) -> None:
        """Another run's entries added to these (``--in-file``, or one step's into the whole)."""
        for name, e in other.entries.items():
            mine = self.entries.get(name)
            if mine is None:
                self.entries[name] = Entry(e.values.copy(), e.counts.copy())
                continue
            if mine.values.shape != e.values.shape:
                raise K3LabError(
                    f"tensor {name}: {e.values.size} sums here, {mine.values.size} there (another model's?)"
                )
            if mine.counts.size == 1 and e.counts.size > 1:
                mine.counts = np.full(e.counts.size, mine.counts[0])
            mine.values += e.values
            mine.counts += e.counts


def _add_rows(acc: np.ndarray, squares: np.ndarray) -> None:
    """acc += each row of ``squares`` [rows, n] in turn, in float32: one ``+=`` per row, as
    llama-imatrix's loop adds them (a sum of all rows first would round differently)."""
    for row in squares:
        acc += row
