"""A set's cost tables foretold from another's: what ``--fit`` would choose for a set whose data are not
here (the real model's plan, from its headers alone), from the losses per weight measured on a set of
the same widths that is.

A tensor's loss under a type scales with its weights: the same kind of matrix (its name without the
layer: ``ffn_down_exps.weight``) loses about the same per weight under a type whatever its width (ggml's
types quantise blocks of 32 or 256 values; the width decides only which types apply), and an expert's
loss counts by the share of the tokens routed to it (``costs._shares``: ``n_used / n_expert`` of them
on average). ``rates`` measures, per kind and type, the loss per weight (per unit of share for an
expert stack) on measured tables; ``foretold`` gives every tensor of a variant plan its options: the
bytes exact, the loss its weights times the kind's rate (times its share). The tables the solver then
reads are a forecast, said as one wherever they are shown: on synthetic weights the loss of a type
is that of random values; the real set's own tables (``--fit`` on it) are the measure.
"""

from __future__ import annotations

import math
import re
from typing import Any

from k3lab.errors import K3LabError
from k3lab.pipeline.quantizing.costs import Option, TensorCost, candidates
from k3lab.pipeline.quantizing.variant_notes import tensor_bytes

_LAYER = re.compile(r"^blk\.\d+\.")


def kind(name: str) -> str:
    """A tensor's kind: its name without the layer (``blk.7.attn_q_b.weight`` -> ``attn_q_b.weight``)."""
    return _LAYER.sub("", name)


def rates(tables: list[TensorCost], share: float) -> dict[str, dict[str, float]]:
    """Per kind, per type: the loss per weight of the measured ``tables`` (an expert stack's per unit
    of share, ``share`` being the average share of an expert in the measured set: n_used / n_expert)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for t in tables:
        weights = math.prod(t.ne) * (share if len(t.ne) > 2 else 1.0)
        per = sums.setdefault(kind(t.name), {})
        for o in t.options:
            if o.type != t.type:
                got = per.setdefault(o.type, [0.0, 0.0])
                got[0] += o.cost
                got[1] += weights
    return {k: {ty: c / w for ty, (c, w) in per.items()} for k, per in sums.items()}


def foretold(
    reference: Any, measured: dict[str, dict[str, float]], share: float
) -> tuple[list[TensorCost], int]:
    """The tables of every tensor ``reference`` (a variant plan over a set) quantises, from ``measured``
    (``rates``) and the set's average expert share; and the bytes of the tensors kept as they are.
    One line naming a tensor whose kind and width were not measured."""
    tables: list[TensorCost] = []
    fixed = 0
    for f in reference.files:
        for t in f.tensors:
            if not t.quantized:
                fixed += t.nbytes
                continue
            rate = measured.get(kind(t.name))
            if rate is None:
                raise K3LabError(
                    f"{f.filename}: tensor {t.name}: no {kind(t.name)} among the measured tables"
                )
            weights = math.prod(t.ne) * (share if len(t.ne) > 2 else 1.0)
            options = [Option(t.source_type, tensor_bytes(t.source_type, t.ne), 0.0)]
            options += [Option(ty, tensor_bytes(ty, t.ne), rate[ty] * weights)
                        for ty in candidates(t.ne, True) if ty != t.source_type and ty in rate]  # fmt: skip
            tables.append(TensorCost(t.name, t.source_type, tuple(t.ne), options))
    return tables, fixed
