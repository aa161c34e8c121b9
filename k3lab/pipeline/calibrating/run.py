"""``k3lab imatrix``: the importance matrix of a finished set, a step at a time.

The plan: the set's files (each proven finished, its content digest recorded), the calibration text
(its SHA-256), the chunks (tokenised once by llama.cpp's tokenizer), the options, and the model's
steps (the embedding, each layer, the head when ``--process-output``). Then one step after another,
each holding only its own weights (read from the set's file where their records say, every byte
checked) and one chunk's state at a time: the step's graph of ggml operations, llama.cpp's graph for
that step, computed chunk by chunk; every product's input summed as llama-imatrix sums it
(``sums``); the step's arrays (the residual stream, the AttnRes checkpoints) written for the next
step. A step is resumable as a unit (``state.calibration``), a stop between chunks leaves nothing
half written. Last, every step's sums (and any ``--in-file``) into one imatrix file, llama-imatrix's
GGUF (or ``.dat``), written atomically.

How llama-imatrix batches is kept, where it shows in the numbers (``batches``): a chunk's tokens
come in llama.cpp's ubatch slices, attention computed a slice at a time as there (ggml's flash
attention picks its kernel by the number of queries), and every product's input summed in the order
llama-imatrix adds it.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats import imatrix as imatrix_format
from k3lab.formats.ggml import TYPE_IDS
from k3lab.formats.ggml_compute import Arena, Graph, WeightInfo, Weights
from k3lab.pipeline.calibrating.batches import BatchProducts
from k3lab.pipeline.calibrating.sums import Entry, Sums
from k3lab.pipeline.calibrating.text import CalibrationText, read_text
from k3lab.pipeline.calibrating.tokens import chunks as cut_chunks
from k3lab.pipeline.calibrating.tokens import tokenize
from k3lab.pipeline.model import CalibrationStep, Model
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.calibration import CalibrationState
from k3lab.pipeline.state.records import content_digest

PLAN_FORMAT = "k3lab-imatrix-plan/2"  # raised whenever the same inputs would give other sums
MIN_CHUNK, DEFAULT_CHUNK = 1, 512


@dataclass(frozen=True)
class ImatrixOptions:
    """What a user asks for (``llama-imatrix``'s options where it has them)."""

    calibration: str
    chunk_size: int = DEFAULT_CHUNK
    chunks: int | None = None
    out: str | None = None  # default: SET/imatrix.gguf (or .dat)
    process_output: bool = False
    in_files: tuple[str, ...] = ()
    output_format: str = "gguf"
    parse_special: bool = False
    threads: int | None = None


@dataclass
class ImatrixResult:
    path: Path
    steps_done: int
    steps_skipped: int
    chunks: int
    chunk_size: int
    seconds: float
    entries: dict[str, Entry] = field(default_factory=dict)
    text: CalibrationText | None = None


class Reader:
    """The set's finished files, read where their records put each tensor, every tensor's bytes
    checked against its record's SHA-256."""

    def __init__(self, folder: OutputFolder, numbers: list[int]):
        import os

        from k3lab.formats.files import open_regular

        self.where: dict[str, tuple[int, Path, Any]] = {}
        self._fds: list[int] = []
        for k in numbers:
            rec = folder.records.text(k)
            assert rec is not None
            path = folder.output(rec.file)
            fd, size = open_regular(path, "GGUF file")
            self._fds.append(fd)
            if size != rec.size:
                os.close(fd)
                raise K3LabError(f"{path}: {size} bytes, its record says {rec.size} (changed since?)")
            for t in rec.tensors:
                self.where[t.name] = (fd, path, t)
        self._os = os

    def read(
        self, name: str, into: np.ndarray | None = None, offset: int = 0, n: int | None = None
    ) -> np.ndarray:
        fd, path, t = self.where[name]
        n = t.nbytes if n is None else n
        buf = into if into is not None else np.empty(n, dtype=np.uint8)
        got = self._os.preadv(fd, [memoryview(buf)[:n]], t.offset + offset)
        if got != n:
            raise K3LabError(
                f"{path}: tensor {name}: the file ends inside it (cut short since it was written?)"
            )
        if offset == 0 and n == t.nbytes and hashlib.sha256(buf[:n]).hexdigest() != t.sha256:
            raise K3LabError(
                f"{path}: tensor {name}: its bytes are not the ones its record hashed (changed since?)"
            )
        return buf[:n]

    def close(self) -> None:
        for fd in self._fds:
            self._os.close(fd)


def _rows(reader: Reader, name: str, tokens: np.ndarray) -> np.ndarray:
    """The tokens' rows of a matrix, widened to float32 as ggml_get_rows widens them."""
    from k3lab.formats.ggml import ggml

    _, _, t = reader.where[name]
    n_rows = math.prod(t.ne[1:])
    row_bytes = t.nbytes // n_rows
    out = np.empty((len(tokens), t.ne[0]), np.float32)
    if np.any((tokens < 0) | (tokens >= n_rows)):
        raise K3LabError(
            f"tensor {name}: a token id outside its {n_rows} rows (a vocabulary of another set?)"
        )
    lib = ggml()
    for j, tok in enumerate(tokens):
        raw = reader.read(name, offset=int(tok) * row_bytes, n=row_bytes)
        lib.to_float(TYPE_IDS[t.type], raw, out[j])
    return out


def _threads(n: int | None) -> int:
    import os

    if n is not None:
        return max(1, n)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_step(
    model: Model,
    kvs: dict[str, Any],
    step: CalibrationStep,
    reader: Reader,
    inputs: Callable[[int, str], np.ndarray],
    outputs: Callable[[str, np.ndarray], None],
    chunk_tokens: np.ndarray,
    sums: Sums,
    threads: int,
    check: Callable[[], None] = lambda: None,
) -> None:
    """One step over every chunk: its weights loaded once; per chunk its graph built (measured, then
    for real), computed by ggml, each product's input summed, its arrays handed to ``outputs``."""
    n_chunks, n_ctx = chunk_tokens.shape
    if step.rows:  # the embedding: the tokens' rows, no graph
        for c in range(n_chunks):
            check()
            outputs("x", _rows(reader, step.rows, chunk_tokens[c]))
        return
    names = [n for n in reader.where if step.owns(n)]
    infos = [WeightInfo(n, TYPE_IDS[reader.where[n][2].type], tuple(reader.where[n][2].ne)) for n in names]
    assert model.calibration is not None
    heard = BatchProducts(sums, n_chunks, n_ctx)
    arena = Arena()  # (one chunk's graph after another in the same memory)
    with Weights(infos, lambda info, into: reader.read(info.name, into)) as w:
        for c in range(n_chunks):
            check()
            state = {name: inputs(c, name) for name in step.reads}
            cuts = heard.chunk(c)
            slices = [(a, b) for a, b, _ in cuts]

            def build(
                g: Graph, state: dict[str, np.ndarray] = state, slices: list = slices
            ) -> dict[str, Any]:
                inputs = {k: g.input(v) for k, v in state.items()}
                return model.calibration.build(kvs, step, g, w, inputs, slices)  # type: ignore[union-attr]

            with Graph(measure=True) as m:
                build(m)
                needed = m.needed
            with Graph(needed + (4 << 20), threads, arena=arena) as g:
                outs = build(g)
                g.expand(*outs.values())
                g.compute()
                by_slice: dict[str, int] = {}  # (a product made a slice at a time: which slice is next)
                for weight, x, ids in g.products:
                    name = w.name_of(weight)
                    if name is None:
                        continue
                    if ids is not None:
                        heard.experts(name, x.read(3), ids.read(2), w.infos[name].ne[2])
                        continue
                    value = x.read(3 if len(w.infos[name].ne) > 2 else 2)
                    if value.shape[-2] != n_ctx:  # (made per stream: its rows are this chunk's slice alone)
                        i = by_slice[name] = by_slice.get(name, -1) + 1
                        heard.dense(name, value, i % len(cuts))
                    else:
                        heard.dense(name, value)
                for name in step.writes:
                    value = state[name] if name in state and name not in outs else outs[name].read(2)
                    outputs(name, value)
        heard.flush()


# --- the whole run --------------------------------------------------------------------------------


def plan_imatrix(
    model: Model, folder: OutputFolder, options: ImatrixOptions
) -> tuple[dict[str, Any], CalibrationText, dict[str, Any], Sums]:
    """(the run's plan, the text, file 1's metadata, the ``--in-file`` sums it begins from): every
    check before any work."""
    if model.calibration is None:
        raise K3LabError(f"{model.name}: k3lab has no forward of this model to compute an imatrix with")
    plan = folder.plans.require(model)
    missing = [f.number for f in plan.files if not folder.records.is_complete(f.number, f.filename, f.digest)]
    if missing:
        raise K3LabError(
            f"{folder.output(plan.file(missing[0]).filename)}: not a finished file of the set ({len(missing)} of "
            f"{len(plan.files)} are not): the imatrix runs on the converted set; convert it first"
        )
    kvs = {kv.key: kv.value for kv in folder.plans.kvs(plan)}
    context = kvs.get(f"{model.name}.context_length")
    if not MIN_CHUNK <= options.chunk_size or (isinstance(context, int) and options.chunk_size > context):
        raise K3LabError(
            f"--chunk-size {options.chunk_size}: chunks of 1 to {context} tokens (the model's context)"
        )
    if options.chunks is not None and options.chunks < 1:
        raise K3LabError(f"--chunks {options.chunks}: at least one chunk")
    text = read_text(options.calibration)
    first = folder.output(plan.file(1).filename)
    tokens, bos = tokenize(first, text.data, options.parse_special)
    chunked = cut_chunks(tokens, options.chunk_size, options.chunks, bos, f"--calibration {text.source}")
    steps = [s for s in model.calibration.steps(kvs) if s.writes or options.process_output]
    begun = Sums()
    for location in options.in_files:  # (added in the order given, as llama-imatrix loads them)
        loaded = _read_in_file(location)
        begun.add(loaded)
        begun.datasets += loaded.datasets
    from k3lab.formats.ggml import ggml

    body = {
        "format": PLAN_FORMAT,
        "model": model.name,
        "set": plan.inputs_digest,
        "files": {f.filename: content_digest(folder.records.text(f.number)) for f in plan.files},  # type: ignore[arg-type]
        "text": {"sha256": text.sha256, "source": text.source, "dataset": text.dataset},
        "parse_special": options.parse_special,
        "chunk_size": options.chunk_size,
        "tokens": chunked.reshape(-1).tolist(),
        "process_output": options.process_output,
        "steps": [s.name for s in steps],
        "ggml": ggml().version,
        "begun_from": _sums_digest(begun),
    }
    body["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return body, text, kvs, begun


def _sums_digest(sums: Sums) -> str:
    """The SHA-256 of entries' names, sums and counts (what a run begins from)."""
    h = hashlib.sha256()
    for name in sorted(sums.entries):
        e = sums.entries[name]
        h.update(name.encode() + b"\0" + e.values.astype("<f4").tobytes() + e.counts.astype("<i8").tobytes())
    return h.hexdigest()


def compute_imatrix(
    model: Model, set_dir: str | Path, options: ImatrixOptions, say: Callable[[str], None] | None = None
) -> ImatrixResult:
    """The imatrix of the finished set in ``set_dir`` (see the module's docstring)."""
    t0 = time.perf_counter()
    folder = OutputFolder(set_dir)
    body, text, kvs, begun = plan_imatrix(model, folder, options)
    out = Path(options.out) if options.out else Path(set_dir) / f"imatrix.{options.output_format}"
    assert model.calibration is not None
    steps = [s for s in model.calibration.steps(kvs) if s.name in body["steps"]]
    n_ctx = options.chunk_size
    tokens = np.asarray(body["tokens"], dtype=np.int32).reshape(-1, n_ctx)
    n_chunks = tokens.shape[0]
    threads = _threads(options.threads)
    state = CalibrationState(folder.state)
    done = skipped = 0
    with folder.hold():
        saved = state.plan()
        if saved is None or saved.get("digest") != body["digest"]:
            state.clear()
            state.save_plan(body)
        plan = folder.plans.require(model)
        reader = Reader(folder, [f.number for f in plan.files])
        widths: dict[str, int] = {}
        written: dict[str, str] = {}  # array -> its file (the latest step's)
        try:
            # (every sum begins from the --in-file's, as llama-imatrix adds on top of what it loaded)
            total = Sums(options.process_output, entries=dict(begun.entries))
            for k, step in enumerate(steps):
                rec = _finished(state, k, step)
                if rec is not None:
                    skipped += 1
                    written.update(rec["arrays"])
                    widths.update(rec["widths"])
                    total.entries.update(_entries_of(state, k).entries)
                    continue
                if say is not None:
                    say(f"imatrix: {step.name} ({n_chunks} chunks of {n_ctx})")
                sums = Sums(options.process_output, start=begun.entries)
                writers = {name: state.writer(f"{name}.{k:03d}.f32") for name in step.writes}
                try:
                    run_step(
                        model, kvs, step, reader,
                        lambda c, name: state.chunk(written[name], c, (n_ctx, widths[name])),
                        lambda name, value, writers=writers: (writers[name].write(value), widths.__setitem__(name, value.shape[-1])),
                        tokens, sums, threads,
                    )  # fmt: skip
                except BaseException:
                    for wr in writers.values():
                        wr.abandon()
                    raise
                arrays = {}
                for name, wr in writers.items():
                    sha = wr.finish()
                    file = f"{name}.{k:03d}.f32"
                    arrays[name] = {"file": file, "sha256": sha, "identity": state.identity(file)}
                entries_name = f"step-{k:03d}.gguf"
                _write_entries(state.path(entries_name), sums, text, body, n_chunks)
                state.write_record(
                    f"step-{k:03d}.json",
                    {"step": step.name, "arrays": {n: a["file"] for n, a in arrays.items()}, "proof": arrays,
                     "widths": {n: widths[n] for n in step.writes}, "entries": entries_name},
                )  # fmt: skip
                for name in step.writes:  # (an array the new one replaces is not read again)
                    if name in written:
                        state.remove(written[name])
                written.update({n: a["file"] for n, a in arrays.items()})
                total.entries.update(sums.entries)
                done += 1
        finally:
            reader.close()
        datasets = [*begun.datasets, text.dataset]
        _write_final(out, total, datasets, n_chunks, n_ctx, options.output_format, text, body)
        state.clear(keep=("plan.json",))
    return ImatrixResult(out, done, skipped, n_chunks, n_ctx, time.perf_counter() - t0, total.entries, text)


def _finished(state: CalibrationState, k: int, step: CalibrationStep) -> dict[str, Any] | None:
    """Step ``k``'s record, when it and every file it names are proven."""
    rec = state.record(f"step-{k:03d}.json")
    if rec is None or rec.get("step") != step.name:
        return None
    try:
        for a in rec["proof"].values():
            if not state.proven(a["file"], a["sha256"], a["identity"]):
                return None
        _entries_of(state, k)
    except (K3LabError, KeyError, TypeError, ValueError, OSError):
        return None
    return rec


def _entries_of(state: CalibrationState, k: int) -> Sums:
    return entries_from_file(state.path(f"step-{k:03d}.gguf"))


def entries_from_file(path: Path | str) -> Sums:
    """An imatrix file's entries as raw sums and counts (a GGUF's as they are; a legacy ``.dat``'s as
    llama-imatrix's ``--in-file`` takes them back: times the chunk size)."""
    from k3lab.formats.files import open_regular
    from k3lab.pipeline.quantizing.imatrix_files import _pread

    fd, size = open_regular(Path(path), "imatrix")
    try:
        read = _pread(fd, Path(path))
        index = imatrix_format.read_index(read, size, str(path))
        out = Sums()
        for name, e in index.entries.items():
            values = np.frombuffer(read(*e.sums), dtype="<f4").astype(np.float32).reshape(e.m, e.n)
            if e.counts is not None:
                counts = np.frombuffer(read(*e.counts), dtype="<f4").astype(np.float64)
                counts = np.sign(counts) * np.floor(np.abs(counts) + 0.5)
            else:  # legacy: (sum / count) * ncall per value; back by the chunk size, as llama-imatrix does
                size_ = max(1, index.chunk_size or 1)
                values, counts = values * np.float32(size_), np.full(1, e.ncall * size_, dtype=np.float64)
            out.entries[name] = Entry(values, counts.astype(np.int64))
        out.datasets, out.chunk_count = list(index.datasets), index.chunk_count
        return out
    finally:
        import os

        os.close(fd)


def _read_in_file(location: str) -> Sums:
    try:
        return entries_from_file(location)
    except OSError as e:
        raise K3LabError(f"--in-file {location}: cannot be read ({e.strerror or e})") from None


def _kvs(
    datasets: list[str], chunk_count: int, chunk_size: int, text: CalibrationText, body: dict[str, Any]
) -> list[Any]:
    """llama-imatrix's keys, then k3lab's: where the text came from, its SHA-256, the set."""
    from gguf import GGUFValueType

    from k3lab.formats.gguf_stream import KV

    return imatrix_format.gguf_kvs(
        datasets, chunk_count, chunk_size,
        [KV("k3lab.calibration.sha256", text.sha256, GGUFValueType.STRING),
         KV("k3lab.calibration.source", text.source, GGUFValueType.STRING),
         KV("k3lab.set", body["set"], GGUFValueType.STRING)],
    )  # fmt: skip


def _write_entries(
    path: Path, sums: Sums, text: CalibrationText, body: dict[str, Any], n_chunks: int
) -> None:
    entries = {n: imatrix_format.Sums(e.values, e.counts.astype(np.float32)) for n, e in sums.entries.items()}
    imatrix_format.write_gguf(path, entries, _kvs([text.dataset], n_chunks, body["chunk_size"], text, body))


def _write_final(out: Path, total: Sums, datasets: list[str], n_chunks: int, n_ctx: int, fmt: str,
                 text: CalibrationText, body: dict[str, Any]) -> None:  # fmt: skip
    """The imatrix file: llama-imatrix's chunk count (its largest count, in chunks), its format."""
    largest = max((int(e.counts.max()) for e in total.entries.values() if e.counts.size), default=0)
    chunk_count = largest // n_ctx
    entries = {
        n: imatrix_format.Sums(e.values, e.counts.astype(np.float32)) for n, e in total.entries.items()
    }
    if fmt == "dat":
        from k3lab.pipeline.state.codec import write_atomically

        data = imatrix_format.legacy_bytes(entries, chunk_count, n_ctx, datasets[-1])
        write_atomically(out, lambda fh: fh.write(data))
        return
    imatrix_format.write_gguf(out, entries, _kvs(datasets, chunk_count, n_ctx, text, body))


def _say(line: str) -> None:
    print(f"k3lab: {line}", file=sys.stderr, flush=True)
