"""The imatrix's steps on a Dask cluster: a wave of as many steps as there are workers, each step held
by one worker (a Dask actor: its weights read once, from the set's folder or by ranges from the Hub,
every byte checked), the chunks flowing from worker to worker through the client, which keeps the
run's state (``waves``). Workers share nothing but the Hub (a set on the Hub) and hold one step's
weights and one chunk's state at a time; the client holds no weights.

A worker's actor runs its chunks in the order sent, one at a time (the client sends the next when
the last has come back), so its sums are added in llama-imatrix's order as in one process: the same
bits. On a stop the client waits for no actor: each is released with the client's futures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3lab.errors import K3LabError, MachineError
from k3lab.pipeline.calibrating.sets import HubSource, LocalSource, SetTensor
from k3lab.pipeline.calibrating.sums import Entry, Sums
from k3lab.pipeline.model import CalibrationStep, Model

ACTOR_TIMEOUT = 24 * 3600.0  # seconds an actor's call may take (a real layer's weights read: minutes)


@dataclass(frozen=True)
class StepSpec:
    """What a worker needs to hold one step, as plain values (the model travels by name)."""

    model: Model
    kvs: dict[str, Any]
    step: CalibrationStep
    tensors: dict[str, SetTensor]  # the step's own
    source: LocalSource | HubSource
    n_chunks: int
    n_ctx: int
    process_output: bool
    start: dict[str, tuple[np.ndarray, np.ndarray]]  # --in-file's entries of the step's weights
    threads: int | None


class StepActor:
    """One step held by a Dask worker (created with ``actor=True``)."""

    def __init__(self, spec: StepSpec):
        from k3lab.pipeline.calibrating.step import StepRun
        from k3lab.pipeline.quantizing.quantize import threads

        self.reader = spec.source.open(spec.tensors)
        try:
            sums = Sums(spec.process_output, start={n: Entry(v, c) for n, (v, c) in spec.start.items()})
            self.step_run = StepRun(spec.model, spec.kvs, spec.step, spec.tensors, self.reader, spec.n_chunks,
                                    spec.n_ctx, sums, threads(spec.threads).n)  # fmt: skip
        except BaseException:
            self.reader.close()
            raise

    def run(self, c: int, tokens: np.ndarray, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.step_run.run(c, tokens, state)

    def finish(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {n: (e.values, e.counts) for n, e in self.step_run.finish().entries.items()}

    def close(self) -> None:
        self.step_run.close()
        self.reader.close()


class ActorStage:
    """A worker's actor as a wave's stage (its calls waited for here, in the stage's thread)."""

    def __init__(self, actor: Any, process_output: bool, where: str):
        self.actor, self.process_output, self.where = actor, process_output, where

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.actor, method)(*args).result(timeout=ACTOR_TIMEOUT)
        except K3LabError:
            raise
        except Exception as e:  # (a worker lost, or an error of its own: named with the worker)
            raise K3LabError(f"worker {self.where}: {type(e).__name__}: {str(e)[:400]}") from None

    def run(self, c: int, tokens: np.ndarray, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._call("run", c, tokens, state)

    def finish(self) -> Sums:
        got = self._call("finish")
        return Sums(self.process_output, entries={n: Entry(v, c) for n, (v, c) in got.items()})

    def close(self) -> None:
        with contextlib.suppress(K3LabError):  # (a worker lost frees its actor's memory with it)
            self._call("close")


class DaskStages:
    """Stages on the cluster at ``scheduler`` (called as ``compute_imatrix``'s ``stages``): a wave as
    wide as its workers, step i of a wave on worker i; ``close`` lets the cluster go."""

    def __init__(self, scheduler: str):
        from distributed import Client

        self.scheduler = scheduler
        try:
            self.client = Client(scheduler, timeout=60)
        except OSError as e:
            raise MachineError(f"--scheduler {scheduler}: cannot reach it ({e})") from None
        self._held: list[Any] = []  # (each actor's future: the actor lives while it is held)

    def __call__(self, model: Model, kvs: dict[str, Any], calib_set: Any, n_chunks: int, n_ctx: int, options: Any,
                 begun: Sums) -> tuple[int, Callable[[int, CalibrationStep], Any]]:  # fmt: skip
        workers = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        if not workers:
            raise MachineError(f"--scheduler {self.scheduler}: no workers")
        light_kvs = {k: v for k, v in kvs.items() if not k.startswith("tokenizer.")}  # (no vocabulary sent)

        def open_stage(k: int, step: CalibrationStep) -> ActorStage:
            address = workers[k % len(workers)]  # (a wave's steps are consecutive: one per worker)
            tensors = {n: t for n, t in calib_set.tensors.items() if step.owns(n)}
            start = {n: (e.values, e.counts) for n, e in begun.entries.items() if n in tensors}
            spec = StepSpec(model, light_kvs, step, tensors, calib_set.source, n_chunks, n_ctx, options.process_output,
                            start, options.threads)  # fmt: skip
            future = self.client.submit(StepActor, spec, actor=True, workers=[address], allow_other_workers=False,
                                        pure=False, key=f"k3lab-imatrix-{step.name}-{k}")  # fmt: skip
            try:
                actor = future.result(timeout=ACTOR_TIMEOUT)
            except K3LabError:
                raise
            except Exception as e:
                raise K3LabError(
                    f"worker {address}: {step.name}: {type(e).__name__}: {str(e)[:400]}"
                ) from None
            self._held.append(future)
            return ActorStage(actor, options.process_output, address)

        return len(workers), open_stage

    def close(self) -> None:
        self._held.clear()
        self.client.close()
