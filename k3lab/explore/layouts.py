"""A shard's tensors, where they are and what each becomes (notebook 01): read from the shard's header
alone; the rule table decides what each source tensor becomes, so a row and a line of TENSOR_MAP.md
always agree."""

from __future__ import annotations

from typing import Any

from k3lab.errors import K3LabError
from k3lab.pipeline.planning.plan import Plan, PlannedFile
from k3lab.pipeline.sources.base import Source
from k3lab.pipeline.writing.single import plan_single


def _number(value: Any, count: int, what: str) -> int:
    """A 1-based number a notebook was given, checked as the CLI checks it (never wrapped around)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= count:
        raise K3LabError(f"{what} {value!r}: give a number from 1 to {count}")
    return value


def output_file(plan: Plan, number: Any) -> PlannedFile:
    """Output file ``number`` (1-based) of the plan; one line when there is no such file."""
    return plan.file(_number(number, len(plan.files), "file"))


def first_shard(plan: Plan, source: Source, number: Any) -> int:
    """The source shard (1-based) output file ``number`` reads first: what a batch run of notebook 01
    opens for that file."""
    pf = output_file(plan, number)
    files = source.files()
    return files.index(pf.sources[0].file) + 1 if pf.sources and pf.sources[0].file in files else 1


def file_layers(plan: Plan, number: Any) -> list[int]:
    """The model's layers output file ``number`` holds (its other units, the embedding or the head,
    left out)."""
    return [u for u in output_file(plan, number).units if isinstance(u, int)]


def first_mxfp4_layer(plan: Plan, pf: PlannedFile) -> int | None:
    """The first layer of ``pf`` whose routed experts are MXFP4 (the block a notebook draws), or None."""
    for t in pf.tensors:
        if t.transform == "mxfp4_stack" and t.layer is not None:
            return t.layer
    return None


def planned_by_source(plan: Plan) -> dict[str, list[tuple[Any, Any]]]:
    """Source tensor -> every (file, output tensor) it feeds: ``kv_b_proj`` feeds both ``attn_k_b``
    and ``attn_v_b``, and a row must show both."""
    out: dict[str, list[tuple[Any, Any]]] = {}
    for f in plan.files:
        for t in f.tensors:
            for s in t.sources:
                out.setdefault(s, []).append((f, t))
    return out


def shard_rows(plan: Plan, source: Source, shard: int, by_source: dict | None = None) -> list[dict[str, Any]]:
    """One row per tensor of source shard ``shard`` (1-based): where it is, and what it becomes. Reads
    that shard's header only (the plan is made once: ``open_conversion``)."""
    files = source.files()
    fname = files[_number(shard, len(files), "shard") - 1]
    entries = sorted(source.header(fname).values(), key=lambda e: e.start)
    mapped = by_source if by_source is not None else planned_by_source(plan)
    if not mapped.keys() & {e.name for e in entries}:
        try:
            mapped = {s: [(None, t)] for t in plan_single(plan.model, plan.cfg, source) for s in t.sources}
        except K3LabError:  # not a vision shard either
            mapped = {}
    rows = []
    for e in entries:
        targets = mapped.get(e.name, [])
        rows.append(
            {
                "tensor": e.name,
                "dtype": e.dtype,
                "shape": e.shape,
                "offset": e.start,
                "bytes": e.nbytes,
                "gguf": " + ".join(t.name for _, t in targets),
                "gguf type": " + ".join(t.info.type.name for _, t in targets),
                "gguf ne": " + ".join(str(list(t.info.ne)) for _, t in targets),
                "transform": " + ".join(t.transform for _, t in targets),
                "file": targets[0][0].filename
                if targets and targets[0][0]
                else ("mmproj" if targets else ""),
            }
        )
    return rows


def derive_tensor(plan: Plan, source: Source, shard: int, name: str | None = None) -> dict[str, Any]:
    """One output tensor of output file ``shard`` made from the source by the converter's own stream
    (a Hub source reads exactly its source tensors' bytes): its sources, the first bytes in and out,
    and the SHA-256 of its GGML bytes, which the file's record (and ``verify``) has too."""
    import hashlib

    import numpy as np

    from k3lab.pipeline.writing.convert import tensor_pieces, tensor_reader

    pf = output_file(plan, shard)
    pt = next((t for t in pf.tensors if name in (None, t.name)), None)
    if pt is None:
        raise K3LabError(f"output file {shard}: no tensor {name}")
    reader = tensor_reader(source, pf, pt)
    entries = reader.entries
    h, first, n = hashlib.sha256(), b"", 0
    for piece in tensor_pieces(pt, reader):
        data = memoryview(np.ascontiguousarray(piece)).cast("B")
        first = first or bytes(data[:32])
        h.update(data)
        n += len(data)
    src = entries[pt.sources[0]]
    head = np.asarray(source.rows(pt.sources[0], 0, 1)).tobytes()[:32]
    return {
        "gguf": pt.name,
        "type": pt.info.type.name,
        "ne": list(pt.info.ne),
        "transform": pt.transform,
        "sources": len(pt.sources),
        "first source": f"{pt.sources[0]} ({src.dtype} {list(src.shape)})",
        "source bytes": head.hex(" "),
        "gguf bytes": first.hex(" "),
        "nbytes": n,
        "sha256": h.hexdigest(),
    }
