"""Notebook 07: an importance matrix, what it covers and what llama-imatrix would say of it. The
imatrix of a set is made as ``k3lab imatrix`` makes it (a layer at a time) when the set has none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError


def ensure_imatrix(
    out_dir: str | Path,
    imatrix: str | Path | None = None,
    calibration: str | None = None,
    chunks: int = 8,
    chunk_size: int = 128,
) -> Path:
    """The imatrix to show: ``imatrix`` when given, else ``OUT_DIR/imatrix.gguf``, computed when
    missing (exactly as `k3lab imatrix OUT_DIR -c CHUNK_SIZE --chunks CHUNKS` computes it)."""
    if imatrix is not None:
        return Path(imatrix)
    path = Path(out_dir) / "imatrix.gguf"
    if path.exists():
        return path
    from k3lab.imatrix import command_values, compute
    from k3lab.request import Request

    return compute(Request(out_dir=str(out_dir)), command_values(calibration, chunk_size, chunks)).path


def statistics(path: str | Path) -> Any:
    """``k3lab imatrix --show-statistics``: per tensor, per layer, and the coverage."""
    from k3lab.imatrix import statistics as figures

    return figures(path)


def stats_rows(stats: Any, limit: int = 40) -> list[dict[str, Any]]:
    """The per-tensor figures as table rows (the ``limit`` largest Σ(Act²) first)."""
    rows = sorted(stats.tensors, key=lambda s: -s.total)[:limit]
    return [
        {"tensor": s.tensor, "Σ(Act²)": round(s.total, 2), "min": round(s.min, 4), "max": round(s.max, 4),
         "μ": round(s.mean, 2), "σ": round(s.stddev, 2), "active %": round(100 * s.active, 2), "N": s.elements,
         "entropy %": round(s.entropy_norm, 2), "ZD %": round(100 * s.zd, 2), "cos sim": round(s.cossim, 4)}
        for s in rows
    ]  # fmt: skip


def column_importance(path: str | Path, tensor: str, expert: int = 0) -> np.ndarray:
    """One entry's importance per input column (sums over counts, as llama-quantize weighs them; an
    expert never reached: all 1.0, as llama-quantize has it)."""
    from k3lab.pipeline.calibrating.output import entries_from_file

    entries = entries_from_file(path).entries
    if tensor not in entries:
        raise K3LabError(
            f"notebook parameter tensor={tensor!r}: not in {path} (its entries: {', '.join(sorted(entries)[:5])} ...)"
        )
    e = entries[tensor]
    m = e.counts.size
    if not 0 <= expert < m:
        raise K3LabError(f"notebook parameter expert={expert}: {tensor} has experts 0 to {m - 1}")
    row = e.values.reshape(m, -1)[expert]
    count = e.counts[expert]
    return row / np.float32(count) if count > 0 else np.ones_like(row)
