"""What a plan is made from, and when a saved plan still holds: the inputs' fingerprint (metadata
files, source files' headers, options, k3lab's formats and the rule table) and what a later run may
take as read without reading it again (each file's identity beside what was read of it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.files import file_identity
from k3lab.pipeline.model import Model
from k3lab.pipeline.planning.plan import OUTPUT_FORMAT, PLAN_FORMAT, Plan
from k3lab.pipeline.sources.base import meta_fingerprint


def inputs_fingerprint(
    model: Model,
    source: Any,
    shards: list[str],
    options: dict[str, Any],
    proven: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the plan depends on, read cheaply: every metadata file's SHA-256, each shard's size and
    header SHA-256 (the Hub: its SHA-256, and the commit), the options, k3lab's output format and the
    rule table. A file whose identity is the one ``proven`` (a saved plan's) records is not read."""
    proven = proven or {}
    known = proven.get("files", {})
    fresh = [f for f in shards if not _unchanged(source, f, known)]
    files = source.file_fingerprints(fresh) if fresh else {}
    files |= {f: known[f]["fingerprint"] for f in shards if f not in files}
    return {
        "k3lab": [PLAN_FORMAT, OUTPUT_FORMAT, model.name, model.rules_digest],
        "options": options,
        "meta": meta_fingerprint(source.meta_dir, model.meta_files + model.optional_meta, proven.get("meta")),
        "files": {f: files[f] for f in shards},
        "pinned": source.pin(),  # (the Hub: the commit every task reads)
    }


def _unchanged(source: Any, file: str, known: dict[str, Any]) -> bool:
    entry = known.get(file)
    return (
        entry is not None
        and entry.get("identity") is not None
        and source.content_identity(file) == entry["identity"]
    )


def proven_inputs(model: Model, source: Any, plan: Plan, before: dict[str, Any]) -> dict[str, Any]:
    """What a later run may take as read without reading it again: each source file's identity
    (taken ``before`` its header was read, and the same after the plan was made: a file that changed
    meanwhile is left out) beside its fingerprint and header SHA-256, and each metadata file's
    identity beside its SHA-256."""
    files = {}
    for s in plan.source_files:
        identity = before.get(s.file)
        if identity is not None and source.content_identity(s.file) == identity:
            fingerprint = plan.inputs["files"][s.file]
            files[s.file] = {
                "identity": identity,
                "fingerprint": fingerprint,
                "header_sha256": s.header_sha256,
            }
    meta = {}
    for name, sha in plan.inputs["meta"].items():
        identity = before.get(name)
        if (
            sha is not None
            and identity is not None
            and file_identity(Path(source.meta_dir) / name) == identity
        ):
            meta[name] = {"identity": identity, "sha256": sha}
    return {"files": files, "meta": meta}


def inputs_digest(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def still_current(saved: Plan, source: Any, options: dict[str, Any]) -> bool:
    """Whether a saved plan was made from these very inputs (cheap: hashes of the metadata files and
    shard headers); a shard gone missing reads as changed (planning again says which)."""
    try:
        shards = sorted(saved.inputs.get("files", {}))
        inputs = inputs_fingerprint(saved.model, source, shards, options, saved.proven)
        # the config the plan carries must be the one on disk (a plan's own digest can be forged)
        same_config = saved.model.load_config(source.meta_dir).raw == saved.cfg.raw
        if not same_config or inputs_digest(inputs) != saved.inputs_digest:
            return False
        # and every header it was made from the one read now: a Hub source's inputs are its listing,
        # and a header read wrong (forgotten by the task whose download contradicted it) re-plans
        recorded = {s.file: s.header_sha256 for f in saved.files for s in f.sources}
        known = saved.proven.get("files", {})
        return all(
            (known[file]["header_sha256"] if _unchanged(source, file, known) else source.header_sha256(file))
            == sha
            for file, sha in recorded.items()
        )
    except K3LabError:
        return False
