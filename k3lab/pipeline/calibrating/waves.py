"""Steps run as a pipeline: a *wave* of consecutive steps, each on a stage of its own (a ``StepRun`` in
this process, or one held by a Dask worker: ``cluster``), the chunks flowing through them in order.
Stage k runs chunk c as soon as the arrays it reads for c are written: by a step of an earlier wave
(a finished file of the state) or by a stage before it in this wave (the file it is writing, read as
far as it has got). So with W stages, W steps compute at once, each on its own weights.

The arrays a stage writes go to the state folder chunk after chunk (``ArrayWriter``); when a stage
has run every chunk, its step's sums and record are written: a wave stopped part way keeps the steps
it finished. A failure or a stop (``halt``) ends every stage after its chunk at hand; nothing is
written after that, and the arrays of steps not finished are removed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.files import open_regular, partial_path
from k3lab.pipeline.calibrating.sums import Sums
from k3lab.pipeline.model import CalibrationStep
from k3lab.pipeline.state.calibration import ArrayWriter, CalibrationState

WAIT = 0.2  # seconds between looks at a stop while waiting for a chunk


class Stage(Protocol):
    """One step held somewhere, run chunk after chunk."""

    def run(self, c: int, tokens: np.ndarray, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def finish(self) -> Sums: ...

    def close(self) -> None: ...


class Stopped(K3LabError):
    """The run was stopped (or another stage failed) while this stage waited or ran."""


@dataclass
class Array:
    """One array's chunks: a finished file, or one a stage of this wave is writing."""

    path: Path
    width: int
    written: int = 0  # chunks written so far (all of them, for a finished file)
    finished: bool = False
    failed: bool = False
    lock: threading.Condition = field(default_factory=threading.Condition)

    def chunk(self, c: int, n_ctx: int, stopped: Callable[[], bool]) -> np.ndarray:
        """Chunk ``c``, once written (waiting for the stage writing it; ``stopped``: give up)."""
        with self.lock:
            while not self.finished and self.written <= c:
                if self.failed or stopped():
                    raise Stopped("stopped")
                self.lock.wait(WAIT)
            path = self.path if self.finished else partial_path(self.path)
            fd, _ = open_regular(path, "state file", follow=False)
        n = n_ctx * self.width * 4
        try:
            data = os.pread(fd, n, c * n)
        finally:
            os.close(fd)
        if len(data) != n:
            raise K3LabError(f"{self.path}: ends before chunk {c} (cut short since it was written?)")
        return np.frombuffer(data, dtype=np.float32).reshape(n_ctx, self.width)


@dataclass
class StepDone:
    """What a stage leaves when its step has run every chunk."""

    sums: Sums
    arrays: dict[str, dict[str, Any]]  # name -> {"file", "sha256", "identity"}
    widths: dict[str, int]


def run_wave(
    wave: list[tuple[int, CalibrationStep]],
    open_stage: Callable[[int, CalibrationStep], Stage],
    arrays: dict[str, Array],
    state: CalibrationState,
    tokens: np.ndarray,
    halt: threading.Event,
    done: Callable[[int, CalibrationStep, StepDone], None],
) -> None:
    """Run the steps of ``wave`` ((k, step), consecutive) over every chunk of ``tokens``, stage k
    reading ``arrays`` (name -> the latest one, updated here as stages begin writing theirs) and
    calling ``done`` when it has run them all. Raises the first failure; ``halt`` stops it."""
    n_chunks, n_ctx = tokens.shape
    plan: list[tuple[int, CalibrationStep, dict[str, Array], dict[str, Array]]] = []
    for k, step in wave:  # (who reads what: fixed before any stage starts)
        reads = {name: arrays[name] for name in step.reads}
        writes = {name: Array(state.path(f"{name}.{k:03d}.f32"), 0) for name in step.writes}
        arrays.update(writes)
        plan.append((k, step, reads, writes))
    failures: list[BaseException] = []
    stop = threading.Event()

    def stopped() -> bool:
        return halt.is_set() or stop.is_set()

    def stage_thread(
        k: int, step: CalibrationStep, reads: dict[str, Array], writes: dict[str, Array]
    ) -> None:
        writers: dict[str, ArrayWriter] = {}
        stage = None
        try:
            stage = open_stage(k, step)
            writers = {name: state.writer(a.path.name) for name, a in writes.items()}
            for c in range(n_chunks):
                if stopped():
                    raise Stopped("stopped")
                inputs = {name: a.chunk(c, n_ctx, stopped) for name, a in reads.items()}
                outputs = stage.run(c, tokens[c], inputs)
                if stopped():
                    raise Stopped("stopped")
                for name, value in outputs.items():
                    a = writes[name]
                    with a.lock:
                        a.width = int(value.shape[-1])
                        writers[name].write(value)
                        a.written = c + 1
                        a.lock.notify_all()
            sums = stage.finish()
            if stopped():
                raise Stopped("stopped")
            proofs = {}
            for name, wr in writers.items():
                a = writes[name]
                with a.lock:
                    sha = wr.finish()
                    a.finished = True
                    a.lock.notify_all()
                proofs[name] = {"file": a.path.name, "sha256": sha, "identity": state.identity(a.path.name)}
            writers = {}
            done(k, step, StepDone(sums, proofs, {name: a.width for name, a in writes.items()}))
        except BaseException as e:  # noqa: BLE001 (the first failure is raised by the caller)
            failures.append(e)
            stop.set()
            for a in writes.values():
                with a.lock:
                    a.failed = True
                    a.lock.notify_all()
            for wr in writers.values():
                wr.abandon()
        finally:
            if stage is not None:
                stage.close()

    if len(plan) == 1:
        stage_thread(*plan[0])
    else:
        threads = [threading.Thread(target=stage_thread, args=p, daemon=True) for p in plan]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(WAIT)
        except BaseException:
            halt.set()
            for t in threads:
                t.join()
            raise
    if failures:
        real = [e for e in failures if not isinstance(e, Stopped)]
        raise (real or failures)[0]
