"""The mix that loses least for a size: a type for every tensor, from the cost tables (``costs``), such
that the set's bytes stay within a budget and the summed loss is the least the tables allow.

Each tensor's options, as (bytes, loss) points, are reduced to their lower convex hull (an option that
another pair of options beats on both counts at every trade-off is never worth choosing); from every
tensor at its best option, the step that gives up the least loss per byte saved is taken, then the next,
until the set fits. On the hulls this greedy walk is the optimum of the problem's continuous relaxation,
and the integer answer it stops at is within one step of one tensor of the optimum: the last step is
the one that overshoots by at most that step's bytes. What comes out is the same kind of thing a
recipe is: a type per tensor, written as llama-quantize's flags (``--tensor-type-file``), so that the
variant is llama-quantize's bytes and can be made again with stock llama-quantize."""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3lab.errors import K3LabError
from k3lab.pipeline.quantizing.costs import Option, TensorCost

# the tensors llama.cpp keeps in RAM under --cpu-moe (common.h's LLM_FFN_EXPS_REGEX): the routed experts
CPU_MOE = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")


@dataclass(frozen=True)
class Budget:
    """What a mix must fit in. ``ram`` alone: every byte of the files plus ``context`` (the runtime's
    cache for the context asked for) in one memory (``--fit SIZE``: files only, no context). With
    ``vram``: llama.cpp run with ``--cpu-moe -ngl 99`` keeps the routed experts (``CPU_MOE``) in
    RAM and puts the rest and the cache on the GPU, so each side has its budget."""

    ram: int
    vram: int | None = None
    context: int = 0

    def words(self) -> str:
        if self.vram is None:
            return f"{self.ram:,} bytes" + (
                f" ({self.context:,} of them the context's cache)" if self.context else ""
            )
        return (f"{self.ram:,} bytes of RAM for the routed experts, {self.vram:,} of VRAM for the rest"
                + (f" and the context's cache ({self.context:,})" if self.context else ""))  # fmt: skip


@dataclass(frozen=True)
class Fitted:
    """The mix chosen: a type per tensor, the set's bytes, the summed loss (and the tables' bounds)."""

    types: dict[str, str]
    nbytes: int
    loss: float
    smallest: int  # the bytes of every tensor at its smallest option
    largest: int  # ... at its lossless one
    on_gpu: int | None = None  # with a VRAM budget: the bytes of the tensors on the GPU (the rest in RAM)

    def type_file(self) -> str:
        """llama-quantize's ``--tensor-type-file``: a line per tensor, its exact name as the pattern."""
        return "".join(f"^{re.escape(name)}$={t.lower()}\n" for name, t in sorted(self.types.items()))


def hull(options: list[Option]) -> list[Option]:
    """The lower convex hull of (bytes, loss), from the largest option down: each step saves bytes
    for more loss per byte than the step before it (options beaten on both counts, or lying above
    the line between two others, are never the best choice at any trade-off)."""
    pareto: list[Option] = []
    for o in sorted(options, key=lambda o: (o.nbytes, o.cost)):  # (fewest bytes first)
        if not pareto or o.cost < pareto[-1].cost:
            if pareto and o.nbytes == pareto[-1].nbytes:
                continue
            pareto.append(o)
    lower: list[Option] = []
    for o in pareto:
        while len(lower) >= 2:
            a, b = lower[-2], lower[-1]
            # b lies on or above the segment from a to o: not on the lower hull
            if (b.cost - a.cost) * (o.nbytes - a.nbytes) >= (o.cost - a.cost) * (b.nbytes - a.nbytes):
                lower.pop()
            else:
                break
        lower.append(o)
    return lower[::-1]


def floored(tables: list[TensorCost], floor_bits: float) -> list[TensorCost]:
    """Every tensor that is not an expert stack (what every token passes through: attention, dense
    layers, shared experts, the embedding and the head) kept at ``floor_bits`` bits per weight or
    more, as the recipes keep it (its loss measured on its own understates what it does downstream)."""
    out = []
    for t in tables:
        weights = 1
        for d in t.ne:
            weights *= d
        if len(t.ne) < 3 and floor_bits > 0:
            kept = [o for o in t.options if 8 * o.nbytes / weights >= floor_bits or o.cost == 0]
            t = TensorCost(t.name, t.type, t.ne, kept)
        out.append(t)
    return out


