"""A converted set at a glance (notebook 05): every planned file, converted, missing or not yet."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from k3lab.pipeline.model import Model
from k3lab.pipeline.state import OutputFolder


def manifest_summary(out_dir: str | Path, model: Model | None = None) -> list[dict[str, Any]]:
    """Per output file of a converted set: status, tensors, bytes, types and the source shard; files the
    saved plan has but the manifest does not are listed as not converted."""
    folder = OutputFolder(out_dir)
    rows = []
    for rec in folder.records.manifest().records:
        types = Counter(t.type for t in rec.tensors)
        sources = sorted({src.file for t in rec.tensors for src in t.sources})
        on_disk = folder.output(rec.file).exists()
        rows.append(
            {
                "file": rec.file,
                "kind": rec.kind,
                "status": "converted" if on_disk else "missing",
                "tensors": len(rec.tensors),
                "bytes": rec.size,
                "types": ", ".join(f"{k} {v}" for k, v in sorted(types.items())),
                "from": ", ".join(sources[:2]) + (f" (+{len(sources) - 2})" if len(sources) > 2 else ""),
            }
        )
    if model is None:
        from k3lab.request import Request

        model = Request().load_model()
    plan = folder.plans.load(model)
    if plan is None:
        return rows
    listed = {r["file"] for r in rows}
    for f in plan.files:
        if f.filename not in listed:
            types = Counter(t.info.type.name for t in f.tensors)
            rows.append(
                {
                    "file": f.filename,
                    "kind": "text",
                    "status": "not converted",
                    "tensors": len(f.tensors),
                    "bytes": f.nbytes,
                    "types": ", ".join(f"{k} {v}" for k, v in sorted(types.items())),
                    "from": ", ".join(f.source_names[:2])
                    + (f" (+{len(f.sources) - 2})" if len(f.sources) > 2 else ""),
                }
            )
    return sorted(rows, key=lambda r: (r["kind"] != "text", r["file"]))


def verify(
    out_dir: str | Path,
    only: set[str] | None = None,
    repo: str | None = None,
    revision: str | None = None,
    sample: int | None = None,
    seed: int = 0,
) -> Any:
    """``k3lab verify``: a converted set in ``out_dir`` (``only`` those files), or a set on the Hub
    (``repo`` at ``revision``: its headers, and ``sample`` tensors per file, by ranges). The report."""
    from k3lab import request
    from k3lab.pipeline.checking.verify import verify as verify_folder

    if repo is None:
        return verify_folder(out_dir, quiet=True, only=only)
    req = request.Request(out_dir=repo, revision=revision, quiet=True)
    return request.verify(req, sample=sample, seed=seed).report


def repo_summary(repo: str, revision: str | None = None) -> list[dict[str, Any]]:
    """Per file of a GGUF set on the Hub, from its header alone (read by ranges): tensors, bytes,
    types, and its split number."""
    from k3lab.pipeline.checking.hub_set import open_repo
    from k3lab.pipeline.checking.remote import read_header, split_sets
    from k3lab.pipeline.hub.env import hub_env

    env = hub_env()
    files = open_repo(repo, revision, env.endpoint, env.token, env.budget)
    rows = []
    for names in split_sets(sorted(files.sizes)).values():
        for name in names:
            h = read_header(name, files.sizes[name], files.fetch)
            types = Counter(t.type for t in h.tensors)
            rows.append(
                {
                    "file": name,
                    "split": h.split("split.no"),
                    "tensors": len(h.tensors),
                    "bytes": h.size,
                    "types": ", ".join(f"{k} {v}" for k, v in sorted(types.items())),
                    "header read": h.fetched,
                }
            )
    return rows
