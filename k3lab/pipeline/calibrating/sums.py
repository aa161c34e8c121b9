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

Sums are float32 as llama-imatrix keeps them; counts are integers. Nothing here knows a model.
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
    """The entries of the weights one step multiplies by (``collects(name)``: which are summed)."""

    process_output: bool = False
    entries: dict[str, Entry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)  # an imatrix file's, when these came from one
    chunk_count: int = 0

    def collects(self, name: str) -> bool:
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    def dense(self, name: str, x: np.ndarray, kept: np.ndarray | None = None) -> None:
        """The input of ``ggml_mul_mat(W, x)``: x [rows, n], or [n_mat, rows, n] for a weight of 3
        dims; ``kept``: which rows llama.cpp sums (those of a product of 16 rows or more: see
        ``run.ubatches``), all by default."""
        if not self.collects(name):
            return
        x3 = x if x.ndim == 3 else x.reshape(1, -1, x.shape[-1])
        if kept is not None:
            if not kept.any():
                return
            x3 = x3[:, kept]
        # (one count for all the matrices of a 3-D weight: its sums are one row of n_mat * n)
        squares = np.einsum("mrn,mrn->mn", x3, x3, dtype=np.float32).reshape(1, -1)
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(np.zeros_like(squares), np.zeros(1, np.int64))
        e.values += squares
        e.counts[0] += x3.shape[1]
        if not np.isfinite(e.values).all():
            raise NotFinite(
                f"tensor {name}: its input holds a value that is not finite (llama-imatrix stops too)"
            )

    def experts(self, name: str, x: np.ndarray, ids: np.ndarray, n_expert: int) -> None:
        """The input of ``ggml_mul_mat_id(W, x, ids)``: x [tokens, 1 or k, n], ids [tokens, k]."""
        if not self.collects(name):
            return
        tokens, k = ids.shape
        xs = np.broadcast_to(x, (tokens, k, x.shape[-1])).reshape(-1, x.shape[-1])
        flat = ids.reshape(-1).astype(np.int64)
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(
                np.zeros((n_expert, x.shape[-1]), np.float32), np.zeros(n_expert, np.int64)
            )
        order = np.argsort(flat, kind="stable")
        chosen = flat[order]
        touched, starts = np.unique(chosen, return_index=True)
        squares = xs[order] * xs[order]
        e.values[touched] += np.add.reduceat(squares, starts, axis=0, dtype=np.float32)
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