def fit(tables: list[TensorCost], budget: int, fixed: int = 0, what: str = "") -> Fitted:
    """Every tensor's type for a set of at most ``budget`` bytes (``fixed``: the bytes of what is not
    in the tables: norms, the vocabulary's metadata, the files' headers). One line when no mix fits
    or when the lossless set does already (``what``: the budget as the user gave it, for those lines)."""
    what = what or f"--fit {budget:,} bytes"
    hulls = {t.name: hull(t.options) for t in tables}
    largest = fixed + sum(h[0].nbytes for h in hulls.values())
    smallest = fixed + sum(h[-1].nbytes for h in hulls.values())
    if budget >= largest:
        raise K3LabError(f"{what}: the lossless set is {largest:,} bytes and fits already: nothing to lose")
    if budget < smallest:
        raise K3LabError(
            f"{what}: the smallest mix of these types is {smallest:,} bytes (every tensor at its smallest): "
            "give a larger budget"
        )
    at = {name: 0 for name in hulls}
    heap = []
    for name, h in hulls.items():
        if len(h) > 1:
            heapq.heappush(heap, (_slope(h[0], h[1]), name))
    total = largest
    while total > budget and heap:
        _, name = heapq.heappop(heap)
        h, i = hulls[name], at[name]
        total -= h[i].nbytes - h[i + 1].nbytes
        at[name] = i + 1
        if i + 2 < len(h):
            heapq.heappush(heap, (_slope(h[i + 1], h[i + 2]), name))
    chosen = {name: hulls[name][i] for name, i in at.items()}
    _spend_the_rest(tables, chosen, budget - total)
    total = fixed + sum(o.nbytes for o in chosen.values())
    return Fitted({n: o.type for n, o in chosen.items()}, total, sum(o.cost for o in chosen.values()),
                  smallest, largest)  # fmt: skip


def fit_machine(tables: list[TensorCost], budget: Budget, fixed: int = 0, fixed_gpu: int = 0) -> Fitted:
    """``fit`` for a machine: one budget (``budget.ram`` less the context's cache) when there is no
    GPU; with one, the routed experts fitted to the RAM and the rest (``fixed_gpu`` of it not in the
    tables: norms) to the VRAM less the cache, each side at its lossless types when it fits as it is."""
    cache = f" less the context's cache ({budget.context:,})" if budget.context else ""
    if budget.vram is None:
        return fit(tables, budget.ram - budget.context, fixed, f"--fit-ram {budget.ram:,} bytes{cache}")
    experts = [t for t in tables if CPU_MOE.search(t.name)]
    rest = [t for t in tables if not CPU_MOE.search(t.name)]
    sides = []
    for part, room, base, where in (
        (experts, budget.ram, fixed - fixed_gpu, f"--fit-ram {budget.ram:,} bytes for the routed experts"),
        (
            rest,
            budget.vram - budget.context,
            fixed_gpu,
            f"--fit-vram {budget.vram:,} bytes{cache} for the rest",
        ),
    ):
        lossless = base + sum(h[0].nbytes for h in (hull(t.options) for t in part))
        if room >= lossless:
            sides.append(Fitted({t.name: t.type for t in part}, lossless, 0.0, lossless, lossless))
            continue
        sides.append(fit(part, room, base, where))
    ram, gpu = sides
    if ram.loss == gpu.loss == 0 and ram.nbytes == ram.largest and gpu.nbytes == gpu.largest:
        raise K3LabError(f"{budget.words()}: the lossless set fits already: nothing to lose")
    return Fitted({**ram.types, **gpu.types}, ram.nbytes + gpu.nbytes, ram.loss + gpu.loss,
                  ram.smallest + gpu.smallest, ram.largest + gpu.largest, gpu.nbytes)  # fmt: skip


def _spend_the_rest(tables: list[TensorCost], chosen: dict[str, Option], slack: int) -> None:
    """What the walk left of the budget (its last step overshoots by less than a step) spent again:
    while a tensor can take a better option within it, the one that gains the most loss does."""
    while True:
        best = None
        for t in tables:
            now = chosen[t.name]
            for o in t.options:
                extra = o.nbytes - now.nbytes
                if o.cost < now.cost and extra <= slack and (best is None or now.cost - o.cost > best[0]):
                    best = (now.cost - o.cost, t.name, o, extra)
        if best is None:
            return
        _, name, o, extra = best
        chosen[name] = o
        slack -= extra


def _slope(a: Option, b: Option) -> float:
    """Loss gained per byte saved going from ``a`` to ``b``."""
    return (b.cost - a.cost) / max(1, a.nbytes - b.nbytes)


# --- a mix for a set -------------------------------------------------------------------------------

FTYPE_OF = {"Q2_K": "Q2_K", "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q6_K": "Q6_K", "Q8_0": "Q8_0",
            "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_S",
            "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S", "IQ4_XS": "IQ4_XS", "MXFP4": "MXFP4_MOE", "BF16": "BF16",
            "F16": "F16"}  # fmt: skip


