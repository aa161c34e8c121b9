"""The stream engine and its memory model: how a transform's output reaches the writer in bounded
pieces, and how much a conversion holds at once. Nothing here knows a model: a model brings its
transforms (``Transform``: a pure function on arrays, its output shape from the source shapes alone,
and which stream it runs on), and the generic ones (copy, expert stacks, MXFP4 stacks) live here.

A transform names its ``stream``: how the converter walks its sources and hands the writer bounded
pieces, and so how much memory it holds at once (the planner's forecast):

  rows    one source, copied (or cast) a slab of rows at a time        (copy)
  each    many sources, one after another, each one piece              (float expert stacks)
  mxfp4   (packed, scale) pairs, each repacked into a rotating buffer  (MXFP4 expert stacks)
  whole   all sources read whole, the function applied once           (the small value transforms)

A stream reads through ``read(name, row_start, row_stop)`` and never sees a file: the pipeline's
reader decides where bytes come from (mapped pages of the shard, dropped with the piece).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from gguf import GGMLQuantizationType

from k3lab.errors import K3LabError
from k3lab.formats import mxfp4
from k3lab.formats.gguf_stream import PIECES_IN_FLIGHT
from k3lab.formats.numerics import SIZE, cast, cast_bytes, to_float32


class TransformError(K3LabError):
    """A source tensor does not have the shape a transform needs."""


Shape = tuple[int, ...]


COPY_CHUNK = 16 * 1024 * 1024  # bytes of rows per piece when copying or casting
# source pieces alive at once: the one a stream works on, and those the writer still hashes and writes
MAPPED_PIECES = PIECES_IN_FLIGHT + 1
PIECES_RING = PIECES_IN_FLIGHT + 1  # output buffers the mxfp4 stream rotates (see GGUFStream.write)


class SourceTensor(Protocol):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Read(Protocol):
    def __call__(self, name: str, row_start: int = 0, row_stop: int | None = None) -> np.ndarray:
        """Rows [row_start, row_stop) of a source tensor, in its holding dtype (read-only)."""

    def ahead(self, name: str, row_start: int = 0, row_stop: int | None = None) -> None:
        """A hint: those rows are read next (the reader may start reading them from disk now)."""


def _ahead(job: TensorJob, name: str, row_start: int = 0, row_stop: int | None = None) -> None:
    ahead = getattr(job.read, "ahead", None)  # (a reader of arrays in memory has no use for it)
    if ahead is not None:
        ahead(name, row_start, row_stop)


@dataclass(frozen=True)
class TensorJob:
    """One output tensor to produce: its sources, target type and shape, and how to read."""

    transform: Transform
    sources: Sequence[SourceTensor]
    target: GGMLQuantizationType
    shape: Shape
    nbytes: int
    cfg: Any  # the model's config, handed to the transform as it is
    read: Read | None = None  # None when only the memory forecast is asked for
    # where the writer would have the next piece made (it then reaches the disk without a copy)
    buffer: Callable[[int], np.ndarray] | None = None

    def pieces(self) -> Iterator[np.ndarray]:
        return self.transform.stream.pieces(self)

    def memory(self) -> int:
        """The most bytes this tensor holds at once: its pieces alive (being made, hashed and written)
        and what a cast or a transform allocates."""
        return self.transform.stream.memory(self)


@dataclass(frozen=True)
class Stream:
    name: str
    pieces: Callable[[TensorJob], Iterator[np.ndarray]]
    memory: Callable[[TensorJob], int]
    doc: str
    fixed: int = 0  # paid once per process that runs this stream (compiled code)
    load: Callable[[], None] | None = None  # starts loading that code in the background (a task's start)
    warm: Callable[[], None] | None = None  # asks for that code's files, loading nothing (a run's start)


def _slab_rows(src: SourceTensor) -> int:
    rows = src.shape[0] if src.shape else 1
    row_bytes = max(1, src.nbytes // max(rows, 1))
    return max(1, min(rows, COPY_CHUNK // row_bytes))


def _rows_pieces(job: TensorJob) -> Iterator[np.ndarray]:
    (src,) = job.sources
    assert job.read is not None
    rows = src.shape[0] if src.shape else 1
    step = _slab_rows(src)
    for r in range(0, rows, step):
        if r + step < rows:
            _ahead(job, src.name, r + step, min(rows, r + 2 * step))
        yield cast(job.read(src.name, r, min(rows, r + step)), src.dtype, job.target)


def _piece_memory(src_bytes: int, dtype: str, target: GGMLQuantizationType) -> int:
    """A source piece handed on as it is stays alive until hashed and written (MAPPED_PIECES at once);
    a cast one is dropped once cast, and its output (plus the float32 widening it went through) lives
    on instead."""
    extra = cast_bytes(src_bytes, dtype, target)
    if not extra:
        return MAPPED_PIECES * src_bytes
    out = src_bytes // SIZE[dtype] * {GGMLQuantizationType.F32: 4}.get(target, 2)
    return src_bytes + extra + PIECES_IN_FLIGHT * out


def _rows_memory(job: TensorJob) -> int:
    (src,) = job.sources
    rows = src.shape[0] if src.shape else 1
    slab = min(src.nbytes, _slab_rows(src) * max(1, src.nbytes // max(rows, 1)))
    return _piece_memory(slab, src.dtype, job.target)


def _each_pieces(job: TensorJob) -> Iterator[np.ndarray]:
    assert job.read is not None
    for i, src in enumerate(job.sources):
        if i + 1 < len(job.sources):
            _ahead(job, job.sources[i + 1].name)
        yield cast(job.read(src.name), src.dtype, job.target)


def _each_memory(job: TensorJob) -> int:
    return _piece_memory(max(s.nbytes for s in job.sources), job.sources[0].dtype, job.target)


def _mxfp4_pieces(job: TensorJob) -> Iterator[np.ndarray]:
    assert job.read is not None
    n_expert = len(job.sources) // 2
    piece_bytes = job.nbytes // n_expert  # one expert's repacked matrix
    bufs = [] if job.buffer else [np.empty(piece_bytes, dtype=np.uint8) for _ in range(PIECES_RING)]
    for e in range(n_expert):  # (packed, scale) per expert
        packed, scale = job.sources[2 * e], job.sources[2 * e + 1]
        for following in job.sources[2 * e + 2 : 2 * e + 4]:  # the next expert's, read while this one repacks
            _ahead(job, following.name)
        buf = job.buffer(piece_bytes) if job.buffer else bufs[e % len(bufs)]
        mxfp4.repack_into(job.read(packed.name), job.read(scale.name), buf, what=f"tensor {packed.name}")
        yield buf


def _mxfp4_memory(job: TensorJob) -> int:
    """One expert's (packed, scale) mapped while it is repacked, and the rotating output buffers."""
    n_expert = len(job.sources) // 2
    return job.sources[0].nbytes + job.sources[1].nbytes + PIECES_RING * job.nbytes // n_expert


