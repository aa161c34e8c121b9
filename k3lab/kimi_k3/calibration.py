"""Kimi-K3 run a step at a time on the tensors of a converted set (GGUF names): the embedding, one
layer, or the head, as llama.cpp's ``kimi-k3`` graph runs them (``src/models/kimi-k3.cpp`` and the
helpers it calls in ``llama-graph.cpp`` and ``delta-net-base.cpp`` of the tree llama-cpp-python
vendors): the same ggml operations, in the same order, with the same constants, so that ggml's CPU
kernels (``formats.ggml_compute``) compute what llama.cpp computes, bit for bit. That is what the
imatrix stage needs: llama.cpp quantises a product's activations (BF16 for a BF16 weight, Q8_0 for
an MXFP4 one), so a last-bit difference upstream flips a code and moves the sums; a forward that
only approximates llama.cpp's drifts layer by layer and, past a near tie, routes a token elsewhere.

A step reads the state the step before it left, per chunk (each a [tokens, width] array: the residual
stream ``x``, and the AttnRes bank ``bank.IL`` for each layer IL that banked its input) and leaves its
own; the graph records every matrix product it makes (``Graph.products``: the imatrix stage reads
each one's input once the graph ran, as llama-imatrix's callback does).

Each chunk is one sequence from an empty state (llama-imatrix clears its memory per chunk): the
convolution state and the delta-rule state start at zero, the MLA cache holds the chunk's own keys in
F16 (llama.cpp's default cache type), attention is ggml's flash attention (llama.cpp's default on
the CPU) under a causal mask.
"""

from __future__ import annotations

from typing import Any

from k3lab.formats.ggml_compute import Graph, Tensor
from k3lab.kimi_k3.layer_graph import Hparams, LayerGraph, Weights
from k3lab.pipeline.model import CalibrationStep as Step

EMBED, HEAD = "embed", "head"


EMBED_TENSORS = ("token_embd.weight",)
HEAD_TENSORS = ("output_res_score.weight", "output_norm.weight", "output.weight")


def steps(hp: Hparams) -> list[Step]:
    """The steps in order, with what each reads and writes: the embedding (the tokens' rows of
    ``token_embd``), each layer, the head."""
    out = [Step(EMBED, (), ("x",), names=EMBED_TENSORS, rows=EMBED_TENSORS[0])]
    bank: list[str] = []
    for il in range(hp.n_layer):
        writes = ("x", f"bank.{il}") if hp.banked(il) else ("x",)
        out.append(Step(f"layer {il}", ("x", *bank), writes, prefix=f"blk.{il}.", layer=il))
        if hp.banked(il):
            bank.append(f"bank.{il}")
    out.append(Step(HEAD, ("x", *bank), (), names=HEAD_TENSORS))
    return out


class Calibration:
    """Kimi-K3 for the imatrix stage (``pipeline.model.Calibration``)."""

    def steps(self, kvs: dict[str, Any]) -> list[Step]:
        return steps(Hparams.from_kvs(kvs))

    def build(
        self,
        kvs: dict[str, Any],
        step: Step,
        g: Graph,
        w: Weights,
        state: dict[str, Tensor],
        slices: list[tuple[int, int]],
    ) -> dict[str, Tensor]:
        """The step's graph on ``g`` for one chunk (``slices``: its tokens as llama.cpp's ubatches
        hold them): its outputs by name (a banked layer's input is its ``bank.IL``)."""
        hp = Hparams.from_kvs(kvs)
        graph = LayerGraph(hp, g, w, slices)
        bank = [state[name] for name in step.reads if name.startswith("bank.")]
        if step.layer < 0:
            return {"logits": graph.build_head(state["x"], bank)}
        out = {"x": graph.build_layer(step.layer, state["x"], bank)}
        if hp.banked(step.layer):
            out[f"bank.{step.layer}"] = state["x"]
        return out


CALIBRATION = Calibration()
