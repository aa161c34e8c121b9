"""The notebooks' figures (matplotlib). Each function takes plain data and returns a Figure."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from k3lab.formats.mxfp4 import E2M1_VALUES


def scale_histograms(scales: dict[tuple[int, str], np.ndarray]) -> Figure:
    """E8M0 exponents (byte - 127) per (layer, projection), one panel per projection."""
    projs = sorted({p for _, p in scales})
    fig = Figure(figsize=(4.2 * len(projs), 3.4), layout="constrained")
    axes = fig.subplots(1, len(projs), sharey=True, squeeze=False)[0]
    names = {"w1": "gate (w1)", "w2": "down (w2)", "w3": "up (w3)"}
    for ax, proj in zip(axes, projs):
        panel = {layer: s.ravel() for (layer, p), s in sorted(scales.items()) if p == proj}
        # exponents; 255 is E8M0's NaN, not a scale
        exps = {layer: s[s != 255].astype(np.int32) - 127 for layer, s in panel.items()}
        every = np.concatenate(list(exps.values()))
        # the axis spans the bulk: a few far outliers would squeeze every histogram into one bar
        p_lo, p_hi = np.percentile(every, [0.1, 99.9])
        lo, hi = max(int(every.min()), int(p_lo) - 2), min(int(every.max()), int(p_hi) + 2)
        bins = np.arange(lo - 0.5, hi + 1.5)
        for layer, e in exps.items():
            ax.hist(e, bins=bins, histtype="step", label=f"layer {layer}", density=True)
        outside = int(((every < lo) | (every > hi)).sum())
        if outside:
            note = (
                f"{outside} block{'s' * (outside > 1)} off the axis\n(min {every.min()}, max {every.max()})"
            )
            ax.text(0.02, 0.97, note, transform=ax.transAxes, va="top", fontsize="small")
        ax.set_title(f"E8M0 scale exponents, {names.get(proj, proj)}")
        ax.set_xlabel("exponent (scale byte - 127)")
        ax.legend(fontsize="small")
    axes[0].set_ylabel("fraction of 32-value blocks")
    return fig


def code_histogram(codes: np.ndarray, title: str = "FP4 (E2M1) codes") -> Figure:
    counts = np.bincount(codes.ravel(), minlength=16)
    labels = [f"{'-' if c & 8 else '+'}{E2M1_VALUES[c & 7]:g}" for c in range(16)]
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.subplots()
    ax.bar(range(16), counts / counts.sum(), color=["tab:blue"] * 8 + ["tab:orange"] * 8)
    ax.set_xticks(range(16), labels, rotation=45)
    ax.set_xlabel("code: sign and E2M1 magnitude")
    ax.set_ylabel("fraction of values")
    ax.set_title(title)
    return fig


def scale_heatmap(scales: np.ndarray, title: str) -> Figure:
    """Mean scale exponent per expert (rows) and block column (columns)."""
    data = scales.astype(np.float32).mean(axis=1) - 127  # [expert, block]
    fig = Figure(figsize=(8, 0.35 * data.shape[0] + 1.6), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(data.shape[1]))
    ax.set_xlabel("block column (32 input values each)")
    ax.set_ylabel("expert")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="mean exponent over rows")
    return fig


def block_stats(rows: list[dict[str, Any]], keys: list[str], title: str) -> Figure:
    """Weight std of each kind of tensor, block by block (the vision tower)."""
    fig = Figure(figsize=(7, 3.4), layout="constrained")
    ax = fig.subplots()
    blocks = [r["block"] for r in rows]
    for k in keys:
        ax.plot(blocks, [r.get(k, np.nan) for r in rows], marker="o", label=k)
    ax.set_xlabel("block")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("weight standard deviation")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def file_sizes(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.subplots()
    ax.bar(
        range(len(rows)),
        [r["bytes"] / 2**20 for r in rows],
        color=["tab:green" if r["on disk"] else "tab:red" for r in rows],
    )
    ax.set_xticks(
        range(len(rows)), [r["file"].split("-")[-3] if r["kind"] == "text" else "mmproj" for r in rows]
    )
    ax.set_xlabel("output file (split number)")
    ax.set_ylabel("MiB")
    ax.set_title("converted files (red: recorded but missing)")
    return fig
