"""A converted set at a glance (notebook 05): every planned file, converted, missing or not yet."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from k3lab.pipeline.model import Model
from k3lab.pipeline.writing.folder import OutputFolder


def manifest_summary(out_dir: str | Path, model: Model | None = None) -> list[dict[str, Any]]:
    """Per output file of a converted set: status, tensors, bytes, types and the source shard; files the
    saved plan has but the manifest does not are listed as not converted."""
    folder = OutputFolder(out_dir)
    rows = []
    for rec in folder.read_manifest().records:
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
    plan = folder.load_plan(model)
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
                    "from": f.source_file,
                }
            )
    return sorted(rows, key=lambda r: (r["kind"] != "text", r["file"]))
