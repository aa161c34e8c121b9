"""Convert: one output file per text source shard, streamed tensor by tensor, resumable.

For output file k: write the GGUF header and tensor infos, then for each planned tensor read
its source ranges (memory maps), transform, and stream the bytes to ``NAME.partial``, hashing
as they go; fsync, rename, and record the hashes (``manifest``). Memory is bounded by the
largest piece handed to the writer: a slab of rows (COPY_CHUNK) for copies and casts, one
expert for stacked experts, or one small tensor for the few value transforms.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from . import hashing, mxfp4
from .arch import ARCH, general, hyperparameters
from .config import K3Config
from .gguf_io import PIECES_IN_FLIGHT, GGUFStream, split_kvs
from .manifest import header_sha256, is_complete, write_record
from .numerics import bf16_bits_to_f32, f32_to_bf16_bits
from .plan import Plan, PlannedFile, PlannedTensor
from .rules import expert_dims
from .transforms import TRANSFORMS

COPY_CHUNK = 32 * 1024 * 1024  # bytes of rows per piece when copying or casting
Progress = Callable[[int], None]


def to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Source holding array -> float32 values (exact for BF16, F16, F32)."""
    return bf16_bits_to_f32(a) if dtype == "BF16" else np.asarray(a, dtype=np.float32)


def cast(a: np.ndarray, src_dtype: str, target: GGMLQuantizationType) -> np.ndarray:
    """Holding array of ``src_dtype`` -> the bytes of ggml type ``target`` (no-op when equal)."""
    same = {
        "BF16": GGMLQuantizationType.BF16,
        "F16": GGMLQuantizationType.F16,
        "F32": GGMLQuantizationType.F32,
    }
    if same.get(src_dtype) == target:
        return a
    values = to_float32(a, src_dtype)
    if target == GGMLQuantizationType.F32:
        return values
    if target == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    if target == GGMLQuantizationType.BF16:
        return f32_to_bf16_bits(values)
    raise ValueError(f"cannot cast {src_dtype} to {target.name}")


class SourceHashes:
    """SHA-256 of each source tensor, fed with the bytes as the converter reads them."""

    def __init__(self) -> None:
        self._h: dict[str, Any] = {}

    def feed(self, name: str, data: np.ndarray) -> None:
        hashing.update(self._h.setdefault(name, hashing.sha256()), data, hashing.SOURCE)

    def hexdigest(self, name: str) -> str:
        hashing.wait()
        return self._h.setdefault(name, hashing.sha256()).hexdigest()


