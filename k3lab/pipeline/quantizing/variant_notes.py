"""What a variant does that a user may not expect, said in one line each before any work (and a
tensor's bytes in a type, which that needs)."""

from __future__ import annotations

import math
from typing import Any

from k3lab.formats.ggml import TYPE_IDS


def tensor_bytes(type_name: str, ne: tuple[int, ...]) -> int:
    """The bytes of a tensor of ``ne`` values in a GGML type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(TYPE_IDS[type_name])]
    return math.prod(ne) // block * size


def notes(plan: Any) -> list[str]:
    """What a variant does that a user may not expect, one line each (said before any work): tensors
    made larger than their lossless form and lossy (Kimi-K3's MXFP4 experts under a type of 4.5 bits
    or more), an absolute imatrix path written into every file (a home folder, published), and
    tensors quantised that are not experts although the type names them (MXFP4_MOE's rule takes every
    3-D stack: attn_k_b, attn_v_b)."""
    out = []
    tensors = [t for f in plan.files for t in f.tensors]
    larger = [t for t in tensors if t.quantized and t.nbytes > tensor_bytes(t.source_type, t.ne)]
    if larger:
        grow = sum(t.nbytes - tensor_bytes(t.source_type, t.ne) for t in larger)
        kinds = sorted({f"{t.source_type}->{t.type}" for t in larger})
        out.append(
            f"{plan.label} makes {len(larger)} tensors larger than in the lossless set ({', '.join(kinds[:4])}"
            f"{' ...' if len(kinds) > 4 else ''}: {grow:,} bytes more) and lossy"
        )
    if plan.imatrix is not None and plan.imatrix.shown.startswith("/"):
        out.append(f"{plan.label}: quantize.imatrix.file records the path given, {plan.imatrix.shown[:127]!r}, in every "
                   "file (as llama-quantize records it): give a relative path to keep your folders out of it")  # fmt: skip
    if plan.spec.ftype == "MXFP4_MOE":
        stacks = sorted({t.name.split(".", 2)[-1] for t in tensors
                         if t.type == "MXFP4" and t.source_type != "MXFP4" and "_exps" not in t.name})  # fmt: skip
        if stacks:
            out.append(
                f"MXFP4_MOE also makes these 3-D tensors MXFP4, not only the experts: {', '.join(stacks)}"
            )
    return out
