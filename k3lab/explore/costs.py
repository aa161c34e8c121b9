"""What each tensor costs under each type, and the curve a person chooses a size from (notebook 06):
the set's cost tables (``pipeline.quantizing.costs``, measured where they are missing, as ``quantize
--fit`` measures them), drawn per tensor kind and layer, and the least loss the solver finds for every
size, beside each variant's own."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# notebook 06's panels: a type each, with llama.cpp's fallback where its blocks do not divide the rows
COST_LADDER = (("Q8_0",), ("Q4_K", "Q5_0"), ("Q2_K", "Q4_0"), ("IQ2_XXS", "IQ4_NL"))


def cost_tables(out_dir: str | Path, imatrix: str | None = None, rows: int = 16) -> tuple[list[Any], int]:
    """The cost table of every tensor of the finished set in ``out_dir`` (with ``imatrix``, else the
    set's own), kept beside the set as ``--fit`` keeps them; and the bytes of what is kept as it is."""
    from k3lab.explore.variants import set_imatrix
    from k3lab.pipeline.quantizing.costs import set_tables
    from k3lab.pipeline.quantizing.fit import reference_plan
    from k3lab.pipeline.quantizing.imatrix_files import open_imatrix
    from k3lab.pipeline.state import OutputFolder
    from k3lab.request import Request

    folder = OutputFolder(out_dir)
    plan = folder.plans.require(Request(out_dir=str(out_dir)).load_model())
    location = set_imatrix(out_dir, imatrix)
    use = open_imatrix(location) if location else None
    return set_tables(folder, reference_plan(plan, folder.plans.kvs(plan), use), rows)


def cost_grid(tables: list[Any], types: tuple[str, ...]) -> tuple[list[str], list[int], np.ndarray]:
    """The loss of every layer's tensor of each kind under the first of ``types`` offered for it (as
    llama.cpp falls back to another type where a block does not divide the rows: ``("Q2_K", "Q4_0")``),
    NaN where none is: (kinds, layers, [kind, layer] losses)."""
    found: dict[tuple[str, int], float] = {}
    for t in tables:
        m = _LAYER.match(t.name)
        if m is None:
            continue
        offered = {o.type: o.cost for o in t.options}
        cost = next((offered[ty] for ty in types if ty in offered), math.nan)
        found[(m[2].removesuffix(".weight"), int(m[1]))] = cost
    kinds = sorted({k for k, _ in found})
    layers = sorted({n for _, n in found})
    grid = np.full((len(kinds), len(layers)), np.nan)
    for (k, n), cost in found.items():
        grid[kinds.index(k), layers.index(n)] = cost
    return kinds, layers, grid


def loss_curve(
    tables: list[Any], fixed: int, points: int = 24, floor: str = "Q2_K"
) -> list[tuple[int, float]]:
    """(bytes, loss) of the mix ``--fit`` chooses at ``points`` sizes from the smallest it can make to
    the lossless set (files' headers aside): the least loss for each size, the curve to choose from."""
    from k3lab.pipeline.quantizing.fit import fit, floor_bits, floored, hull

    kept = floored(tables, floor_bits(floor))
    smallest = fixed + sum(hull(t.options)[-1].nbytes for t in kept)
    largest = fixed + sum(hull(t.options)[0].nbytes for t in kept)
    curve = []
    for k in range(points):
        budget = int(smallest + (largest - 1 - smallest) * k / max(1, points - 1))
        got = fit(kept, budget, fixed)
        curve.append((got.nbytes, got.loss))
    return curve + [(largest, 0.0)]


def variant_losses(variants: dict[str, Any], tables: list[Any]) -> list[dict[str, Any]]:
    """A row per variant: its tensors' bytes and the loss the tables give the types it chooses (None
    where a type it chooses was not measured)."""
    costs = {t.name: {o.type: o.cost for o in t.options} for t in tables}
    rows = []
    for label, vp in variants.items():
        loss: float | None = 0.0
        for f in vp.files:
            for t in f.tensors:
                if t.quantized:
                    c = costs.get(t.name, {}).get(t.type)
                    loss = None if c is None or loss is None else loss + c
        rows.append({"variant": label, "bytes": sum(t.nbytes for f in vp.files for t in f.tensors),
                     "predicted loss": loss})  # fmt: skip
    return rows