def _row_slabs(a: np.ndarray) -> Iterator[np.ndarray]:
    if a.ndim == 0 or a.nbytes <= COPY_CHUNK:
        yield a
        return
    rows = max(1, COPY_CHUNK // (a.nbytes // a.shape[0]))
    for i in range(0, a.shape[0], rows):
        yield a[i : i + rows]


def tensor_pieces(
    pt: PlannedTensor, source: Any, cfg: K3Config, hashes: SourceHashes, progress: Progress | None = None
) -> Iterator[np.ndarray]:
    """The output bytes of one planned tensor, in pieces of bounded size."""
    entries = [source.entry(n) for n in pt.sources]
    target = pt.info.type
    if pt.rule.dtype == "mxfp4":
        rows, cols = expert_dims(cfg, pt.name)
        # buffers in turn: the writer is still hashing earlier experts while the next is repacked
        bufs = [np.empty((rows, mxfp4.row_bytes(cols)), dtype=np.uint8) for _ in range(PIECES_IN_FLIGHT + 1)]
        for e in range(0, len(entries), 2):  # (packed, scale) per expert
            packed, scale = source.array(entries[e].name), source.array(entries[e + 1].name)
            hashes.feed(entries[e].name, packed)
            hashes.feed(entries[e + 1].name, scale)
            buf = bufs[e // 2 % len(bufs)]
            mxfp4.repack_into(packed, scale, buf, what=f"{entries[e].file}: tensor {entries[e].name}")
            yield buf
            if progress:
                progress(packed.nbytes + scale.nbytes)
        return
    if pt.transform == "stack":  # float experts, one at a time
        for e in entries:
            a = source.array(e.name)
            hashes.feed(e.name, a)
            yield cast(a, e.dtype, target)
            if progress:
                progress(a.nbytes)
        return
    if pt.transform == "copy":
        (e,) = entries
        for slab in _row_slabs(source.array(e.name)):
            hashes.feed(e.name, slab)
            yield cast(slab, e.dtype, target)
            if progress:
                progress(slab.nbytes)
        return
    arrays = [source.array(e.name) for e in entries]
    for e, a in zip(entries, arrays):
        hashes.feed(e.name, a)
    t = TRANSFORMS[pt.transform]
    if t.on_values:
        out = t.fn(*(to_float32(a, e.dtype) for a, e in zip(arrays, entries)), cfg=cfg)
        yield cast(out, "F32", target)
    else:
        yield cast(t.fn(*arrays, cfg=cfg), entries[0].dtype, target)
    if progress:
        progress(sum(a.nbytes for a in arrays))


def write_tensors(
    path: Path,
    arch: str,
    kvs: list,
    tensors: list[PlannedTensor],
    source: Any,
    cfg: K3Config,
    progress: Progress | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Stream planned tensors into one GGUF file; returns their manifest entries and the data start."""
    hashes = SourceHashes()
    records = []
    with GGUFStream(path, arch, kvs, [t.info for t in tensors]) as g:
        for pt in tensors:
            offset = g.data_offset_next()
            sha = g.write(pt.name, tensor_pieces(pt, source, cfg, hashes, progress))
            records.append(
                {
                    "name": pt.name,
                    "type": pt.info.type.name,
                    "ne": list(pt.info.ne),
                    "nbytes": pt.nbytes,
                    "offset": offset,
                    "sha256": sha,
                    "transform": pt.transform,
                    "sources": [
                        {"name": n, "file": source.weight_map[n], "sha256": hashes.hexdigest(n)}
                        for n in pt.sources
                    ],
                }
            )
    return records, g.data_start


def file_kvs(plan: Plan, pf: PlannedFile, meta_dir: str | Path) -> list:
    """Split keys in every file; the first also carries all metadata and the tokenizer."""
    from .tokenizer import build_vocabulary

    kvs = split_kvs(pf.number - 1, len(plan.files), plan.n_tensors)
    if pf.number == 1:
        name = f"{plan.basename} {plan.label}"
        kvs = (
            general(plan.cfg, name, plan.file_type)
            + hyperparameters(plan.cfg)
            + build_vocabulary(meta_dir, plan.cfg).kvs()
            + kvs
        )
    return kvs


@dataclass
class FileResult:
    number: int
    filename: str
    skipped: bool
    seconds: float
    nbytes: int


def convert_file(
    plan: Plan,
    number: int,
    source: Any,
    out_dir: str | Path,
    meta_dir: str | Path,
    force: bool = False,
    progress: Progress | None = None,
) -> FileResult:
    """Write output file ``number`` (1-based) unless a complete, matching one is already there."""
    out_dir = Path(out_dir)
    pf = plan.file(number)
    digest = pf.digest()
    t0 = time.perf_counter()
    if not force and is_complete(out_dir, number, pf.filename, digest):
        if progress:
            progress(plan.source_files[pf.source_file])
        return FileResult(number, pf.filename, True, 0.0, pf.nbytes)
    records, data_start = write_tensors(
        out_dir / pf.filename, ARCH, file_kvs(plan, pf, meta_dir), pf.tensors, source, plan.cfg, progress
    )
    path = out_dir / pf.filename
    write_record(
        out_dir,
        {
            "format": "k3lab-manifest/1",
            "kind": "text",
            "file": pf.filename,
            "number": number,
            "basename": plan.basename,
            "outtype": plan.outtype,
            "split_count": len(plan.files),
            "split_tensors": plan.n_tensors,
            "size": path.stat().st_size,
            "plan_digest": digest,
            "data_start": data_start,
            "header_sha256": header_sha256(path, data_start),
            "tensors": records,
        },
    )
    return FileResult(number, pf.filename, False, time.perf_counter() - t0, pf.nbytes)