def _whole_pieces(job: TensorJob) -> Iterator[np.ndarray]:
    assert job.read is not None
    arrays = [job.read(s.name) for s in job.sources]
    t = job.transform
    if t.on_values:
        out = t.fn(*(to_float32(a, s.dtype) for a, s in zip(arrays, job.sources)), cfg=job.cfg)
        yield cast(out, "F32", job.target)
    else:
        yield cast(t.fn(*arrays, cfg=job.cfg), job.sources[0].dtype, job.target)


def _whole_memory(job: TensorJob) -> int:
    held = sum(s.nbytes for s in job.sources)
    if job.transform.on_values:
        held += sum(4 * s.nbytes // SIZE.get(s.dtype, 4) for s in job.sources) + 4 * job.nbytes
    return held + PIECES_IN_FLIGHT * job.nbytes


STREAMS = {
    s.name: s
    for s in (
        Stream("rows", _rows_pieces, _rows_memory, "a slab of rows at a time"),
        Stream("each", _each_pieces, _each_memory, "one source after another"),
        # numba and its compiled repack kernel: 63 MiB measured on x86-64 (`benchmarks/run.py fullscale`)
        Stream(
            "mxfp4",
            _mxfp4_pieces,
            _mxfp4_memory,
            "one expert repacked at a time",
            fixed=63 << 20,
            load=mxfp4.load_kernel,
            warm=mxfp4.warm_kernel,
        ),  # fmt: skip
        Stream("whole", _whole_pieces, _whole_memory, "all sources read whole, transformed once"),
    )
}


def load_streams(transforms: Iterable[Transform], warm: bool = False) -> None:
    """Start what the transforms' streams load before their first piece (numba's MXFP4 kernel), each
    on a thread of its own, once per process; ``warm``: only ask for its files (``Stream.warm``)."""
    for stream in {t.stream.name: t.stream for t in transforms}.values():
        if (start := stream.warm if warm else stream.load) is not None:
            start()


@dataclass(frozen=True)
class Transform:
    name: str
    fn: Callable[..., np.ndarray]
    shape: Callable[..., Shape]
    doc: str
    on_values: bool = False  # computes on float32 values; otherwise it only moves bytes (any dtype)
    inverse: Callable[..., np.ndarray] | None = None  # output (and config) -> the source array(s)
    stream_name: str = "whole"

    @property
    def stream(self) -> Stream:
        return STREAMS[self.stream_name]


def job_memory(jobs: Sequence[Any]) -> int:
    """Bytes a conversion holds at once for a file of these tensor jobs (one tensor at a time, so the
    largest), plus compiled code its streams load."""
    if not jobs:
        return 0
    return max(j.transform.stream.fixed for j in jobs) + max(j.memory() for j in jobs)


def copy(x: np.ndarray, cfg: Any = None) -> np.ndarray:
    return x


def same_shape(*shapes: Shape, cfg: Any = None) -> Shape:
    return shapes[0]


def stack(*experts: np.ndarray, cfg: Any = None) -> np.ndarray:
    """Per-expert [rows, cols] matrices -> one [n_expert, rows, cols] tensor (float checkpoints)."""
    return np.stack(experts)


def _stack_shape(*shapes: Shape, cfg: Any = None) -> Shape:
    if len(set(shapes)) != 1:
        raise TransformError(f"experts differ in shape: {sorted(set(shapes))[:2]}")
    return (len(shapes), *shapes[0])


def _mxfp4_stack_shape(*shapes: Shape, cfg: Any = None) -> Shape:
    """(packed [rows, cols/2], scale [rows, cols/32]) per expert -> values [n_expert, rows, cols]."""
    packed, scales = set(shapes[0::2]), set(shapes[1::2])
    if len(packed) != 1 or len(scales) != 1:
        raise TransformError(f"experts differ in shape: {sorted(packed | scales)[:2]}")
    (p,), (sc,) = packed, scales
    if len(p) != 2 or len(sc) != 2 or p[0] != sc[0] or 2 * p[1] != mxfp4.QK * sc[1]:
        raise TransformError(f"weight_packed {list(p)} and weight_scale {list(sc)} do not pair as MXFP4")
    return (len(shapes) // 2, p[0], 2 * p[1])


# the transforms every model may use, by name
GENERIC: dict[str, Transform] = {
    t.name: t
    for t in [
        Transform("copy", copy, same_shape, "bytes copied as they are", inverse=copy, stream_name="rows"),
        Transform("stack", stack, _stack_shape, "experts stacked on a new outer axis", stream_name="each"),
        Transform(
            "mxfp4_stack",
            stack,
            _mxfp4_stack_shape,
            "experts stacked; compressed-tensors nibbles permuted into ggml block_mxfp4, scales copied",
            stream_name="mxfp4",
        ),
    ]
}
