"""A variant re-derived from its set: every quantised tensor quantised again by ggml from the lossless
file it was made from (read where that file's record puts it, its bytes checked against the record),
every copied tensor hashed from the set, and each compared with the variant's record. What
``k3lab verify OUT/LABEL --src OUT`` adds to the byte check."""

from __future__ import annotations

import hashlib
from pathlib import Path

from k3lab.formats.ggml import ggml
from k3lab.pipeline.quantizing.quantize import (
    LosslessFile,
    copy_pieces,
    imatrix_rows,
    quantized_pieces,
    threads,
)
from k3lab.pipeline.quantizing.variant import VariantPlan
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.record import Record
from k3lab.pipeline.state.records import content_digest


def rederive_variant(
    plan: VariantPlan, set_dir: str | Path, records: list[Record], add: object, token: str | None = None
) -> None:
    """Each recorded file of the variant made again from the set in ``set_dir``; ``add(kind, file,
    line)`` hears of each tensor that differs (or of a file of the set that is not there)."""
    lib, pool = ggml(), threads()
    folder = OutputFolder(set_dir)
    for rec in records:
        if not 1 <= rec.number <= len(plan.files):
            add("rederive", rec.file, f"{rec.file}: not a file of the variant's plan")  # type: ignore[operator]
            continue
        vf = plan.file(rec.number)
        if rec.plan_digest != vf.digest:
            add("plan", rec.file, f"{rec.file}: not made by the variant's plan as it is now (edited since?)")  # type: ignore[operator]
        made_from, own = (
            folder.records.text(vf.source_number),
            folder.variant(plan.label).records.text(rec.number),
        )
        read = (own.read.get(vf.source) or {}).get("sha256") if own is not None else None
        if made_from is not None and read is not None and read != content_digest(made_from):
            add(  # type: ignore[operator]
                "stale",
                rec.file,
                f"{rec.file}: stale: made from {vf.source} as it was before the set was converted again "
                "(k3lab quantize makes it again)",
            )
        want = {t.name: t.sha256 for t in rec.tensors}
        try:
            src = LosslessFile(folder, vf.source_number, vf.source, vf.source_digest)
        except Exception as e:  # (a set without that file: said, and the others still checked)
            add("rederive", rec.file, f"{rec.file}: cannot re-derive it: {e}")  # type: ignore[operator]
            continue
        try:
            for vt in vf.tensors:
                if vt.quantized:
                    pieces = quantized_pieces(lib, src, vt, imatrix_rows(plan, vt, token), pool, _Quiet())
                else:
                    pieces = copy_pieces(src, vt, _Quiet())
                h = hashlib.sha256()
                for piece in pieces:
                    h.update(piece)
                if want.get(vt.name) != h.hexdigest():
                    add(  # type: ignore[operator]
                        "rederive",
                        rec.file,
                        f"{rec.file}: tensor {vt.name}: re-derived from {vf.source} by ggml ({vt.type}), SHA-256 differs",
                    )
        finally:
            src.close()


class _Quiet:
    """A task report that hears nothing and never stops (a check runs in the foreground)."""

    def check(self, now: bool = False) -> None:
        pass

    def read(self, n: int) -> None:
        pass
