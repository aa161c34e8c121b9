"""``k3lab imatrix``: the importance matrix of a finished set, a step at a time.

The plan: the set (local, or on the Hub: ``sets``), its files' content digests, the calibration text
(its SHA-256), the chunks (tokenised once by llama.cpp's tokenizer), the options, the ``--in-file``
sums it begins from, and the model's steps (the embedding, each layer, the head when
``--process-output``). Then the steps in waves (``waves``): each step holding only its own weights
(read where the set's records put them, every byte checked) and one chunk's state at a time, its
graph llama.cpp's for that step (``step``); in this process one step per wave, on Dask one per
worker at once (``cluster``). Every product's input is summed as llama-imatrix sums it, in its order
(``sums``, ``batches``); the arrays a step writes (the residual stream, the AttnRes checkpoints) go
to the state folder for the steps after it. A step is resumable as a unit (``state.calibration``): a
run resumes after the last step whose sums and whose arrays still read are proven; a stop leaves
nothing half written. Last, every step's sums into one imatrix file, llama-imatrix's GGUF (or
``.dat``), written atomically."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.pipeline.calibrating.batches import BATCH
from k3lab.pipeline.calibrating.output import (
    entries_from_file,
    file_sha,
    read_in_file,
    record_beside,
    write_entries,
    write_final,
)
from k3lab.pipeline.calibrating.sets import CalibrationSet
from k3lab.pipeline.calibrating.step import StepRun
from k3lab.pipeline.calibrating.sums import Entry, Sums
from k3lab.pipeline.calibrating.text import CalibrationText, read_text
from k3lab.pipeline.calibrating.tokens import chunks as cut_chunks
from k3lab.pipeline.calibrating.tokens import tokenize
from k3lab.pipeline.calibrating.waves import Array, Stage, StepDone, run_wave
from k3lab.pipeline.model import CalibrationStep, Model
from k3lab.pipeline.quantizing.quantize import threads as cores
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.calibration import CalibrationState

PLAN_FORMAT = "k3lab-imatrix-plan/2"  # raised whenever the same inputs would give other sums
MIN_CHUNK, DEFAULT_CHUNK = 1, 512
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: the sequences a context holds


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


# --- the whole run --------------------------------------------------------------------------------


def plan_imatrix(
    model: Model, calib_set: CalibrationSet, options: ImatrixOptions
) -> tuple[dict[str, Any], CalibrationText, Sums]:
    """(the run's plan, the text, the ``--in-file`` sums it begins from): every check before any work."""
    if model.calibration is None:
        raise K3LabError(f"{model.name}: k3lab has no forward of this model to compute an imatrix with")
    kvs = calib_set.kvs
    context = kvs.get(f"{model.name}.context_length")
    if not MIN_CHUNK <= options.chunk_size or (isinstance(context, int) and options.chunk_size > context):
        raise K3LabError(
            f"--chunk-size {options.chunk_size}: chunks of 1 to {context} tokens (the model's context)"
        )
    if BATCH // options.chunk_size > MAX_SEQ:
        raise K3LabError(
            f"--chunk-size {options.chunk_size}: llama-imatrix runs {BATCH // options.chunk_size} chunks side by "
            f"side in its batch of {BATCH}, and llama.cpp takes at most {MAX_SEQ} (it refuses to start): at least "
            f"{-(-BATCH // MAX_SEQ)} tokens"
        )
    if options.chunks is not None and options.chunks < 1:
        raise K3LabError(f"--chunks {options.chunks}: at least one chunk")
    text = read_text(options.calibration)
    tokens, bos = tokenize(calib_set.vocab, text.data, options.parse_special)
    chunked = cut_chunks(tokens, options.chunk_size, options.chunks, bos, f"--calibration {text.source}")
    steps = [s for s in model.calibration.steps(kvs) if s.writes or options.process_output]
    begun = Sums()
    for location in options.in_files:  # (added in the order given, as llama-imatrix loads them)
        loaded = read_in_file(location)
        begun.add(loaded)
        begun.datasets += loaded.datasets
    from k3lab.formats.ggml import ggml

    body = {
        "format": PLAN_FORMAT,
        "model": model.name,
        "set": calib_set.digest,
        "files": calib_set.files,
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
    return body, text, begun


def _sums_digest(sums: Sums) -> str:
    """The SHA-256 of entries' names, sums and counts (what a run begins from)."""
    h = hashlib.sha256()
    for name in sorted(sums.entries):
        e = sums.entries[name]
        h.update(name.encode() + b"\0" + e.values.astype("<f4").tobytes() + e.counts.astype("<i8").tobytes())
    return h.hexdigest()


def compute_imatrix(
    model: Model,
    calib_set: CalibrationSet,
    folder: OutputFolder,
    options: ImatrixOptions,
    say: Callable[[str], None] | None = None,
    stages: Callable[..., Any] | None = None,
) -> ImatrixResult:
    """The imatrix of ``calib_set``, its state in ``folder`` (see the module's docstring).
    ``stages``: where steps run (``cluster.DaskStages``: a wave on every Dask worker; default: one
    step at a time in this process)."""
    t0 = time.perf_counter()
    body, text, begun = plan_imatrix(model, calib_set, options)
    out = Path(options.out) if options.out else folder.path / f"imatrix.{options.output_format}"
    assert model.calibration is not None
    kvs = calib_set.kvs
    steps = [s for s in model.calibration.steps(kvs) if s.name in body["steps"]]
    n_ctx = options.chunk_size
    tokens = np.asarray(body["tokens"], dtype=np.int32).reshape(-1, n_ctx)
    n_chunks = tokens.shape[0]
    threads = cores(options.threads).n
    state = CalibrationState(folder.state)
    halt = threading.Event()
    with folder.hold():
        made = _already_made(state, body, out)
        if made is not None:
            return ImatrixResult(
                out, 0, len(steps), n_chunks, n_ctx, time.perf_counter() - t0, made.entries, text
            )
        saved = state.plan()
        if saved is None or saved.get("digest") != body["digest"]:
            state.clear()
            state.save_plan(body)
        start, arrays, entries = _resume_point(state, steps)
        skipped = start
        total = Sums(options.process_output, entries=dict(begun.entries))
        for k in range(start):
            total.entries.update(entries[k].entries)

        def step_done(k: int, step: CalibrationStep, got: StepDone) -> None:
            proof = None  # (a step that sums nothing, the embedding's: no file)
            if got.sums.entries:
                name = f"step-{k:03d}.gguf"
                write_entries(state.path(name), got.sums, text, body, n_chunks)
                proof = {
                    "file": name,
                    "sha256": file_sha(state.path(name)),
                    "identity": state.identity(name),
                }
            state.write_record(
                f"step-{k:03d}.json",
                {"step": step.name, "arrays": got.arrays, "widths": got.widths, "entries": proof},
            )
            total.entries.update(got.sums.entries)

        if stages is None:
            reader = calib_set.open([n for s in steps[start:] for n in calib_set.tensors if s.owns(n)])
            width, open_stage = (
                1,
                _local_stages(model, kvs, calib_set, reader, n_chunks, n_ctx, options, begun, threads),
            )
        else:
            reader = None
            width, open_stage = stages(model, kvs, calib_set, n_chunks, n_ctx, options, begun)
        try:
            for w in range(start, len(steps), width):
                wave = list(enumerate(steps))[w : w + width]
                if say is not None:
                    names = wave[0][1].name + (f" .. {wave[-1][1].name}" if len(wave) > 1 else "")
                    where = f" on {len(wave)} workers at once" if len(wave) > 1 else ""
                    say(f"imatrix: {names} ({n_chunks} chunks of {n_ctx}){where}")
                run_wave(wave, open_stage, arrays, state, tokens, halt, step_done)
                _retire(state, steps, w + len(wave))
        finally:
            if reader is not None:
                reader.close()
        datasets = [*begun.datasets, text.dataset]
        write_final(out, total, datasets, n_chunks, n_ctx, options.output_format, text, body)
        if calib_set.is_folder(folder) and out.parent == folder.path and options.output_format == "gguf":
            record_beside(folder, out)
        state.clear(keep=("plan.json",))
        state.write_record(
            "done.json", {"digest": body["digest"], "out": str(out.resolve()), "sha256": file_sha(out)}
        )
    done = len(steps) - skipped
    return ImatrixResult(out, done, skipped, n_chunks, n_ctx, time.perf_counter() - t0, total.entries, text)


def compute_until_covered(
    model: Model,
    calib_set: CalibrationSet,
    folder: OutputFolder,
    opts: ImatrixOptions,
    say: Callable[[str], None] | None = None,
    stages: Callable[..., Any] | None = None,
) -> ImatrixResult:
    """``--until-covered``: the imatrix of ``--chunks`` chunks (8 by default), then of twice as many,
    and so on, until every expert of every stack is reached or the text has no more chunks: the
    imatrix of the fewest chunks (doubling) that cover them, exactly llama-imatrix's of that many."""
    import dataclasses

    from k3lab.pipeline.calibrating.coverage import coverage

    chunks = opts.chunks or 8
    while True:
        result = compute_imatrix(
            model, calib_set, folder, dataclasses.replace(opts, chunks=chunks), say, stages
        )
        got, total = coverage(result.entries).reached()
        if got == total or result.chunks < chunks:  # (covered, or the text has no more)
            if got < total and say is not None:
                say(
                    f"imatrix: the text ends at {result.chunks} chunks with {total - got} of {total} experts never reached"
                )
            return result
        if say is not None:
            say(f"imatrix: {chunks} chunks reach {got} of {total} experts: {2 * chunks} next")
        chunks *= 2


def _local_stages(model: Model, kvs: dict[str, Any], calib_set: CalibrationSet, reader: Any, n_chunks: int,
                  n_ctx: int, options: ImatrixOptions, begun: Sums, threads: int) -> Callable[..., Stage]:  # fmt: skip
    """Each step in this process, in turn, reading the set with one reader."""

    def open_stage(k: int, step: CalibrationStep) -> Stage:
        sums = Sums(options.process_output, start=begun.entries)
        return StepRun(model, kvs, step, calib_set.tensors, reader, n_chunks, n_ctx, sums, threads)

    return open_stage


def _already_made(state: CalibrationState, body: dict[str, Any], out: Path) -> Sums | None:
    """The imatrix this plan made, when the run that made it finished and the file is still its bytes."""
    done = state.record("done.json")
    try:
        if done is None or done.get("digest") != body["digest"] or done.get("out") != str(out.resolve()):
            return None
        if file_sha(out) != done["sha256"]:
            return None
        return entries_from_file(out)
    except (K3LabError, OSError, KeyError, TypeError):
        return None


def _resume_point(
    state: CalibrationState, steps: list[CalibrationStep]
) -> tuple[int, dict[str, Array], dict[int, Sums]]:
    """Where a run resumes: after the last step k such that steps 0..k are recorded with their sums
    proven, and the arrays later steps read (each name's latest, as of step k) are proven; with those
    arrays and the steps' sums. A state proving nothing: step 0."""
    entries: dict[int, Sums] = {}
    latest: dict[str, tuple[dict[str, Any], int]] = {}
    best: tuple[int, dict[str, Array]] = (0, {})
    for k, step in enumerate(steps):
        rec = state.record(f"step-{k:03d}.json")
        try:
            if rec is None or rec.get("step") != step.name:
                break
            e = rec["entries"]
            if e is not None and not state.proven(e["file"], e["sha256"], e["identity"]):
                break
            entries[k] = entries_from_file(state.path(e["file"])) if e is not None else Sums()
            for name, a in rec["arrays"].items():
                latest[name] = (a, int(rec["widths"][name]))
        except (K3LabError, KeyError, TypeError, ValueError, OSError):
            break
        needed = {n for s in steps[k + 1 :] for n in s.reads}
        try:
            if all(
                state.proven(a["file"], a["sha256"], a["identity"])
                for n, (a, _) in latest.items()
                if n in needed
            ):
                best = (
                    k + 1,
                    {n: Array(state.path(a["file"]), w, finished=True) for n, (a, w) in latest.items()},
                )
        except (K3LabError, KeyError, TypeError, ValueError, OSError):
            continue
    return best[0], best[1], entries


def _retire(state: CalibrationState, steps: list[CalibrationStep], upto: int) -> None:
    """The arrays of steps before ``upto`` that no later step reads (an older ``x``), removed."""
    latest: dict[str, int] = {}
    for k, step in enumerate(steps[:upto]):
        for name in step.writes:
            latest[name] = k
    for k, step in enumerate(steps[:upto]):
        for name in step.writes:
            if latest[name] != k:
                state.remove(f"{name}.{k:03d}.f32")


def _say(line: str) -> None:
    print(f"k3lab: {line}", file=sys.stderr, flush=True)
