"""One step of the imatrix (the embedding, a layer, the head) held for every chunk: its weights read
once (every byte checked) into ggml's memory as llama.cpp holds them, then, chunk after chunk, its
graph built by the model (``Calibration.build``), its memory placed by ggml's allocator and reused and
computed by ggml; every product's input handed to the step's ``Sums`` in llama-imatrix's order
(``batches``); the arrays the step writes returned for the next. The same object runs in this
process or, on Dask, in a worker (``pipeline``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.ggml import TYPE_IDS
from k3lab.formats.ggml_compute import Arena, Graph
from k3lab.formats.ggml_weights import WeightInfo, Weights
from k3lab.pipeline.calibrating.batches import BatchProducts
from k3lab.pipeline.calibrating.sets import SetTensor, TensorReader
from k3lab.pipeline.calibrating.sums import Sums
from k3lab.pipeline.model import CalibrationStep, Model


class StepRun:
    """Step ``step`` over ``n_chunks`` chunks of ``n_ctx`` tokens (``run`` for each in order, then
    ``finish``: a wave's ``Stage`` in this process); ``tensors``: where the step's weights are,
    ``reader`` reads them."""

    def __init__(
        self,
        model: Model,
        kvs: dict[str, Any],
        step: CalibrationStep,
        tensors: dict[str, SetTensor],
        reader: TensorReader,
        n_chunks: int,
        n_ctx: int,
        sums: Sums,
        threads: int,
    ):
        assert model.calibration is not None
        self.model, self.kvs, self.step, self.sums, self.threads = model, kvs, step, sums, threads
        self.n_ctx = n_ctx
        self.heard = BatchProducts(sums, n_chunks, n_ctx)
        self.arena = Arena()  # (one chunk's graph after another in the same memory)
        self.weights: Weights | None = None
        self.table: tuple[SetTensor, np.ndarray] | None = None
        if step.rows:  # the embedding: its rows picked per token, no graph (read whole: checked)
            self.table = (tensors[step.rows], reader.read(step.rows))
            return
        names = [n for n in tensors if step.owns(n)]
        infos = [WeightInfo(n, TYPE_IDS[tensors[n].record.type], tuple(tensors[n].record.ne)) for n in names]
        self.weights = Weights(infos, lambda info, into: reader.read(info.name, into))

    def run(self, c: int, tokens: np.ndarray, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Chunk ``c`` (its tokens, the arrays the step reads): the arrays the step writes."""
        if self.table is not None:
            return {"x": _rows(*self.table, tokens)}
        w = self.weights
        assert w is not None and self.model.calibration is not None
        calibration = self.model.calibration
        cuts = self.heard.chunk(c)
        slices = [(a, b) for a, b, _ in cuts]

        def build(g: Graph) -> dict[str, Any]:
            inputs = {k: g.input(v) for k, v in state.items()}
            return calibration.build(self.kvs, self.step, g, w, inputs, slices)

        with Graph(threads=self.threads, arena=self.arena) as g:
            outs = build(g)
            g.expand(*outs.values())
            g.compute()
            for p in g.products:
                name = w.name_of(p.weight)
                if name is None:
                    continue
                if p.ids is not None:
                    self.heard.experts(name, p.x.read(3), p.ids.read(2), w.infos[name].ne[2])
                    continue
                value = p.x.read(3 if len(w.infos[name].ne) > 2 else 2)
                self.heard.dense(name, value, p.part)  # (a part: the rows of one slice, per sequence)
            return {
                name: state[name] if name in state and name not in outs else outs[name].read(2)
                for name in self.step.writes
            }

    def finish(self) -> Sums:
        """The step's sums (the last batch handed on)."""
        self.heard.flush()
        return self.sums

    def close(self) -> None:
        self.arena.close()
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        self.table = None


def _rows(t: SetTensor, data: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The tokens' rows of a matrix, widened to float32 as ggml_get_rows widens them."""
    from k3lab.formats.ggml import ggml

    rec = t.record
    n_rows = math.prod(rec.ne[1:])
    row_bytes = rec.nbytes // n_rows
    if np.any((tokens < 0) | (tokens >= n_rows)):
        raise K3LabError(
            f"tensor {rec.name}: a token id outside its {n_rows} rows (a vocabulary of another set?)"
        )
    out = np.empty((len(tokens), rec.ne[0]), np.float32)
    lib = ggml()
    for j, tok in enumerate(tokens):
        lib.to_float(TYPE_IDS[rec.type], data[int(tok) * row_bytes : (int(tok) + 1) * row_bytes], out[j])
    return out
