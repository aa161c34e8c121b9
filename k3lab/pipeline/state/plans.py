"""The saved plan (``.k3lab/plan.json``) and file 1's metadata (``.k3lab/kvs.json``).

State spanning two files is written so that the last one names the other: the KVs, then the plan
naming their digest. A plan whose KVs do not match, or whose files' digests do not re-derive from
their tensors (edited), reads as absent and is made again; an interrupt between the two writes leaves
a folder the next run finishes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.files import InputFileError, read_bounded
from k3lab.formats.gguf_stream import KV, kvs_from_json, kvs_to_json
from k3lab.pipeline.model import Model
from k3lab.pipeline.planning.plan import Plan, PlanError, file_digest, kvs_digest
from k3lab.pipeline.state.codec import STATE_LIMITS, read_state, state_body, write_atomically, write_state
from k3lab.pipeline.state.names import KVS_NAME, PLAN_NAME, VARIANT_NAME


class Plans:
    def __init__(self, state: Path, ready: Callable[[], None], exists: Callable[[], bool]):
        # ``ready()`` makes ``.k3lab`` (a real directory); ``exists()`` says whether it is there (and
        # is one line when it is anything but a real directory)
        self.state, self._ready, self._exists = state, ready, exists

    def save(self, plan: Plan, kvs: list[KV]) -> Path:
        """The KVs first, then the plan naming their digest: whichever write an interrupt stops,
        the plan on disk either has its KVs or reads as absent (and is made again)."""
        self._ready()
        write_state(self.state / KVS_NAME, "kvs", kvs_to_json(kvs))
        return write_state(self.state / PLAN_NAME, "plan", plan.to_json())

    def load(self, model: Model) -> Plan | None:
        """The saved plan, or None when there is none or it cannot be trusted: damaged, edited (each
        file's digest is re-derived from its tensors), or its KVs are not the ones it names."""
        if not self._exists():
            return None
        data = read_state(self.state / PLAN_NAME, "plan")
        if data is None:
            return None
        try:
            plan = Plan.from_json(data, model)
            if any(file_digest(plan, f) != f.digest for f in plan.files) or not plan.files:
                return None
        except (K3LabError, KeyError, TypeError, ValueError, IndexError, AttributeError):
            return None
        return plan if self._kvs_body(plan) is not None else None

    def require(self, model: Model, inputs_digest: str | None = None) -> Plan:
        """The saved plan, for a task or a notebook: one line when there is none (or not this run's)."""
        plan = self.load(model)
        path = self.state / PLAN_NAME
        if plan is None:
            raise PlanError(f"{path}: no usable plan (`k3lab plan --out-dir` or `k3lab convert` makes it)")
        if inputs_digest is not None and plan.inputs_digest != inputs_digest:
            raise PlanError(f"{path}: the saved plan changed under this run (another run re-planned?)")
        return plan

    def _kvs_body(self, plan: Plan) -> bytes | None:
        """The KVs' JSON when it is the one the plan names: checked by digest, not parsed (a task
        that does not write file 1 never holds the 163,840-token vocabulary)."""
        body = state_body(self.state / KVS_NAME, "kvs")
        # the body is json_bytes(kvs_to_json(kvs)): the KV digest's canonical JSON and a newline
        if body is None or hashlib.sha256(body[:-1]).hexdigest() != plan.kvs_digest:
            return None
        return body

    def kvs(self, plan: Plan) -> list[KV]:
        """File 1's planned metadata, checked against the plan's digest of it."""
        body = self._kvs_body(plan)
        if body is None:
            raise PlanError(f"{self.state / KVS_NAME}: missing or not the plan's; run the command again")
        try:
            kvs = kvs_from_json(json.loads(body))
        except (ValueError, KeyError, TypeError, IndexError):
            raise PlanError(
                f"{self.state / KVS_NAME}: not file 1's metadata; run the command again"
            ) from None
        if kvs_digest(kvs) != plan.kvs_digest:  # (the same bytes, so never; but proven, not assumed)
            raise PlanError(f"{self.state / KVS_NAME}: not the plan's; run the command again")
        return kvs

    def export(self) -> dict[str, bytes]:
        """The saved plan's state files as they are on disk, for a worker with a folder of its own."""
        return {
            name: read_bounded(self.state / name, STATE_LIMITS[kind], f"{kind} file", follow=False)
            for name, kind in ((KVS_NAME, "kvs"), (PLAN_NAME, "plan"))
        }

    def install(self, blobs: dict[str, bytes]) -> None:
        """Install a plan exported from another folder (KVs first), unless these very bytes are
        there; it is then loaded, and so proven, like any saved plan."""
        self._ready()
        for name in (KVS_NAME, PLAN_NAME):
            try:
                same = (
                    read_bounded(self.state / name, len(blobs[name]) + 1, "state file", follow=False)
                    == blobs[name]
                )
            except InputFileError:
                same = False
            if not same:
                write_atomically(self.state / name, lambda fh, data=blobs[name]: fh.write(data))


class VariantPlans:
    """A variant folder's plan (``OUT/LABEL/.k3lab/variant.json``): saved whole, loaded only when
    every file's digest re-derives from what it holds (else absent: planned again)."""

    def __init__(self, state: Path, ready: Callable[[], None], exists: Callable[[], bool]):
        self.state, self._ready, self._exists = state, ready, exists

    def save(self, plan: Any) -> Path:
        self._ready()
        return write_state(self.state / VARIANT_NAME, "variant", plan.to_json())

    def load(self) -> Any:
        from k3lab.pipeline.quantizing.variant import VariantPlan

        if not self._exists():
            return None
        data = read_state(self.state / VARIANT_NAME, "variant")
        if data is None:
            return None
        try:
            return VariantPlan.from_json(data)
        except (K3LabError, KeyError, TypeError, ValueError, IndexError, AttributeError):
            return None

    def require(self, digest: str | None = None) -> Any:
        """The saved plan, for a task: one line when there is none (or not this run's)."""
        plan = self.load()
        path = self.state / VARIANT_NAME
        if plan is None:
            raise PlanError(f"{path}: no usable variant plan (`k3lab quantize` makes it)")
        if digest is not None and plan.digest != digest:
            raise PlanError(f"{path}: the variant's plan changed under this run (another run re-planned?)")
        return plan

    def export(self) -> bytes:
        return read_bounded(self.state / VARIANT_NAME, STATE_LIMITS["variant"], "variant file", follow=False)

    def install(self, blob: bytes) -> None:
        """A plan exported from another folder, unless these very bytes are there (proven on load)."""
        self._ready()
        try:
            same = read_bounded(self.state / VARIANT_NAME, len(blob) + 1, "state file", follow=False) == blob
        except InputFileError:
            same = False
        if not same:
            write_atomically(self.state / VARIANT_NAME, lambda fh: fh.write(blob))