def floor_bits(name: str) -> float:
    """``--fit-floor``'s bits per weight (``none``: 0): one line for a name that is not a ggml type."""
    from k3lab.formats.ggml import TYPE_IDS, ggml

    up = name.upper()
    if up == "NONE":
        return 0.0
    if up not in TYPE_IDS:
        raise K3LabError(f"--fit-floor {name!r}: a ggml type (Q4_K, Q6_K ...) or none")
    tr = ggml().traits(TYPE_IDS[up])
    return 8 * tr.block_bytes / tr.block


def reference_plan(plan: Any, kvs: Any, use: Any) -> Any:
    """The variant plan the tables are made over: every tensor llama-quantize quantises in the set
    ``plan`` describes (``kvs``: its file 1's keys), with the imatrix ``use`` (sizes only: nothing is
    made from it; which tensors are quantised does not depend on the type)."""
    from k3lab.pipeline.quantizing.llama_types import QuantSpec
    from k3lab.pipeline.quantizing.start import plan_variants
    from k3lab.pipeline.quantizing.variant import Variant

    (reference,) = plan_variants(plan, kvs, [Variant("fit", QuantSpec("Q8_0"), use)], True)
    return reference


def choose_mix(folder: Any, plan: Any, label: str, use: Any, budget: Budget, bits: float, rows: int,
               say: Callable[[str], None] | None = None) -> tuple[Fitted, str]:  # fmt: skip
    """The mix of the set in ``folder`` (its ``plan``) that loses least in a variant within
    ``budget``, its files' headers counted exactly (the fit made again within what they leave), with
    the imatrix ``use``; and the file type it is named by."""
    from k3lab.pipeline.quantizing.costs import set_tables
    from k3lab.pipeline.quantizing.llama_types import QuantSpec
    from k3lab.pipeline.quantizing.start import plan_variants
    from k3lab.pipeline.quantizing.variant import Variant

    kvs = folder.plans.kvs(plan)
    reference = reference_plan(plan, kvs, use)
    tables, fixed = set_tables(folder, reference, rows, say)
    fixed_gpu = sum(t.nbytes for f in reference.files for t in f.tensors
                    if not t.quantized and not CPU_MOE.search(t.name))  # fmt: skip
    headers = sum(r.data_start for k in range(1, len(plan.files) + 1) if (r := folder.records.text(k)))
    target = budget
    for _ in range(8):
        fitted = fit_machine(floored(tables, bits), target, fixed + headers, fixed_gpu)
        ftype = _ftype_of(tables, fitted.types)
        overrides = tuple((f"^{re.escape(n)}$", t) for n, t in sorted(fitted.types.items()))
        (vp,) = plan_variants(plan, kvs, [Variant(label, QuantSpec(ftype, overrides), use)])
        size = variant_bytes(vp)
        gpu = sum(t.nbytes for f in vp.files for t in f.tensors if not CPU_MOE.search(t.name))
        if budget.vram is None:
            over_ram, over_gpu = size + budget.context - budget.ram, 0
        else:
            over_ram, over_gpu = size - gpu - budget.ram, gpu + budget.context - budget.vram
        if over_ram <= 0 and over_gpu <= 0:
            return dataclasses.replace(
                fitted, nbytes=size, on_gpu=None if budget.vram is None else gpu
            ), ftype
        target = dataclasses.replace(
            target,
            ram=target.ram - max(0, over_ram),
            vram=None if target.vram is None else target.vram - max(0, over_gpu),
        )
    raise K3LabError(f"{budget.words()}: no mix found within it once its files' headers are counted")


def _ftype_of(tables: list[TensorCost], types: dict[str, str]) -> str:
    """The file type a mix is named by (``general.file_type``, llama-quantize's argument): its type of
    the most bytes among the tensors it changes."""
    import collections

    weight: collections.Counter = collections.Counter()
    for t in tables:
        if types[t.name] != t.type:
            weight[types[t.name]] += next(o.nbytes for o in t.options if o.type == types[t.name])
    return FTYPE_OF.get(weight.most_common(1)[0][0] if weight else "Q8_0", "Q8_0")


def variant_bytes(vp: Any) -> int:
    """A variant's files' bytes, counted without writing them (their headers as written)."""
    from gguf import GGMLQuantizationType

    from k3lab.formats.ggml import TYPE_IDS
    from k3lab.formats.gguf_data import TensorInfo, file_size

    return sum(
        file_size(None, vp.file_kvs(f.number),
                  [TensorInfo(t.name, GGMLQuantizationType(TYPE_IDS[t.type]), t.shape) for t in f.tensors])
        for f in vp.files
    )  # fmt: skip
