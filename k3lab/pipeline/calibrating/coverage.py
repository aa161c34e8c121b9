"""What an imatrix says of itself: ``llama-imatrix --show-statistics``' figures (per tensor: the sums of
squared activations, their spread, the share of columns active, entropy, the z-score share and the
cosine similarity to the layer before; per layer, their averages weighted by size), computed as
llama-imatrix computes them (float32, its order), and its coverage: for every expert stack, how many
calibration tokens reached each expert, and which were never reached. llama-quantize weighs every
column of such an expert equally (its importance 1.0: as if there were no imatrix for it).

Nothing here knows a model: names are parsed as llama-imatrix parses them (``blk.N.NAME.weight``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from k3lab.pipeline.calibrating.sums import Entry

INACTIVE = np.float32(1e-5)  # llama-imatrix: a column whose mean square is at most this is inactive


@dataclass(frozen=True)
class TensorStats:
    """One entry's figures (llama-imatrix's ``tensor_statistics``)."""

    tensor: str  # the entry's name
    layer: str  # its block number, or "-"
    name: str  # the part before ".weight"
    total: float  # Σ(Act²): the sum of the per-column mean squares
    min: float
    max: float
    mean: float
    stddev: float
    active: float  # the share of columns above INACTIVE
    elements: int
    entropy: float
    entropy_norm: float  # percent of the largest entropy for this many columns
    zd: float  # the share of columns more than one σ above the mean
    cossim: float  # the raw sums' cosine similarity to the same tensor of the block before (0: none)

    def row(self) -> str:
        """As ``llama-imatrix --show-statistics`` prints it."""
        return (
            f"{self.layer:>5}\t{self.name:<20}\t{self.total:10.2f}\t{self.min:8.4f}\t{self.max:11.4f}\t"
            f"{self.mean:6.2f}\t{self.stddev:6.2f}\t{self.active * 100:8.2f}%\t{self.elements:6d}\t"
            f"{self.entropy:10.4f}\t{self.entropy_norm:6.2f}%\t{100 * self.zd:10.2f}%\t{self.cossim:8.4f}"
        )


def _names(tensor: str) -> tuple[str, str]:
    parts = tensor.split(".")
    layer = next((parts[i + 1] for i in range(len(parts) - 1) if parts[i] == "blk"), "") or "-"
    name = next((parts[i - 1] for i in range(1, len(parts)) if parts[i] == "weight"), "") or tensor
    return layer, name


def _seq_sum(values: np.ndarray) -> np.float32:
    """A float32 sum added left to right (``std::accumulate``)."""
    return np.cumsum(values, dtype=np.float32)[-1] if values.size else np.float32(0)


def _one(tensor: str, e: Entry) -> TensorStats | None:
    m = e.counts.size
    values = e.values.reshape(m, -1)
    kept = [values[i] / np.float32(e.counts[i]) for i in range(m) if e.counts[i] != 0]
    if not kept:
        return None
    acts = np.concatenate(kept).astype(np.float32)
    size = np.float32(acts.size)
    total = _seq_sum(acts)
    mean = np.float32(total / size)
    sq_total = _seq_sum(acts * acts)
    var = np.float32(np.float32(sq_total / size) - np.float32(mean * mean))
    dev = np.float32(math.sqrt(max(np.float32(0), var)))
    inactive = int((np.abs(acts) <= INACTIVE).sum())
    active = np.float32(1) - np.float32(inactive) / size
    entropy = np.float32(0)
    if total > 0:
        p = (acts / total).astype(np.float32)
        p = p[p > 0]
        entropy = -_seq_sum(p * np.log2(p))
    zd = 0
    if dev > 0:
        zd = int((((acts - mean) / dev) > 1).sum())
    layer, name = _names(tensor)
    norm = np.float32(100) * (entropy / np.float32(math.log2(acts.size))) if acts.size > 1 else np.float32(0)
    return TensorStats(tensor, layer, name, float(total), float(acts.min()), float(acts.max()), float(mean),
                       float(dev), float(active), int(acts.size), float(entropy), float(norm),
                       float(np.float32(zd) / size), 0.0)  # fmt: skip


def tensor_stats(entries: dict[str, Entry]) -> list[TensorStats]:
    """Every entry's figures, in llama-imatrix's order (by name, then the larger Σ(Act²) first)."""
    found = {n: s for n, e in entries.items() if (s := _one(n, e)) is not None}
    out = []
    for n, s in found.items():
        cossim = 0.0
        m = re.search(r"blk\.(\d+)\.", n)
        if m:
            prev = n[: m.start(1)] + str(int(m.group(1)) - 1) + n[m.end(1) :]
            if prev in found:
                a, b = entries[n].values.reshape(-1), entries[prev].values.reshape(-1)
                dp = _seq_sum(a * b) if a.size == b.size else np.float32("nan")
                cossim = float(
                    np.float32(dp / np.float32(math.sqrt(_seq_sum(a * a)) * math.sqrt(_seq_sum(b * b))))
                )
        out.append(TensorStats(**{**s.__dict__, "cossim": cossim}))
    return sorted(out, key=lambda s: (s.name, -s.total))


def layer_stats(stats: list[TensorStats]) -> list[tuple[int, float, float, float]]:
    """Per block (number order): (block, μΣ(Act²), μZD, μCosSim), averages weighted by columns."""
    acc: dict[int, list[float]] = {}
    for s in stats:
        if s.layer == "-" or not s.layer.isdigit():
            continue
        a = acc.setdefault(int(s.layer), [0.0, 0.0, 0.0, 0])
        a[0] += s.elements * s.total
        a[1] += s.elements * s.zd
        a[2] += s.elements * s.cossim
        a[3] += s.elements
    return [(k, a[0] / a[3], a[1] / a[3], a[2] / a[3]) for k, a in sorted(acc.items()) if a[3]]


@dataclass(frozen=True)
class Coverage:
    """For each expert stack (an entry with a count per expert), the tokens that reached each expert."""

    tokens: dict[str, np.ndarray]  # entry -> tokens per expert

    @property
    def unreached(self) -> dict[str, list[int]]:
        """Entry -> the experts no calibration token reached (llama-quantize weighs them evenly)."""
        return {n: [int(i) for i in np.flatnonzero(c == 0)] for n, c in self.tokens.items() if (c == 0).any()}

    def reached(self) -> tuple[int, int]:
        """(experts reached, experts) over every stack."""
        return sum(int((c > 0).sum()) for c in self.tokens.values()), sum(
            c.size for c in self.tokens.values()
        )

    def layers(self) -> tuple[list[int], np.ndarray]:
        """(block numbers, tokens per block and expert): the most any stack of the block saw."""
        by: dict[int, np.ndarray] = {}
        for n, c in self.tokens.items():
            m = re.search(r"blk\.(\d+)\.", n)
            if m:
                k = int(m.group(1))
                by[k] = np.maximum(by.get(k, np.zeros_like(c)), c)
        blocks = sorted(by)
        width = max((by[k].size for k in blocks), default=0)
        grid = np.zeros((len(blocks), width), np.int64)
        for i, k in enumerate(blocks):
            grid[i, : by[k].size] = by[k]
        return blocks, grid

    def lines(self, limit: int = 20) -> list[str]:
        """What a person reads: the share reached, and the stacks with experts never reached."""
        got, total = self.reached()
        if not total:
            return ["no expert stacks in this imatrix"]
        out = [f"{got} of {total} experts reached by the calibration text ({100 * got / total:.1f}%)"]
        missed = self.unreached
        for n, experts in list(missed.items())[:limit]:
            shown = ", ".join(map(str, experts[:12])) + (
                f" and {len(experts) - 12} more" if len(experts) > 12 else ""
            )
            out.append(f"  {n}: experts {shown} never reached")
        if len(missed) > limit:
            out.append(f"  ... and {len(missed) - limit} more stacks")
        if missed:
            out.append(
                "llama-quantize weighs every column of an expert never reached equally (importance 1.0, as "
                "without an imatrix): a longer or broader calibration text reaches more of them"
            )
        return out


def coverage(entries: dict[str, Entry]) -> Coverage:
    return Coverage({n: e.counts.astype(np.int64) for n, e in entries.items() if e.counts.size > 1})
