"""The notebooks' figures (matplotlib). Each function takes plain data and returns a Figure."""

from __future__ import annotations

from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from k3lab.formats.mxfp4 import E2M1_VALUES


def scale_histograms(counts: dict[tuple[int, str], np.ndarray]) -> Figure:
    """E8M0 exponents (byte - 127) per (layer, projection), one panel per projection, from the number
    of blocks per scale byte (``explore.ScaleStats.counts``)."""
    projs = sorted({p for _, p in counts})
    fig = Figure(figsize=(4.2 * len(projs), 3.4), layout="constrained")
    axes = fig.subplots(1, len(projs), sharey=True, squeeze=False)[0]
    names = {"w1": "gate (w1)", "w2": "down (w2)", "w3": "up (w3)"}
    for ax, proj in zip(axes, projs):
        panel = {layer: c.astype(np.int64).copy() for (layer, p), c in sorted(counts.items()) if p == proj}
        for c in panel.values():
            c[255] = 0  # E8M0's NaN, not a scale
        every = sum(panel.values())
        present = np.nonzero(every)[0]
        if not present.size:
            continue
        # the axis spans the bulk: a few far outliers would squeeze every histogram into one bar
        cdf = np.cumsum(every) / every.sum()
        p_lo, p_hi = int(np.searchsorted(cdf, 0.001)), int(np.searchsorted(cdf, 0.999))
        lo, hi = max(int(present.min()), p_lo - 2), min(int(present.max()), p_hi + 2)
        for layer, c in panel.items():
            share = c[lo : hi + 1] / max(c.sum(), 1)
            ax.stairs(share, np.arange(lo, hi + 2) - 127.5, label=f"layer {layer}")
        outside = int(every[:lo].sum() + every[hi + 1 :].sum())
        if outside:
            note = (
                f"{outside:,} block{'s' * (outside > 1)} left off: exponents from "
                f"{int(present.min()) - 127} to {int(present.max()) - 127}"
            )
            ax.text(0.02, 0.97, note, transform=ax.transAxes, va="top", fontsize="small", wrap=True)
        ax.set_xlim(lo - 127.5, hi - 127 + 0.5)
        ax.set_title(f"E8M0 scale exponents, {names.get(proj, proj)}")
        ax.set_xlabel("exponent (scale byte - 127)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize="small")
    axes[0].set_ylabel("fraction of 32-value blocks")
    return fig


# the 16 codes in the order of their values, -6 to +6: sign bit 8, then E2M1 magnitude (codes 15..8
# are -6..-0, codes 0..7 are +0..+6), so a bell around 0 is drawn as one
BY_VALUE = [*range(15, 7, -1), *range(8)]


def code_histogram(codes: np.ndarray, title: str = "FP4 (E2M1) codes") -> Figure:
    counts = np.bincount(codes.ravel(), minlength=16)[BY_VALUE]
    labels = [f"{'-' if c & 8 else '+'}{E2M1_VALUES[c & 7]:g}" for c in BY_VALUE]
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.subplots()
    ax.bar(range(16), counts / max(1, counts.sum()), color=["tab:orange"] * 8 + ["tab:blue"] * 8)
    ax.set_xticks(range(16), labels, rotation=45)
    ax.set_xlabel("value of the code (sign and E2M1 magnitude), before the block's scale")
    ax.set_ylabel("fraction of values")
    ax.set_title(title)
    return fig


def scale_heatmap(means: np.ndarray, title: str) -> Figure:
    """Mean scale exponent per expert (rows) and block column (columns): ``ScaleStats.means``."""
    data = means
    fig = Figure(figsize=(8, min(9.0, 0.35 * data.shape[0] + 1.6)), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
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
        color=[{"converted": "tab:green", "missing": "tab:red"}.get(r["status"], "0.7") for r in rows],
    )
    ax.set_xticks(
        range(len(rows)),
        [
            r["file"].split("-")[-3]
            if r["kind"] == "text"
            else {"vision": "mmproj"}.get(r["kind"], r["kind"])
            for r in rows
        ],
    )
    ax.set_xlabel("output file (split number)")
    ax.set_ylabel("MiB")
    ax.set_title("output files (green: converted, red: recorded but missing, grey: not converted yet)")
    return fig


def block_permutation(source_bytes: bytes, scale: int, ggml_bytes: bytes) -> Figure:
    """One 32-value MXFP4 block before and after the repack, nibble by nibble, each nibble coloured by
    the element it holds: the scale byte is copied first, then element j and j+16 share byte j."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    fig = Figure(figsize=(13, 3.0), layout="constrained")
    ax = fig.subplots()

    def draw(y: float, cells: list[tuple[str, list[int]]], title: str) -> None:
        # cells: (label, [element of the low nibble, element of the high nibble]) or the scale byte
        for i, (label, elems) in enumerate(cells):
            if not elems:  # the scale byte
                ax.add_patch(Rectangle((i, y), 1, 0.8, facecolor="0.85", edgecolor="k"))
                ax.text(i + 0.5, y + 0.4, label, ha="center", va="center", fontsize=7)
                continue
            for half, e in enumerate(elems):  # high nibble drawn on the left, as a byte is written
                x = i + (0.5 if half == 0 else 0.0)
                ax.add_patch(Rectangle((x, y), 0.5, 0.8, facecolor=cmap(e % 20), edgecolor="k", lw=0.5))
                ax.text(x + 0.25, y + 0.4, str(e), ha="center", va="center", fontsize=7)
        ax.text(-0.3, y + 0.4, title, ha="right", va="center", fontsize=9)

    src = [(f"{b:02x}", [2 * m, 2 * m + 1]) for m, b in enumerate(source_bytes)]
    src.append((f"scale\n{scale:02x}", []))
    dst = [(f"scale\n{ggml_bytes[0]:02x}", [])] + [
        (f"{b:02x}", [j, j + 16]) for j, b in enumerate(ggml_bytes[1:])
    ]
    draw(1.2, src, "compressed-tensors\n(16 bytes + scale)")
    draw(0.0, dst, "ggml block_mxfp4\n(scale + 16 bytes)")
    ax.set_xlim(-4.5, 17.2)
    ax.set_ylim(-0.3, 2.3)
    ax.axis("off")
    ax.set_title(
        "each box is a nibble, numbered by the element (0-31) it holds; byte j of ggml holds elements j and j+16"
    )
    return fig


def image_patches(pixels: np.ndarray, resized: tuple[int, int], patch: int, merge: int) -> Figure:
    """The image as the tower takes it: its patch grid (thin), the merged tokens (thick), and the
    padding beyond the resized image (hatched)."""
    height, width = pixels.shape[:2]
    fig = Figure(figsize=(7, 7 * height / max(width, 1) + 0.6), layout="constrained")
    ax = fig.subplots()
    ax.imshow(pixels, interpolation="nearest")
    for x in range(0, width + 1, patch):
        ax.axvline(x - 0.5, color="white", lw=1.4 if x % (patch * merge) == 0 else 0.4, alpha=0.8)
    for y in range(0, height + 1, patch):
        ax.axhline(y - 0.5, color="white", lw=1.4 if y % (patch * merge) == 0 else 0.4, alpha=0.8)
    rw, rh = resized
    for xy, w, h in (((rw - 0.5, -0.5), width - rw, height), ((-0.5, rh - 0.5), rw, height - rh)):
        if w > 0 and h > 0:
            ax.add_patch(Rectangle(xy, w, h, fill=False, hatch="//", edgecolor="tab:red", lw=0))
    ax.set_title(
        f"{width // patch} x {height // patch} patches of {patch} px, "
        f"{(width // patch // merge) * (height // patch // merge)} tokens of {merge} x {merge} (padding hatched)"
    )
    ax.set_xticks([])
    ax.set_yticks([])
    return fig


def stage_agreement(stages: list[dict[str, Any]], threshold: float) -> Figure:
    """Each stage's largest relative difference, the mmproj's weights against the source's."""
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    names = [s["stage"] for s in stages]
    values = [max(s["max rel"], 1e-12) for s in stages]  # (zero: drawn at the floor)
    ax.bar(names, values, color=["tab:green" if s["ok"] else "tab:red" for s in stages])
    ax.axhline(threshold, color="black", ls="--", lw=1, label=f"threshold {threshold:g}")
    ax.set_yscale("log")
    ax.set_ylim(1e-12, 1)
    ax.set_ylabel("max relative difference")
    ax.set_title("the mmproj's tower against the source's, stage by stage (1e-12: identical)")
    ax.tick_params(axis="x", rotation=45, labelsize="small")
    ax.legend(fontsize="small")
    return fig


def layer_agreement(rows: list[dict[str, Any]]) -> Figure:
    """Per layer stage, the reference, the runtime's own choices and llama.cpp against Moonshot's own
    forward (NMSE, log scale)."""
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    names = [r["stage"] for r in rows]
    keys = (
        ("reference vs Moonshot", "o-"),
        ("llama.cpp's own choices vs Moonshot", "^:"),
        ("llama.cpp vs Moonshot", "s--"),
    )
    for key, style in ((k, s) for k, s in keys if k in rows[0]):
        ys = [max(r[key], 1e-16) if r[key] is not None else np.nan for r in rows]
        ax.plot(range(len(rows)), ys, style, label=key)
    ax.set_xticks(range(len(rows)), names, rotation=45, fontsize="small")
    ax.set_yscale("log")
    ax.set_ylabel("NMSE against Moonshot")
    ax.set_title("the text model three ways, layer by layer")
    ax.legend(fontsize="small")
    return fig


def variant_sizes(rows: list[dict[str, Any]], lossless: int) -> Figure:
    """Each variant's size (``explore.variants.sizes``) against the lossless set's, with its bits per weight."""
    fig = Figure(figsize=(7.5, 0.45 * len(rows) + 1.4), layout="constrained")
    ax = fig.subplots()
    names = [r["variant"] for r in rows]
    sizes = [r["bytes"] / 1e9 for r in rows]
    bars = ax.barh(names, sizes, color="tab:blue")
    ax.axvline(lossless / 1e9, color="tab:red", linestyle="--", label="the lossless set")
    for bar, r in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['bits per weight']:.2f} bits/weight",
                va="center", fontsize="small")  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("size (GB)")
    ax.set_title("the whole model, per variant")
    ax.legend(fontsize="small", loc="lower right")
    return fig


BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_1": 6, "Q5_0": 5.5,
        "Q4_K": 4.5, "Q4_1": 5, "Q4_0": 4.5, "MXFP4": 4.25, "IQ4_XS": 4.25, "IQ4_NL": 4.5, "Q3_K": 3.4375,
        "IQ3_S": 3.4375, "IQ3_XXS": 3.0625, "Q2_K": 2.625, "IQ2_S": 2.5625, "IQ2_XS": 2.3125, "IQ2_XXS": 2.0625,
        "IQ1_M": 1.75, "IQ1_S": 1.5625, "TQ2_0": 2.0625, "TQ1_0": 1.6875, "Q1_0": 1.125}  # fmt: skip


def variant_choices(choices: dict[str, dict[int, str]], title: str) -> Figure:
    """A variant's types, tensor kind by layer (``explore.variants.choices``), coloured by bits per weight."""
    kinds = sorted(choices)
    layers = sorted({k for c in choices.values() for k in c})
    grid = np.full((len(kinds), len(layers)), np.nan)
    for i, kind in enumerate(kinds):
        for j, layer in enumerate(layers):
            if layer in choices[kind]:
                grid[i, j] = BITS.get(choices[kind][layer], np.nan)
    fig = Figure(figsize=(min(14, 2 + 0.14 * len(layers) + 4), 0.3 * len(kinds) + 1.6), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(kinds)), kinds, fontsize="small")
    ax.set_xlabel("layer")
    step = max(1, len(layers) // 16)
    ax.set_xticks(range(0, len(layers), step), [layers[k] for k in range(0, len(layers), step)])
    fig.colorbar(im, ax=ax, label="bits per weight")
    ax.set_title(title)
    return fig


def variant_errors(rows: list[dict[str, Any]], title: str) -> Figure:
    """Relative RMS error of each quantised tensor per variant (``explore.variants.layer_errors``)."""
    tensors = list(dict.fromkeys(r["tensor"] for r in rows))
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    fig = Figure(figsize=(8, 0.32 * len(tensors) * max(1, len(labels) / 2) + 1.4), layout="constrained")
    ax = fig.subplots()
    height = 0.8 / max(len(labels), 1)
    for k, label in enumerate(labels):
        got = {r["tensor"]: r["rel_rmse"] for r in rows if r["variant"] == label}
        ys = [i + k * height for i, t in enumerate(tensors) if t in got]
        ax.barh(ys, [got[t] for t in tensors if t in got], height=height, label=label)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(tensors))], [t.split(".", 2)[-1] for t in tensors],
                  fontsize="small")  # fmt: skip
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("relative RMS error against the lossless tensor")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def imatrix_coverage(
    blocks: list[int], grid: np.ndarray, title: str = "calibration tokens per expert"
) -> Figure:
    """Tokens that reached each expert, layer by layer (``Coverage.layers``): an expert never reached
    is drawn in red (llama-quantize weighs its columns evenly)."""
    fig = Figure(
        figsize=(min(14, 3 + 0.05 * grid.shape[1] + 4), 0.28 * len(blocks) + 1.6), layout="constrained"
    )
    ax = fig.subplots()
    shown = np.ma.masked_where(grid == 0, np.log10(np.maximum(grid, 1)))
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("tab:red")
    im = ax.imshow(shown, aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_yticks(range(len(blocks)), [str(b) for b in blocks], fontsize="small")
    ax.set_ylabel("layer")
    ax.set_xlabel("expert")
    fig.colorbar(im, ax=ax, label="log10 tokens (red: none)")
    ax.set_title(title)
    return fig


def imatrix_layers(layers: list[tuple[int, float, float, float]]) -> Figure:
    """llama-imatrix's per-layer averages (``Statistics.layers``): μΣ(Act²) and μCosSim by layer."""
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.subplots()
    xs = [k for k, *_ in layers]
    ax.plot(xs, [b for _, b, _, _ in layers], marker="o", label="μΣ(Act²)")
    ax.set_xlabel("layer")
    ax.set_ylabel("μΣ(Act²) (weighted by columns)")
    ax2 = ax.twinx()
    ax2.plot(xs, [c for *_, c in layers], marker="s", color="tab:orange", label="μCosSim to the layer before")
    ax2.set_ylabel("μCosSim")
    ax2.set_ylim(-0.05, 1.05)
    fig.legend(fontsize="small", loc="lower right")
    ax.set_title("the importance matrix, layer by layer (llama-imatrix --show-statistics' averages)")
    return fig


def column_importance(values: np.ndarray, title: str) -> Figure:
    """One entry's importance per input column, sorted (how unevenly llama-quantize weighs its columns)."""
    fig = Figure(figsize=(8, 3), layout="constrained")
    ax = fig.subplots()
    ax.plot(np.sort(values)[::-1])
    ax.set_yscale("log")
    ax.set_xlabel("input column (largest first)")
    ax.set_ylabel("mean square activation")
    ax.set_title(title)
    return fig


def cost_grids(grids: dict[str, tuple[list[str], list[int], np.ndarray]]) -> Figure:
    """Each tensor's cost under a type, kind by layer (``explore.costs.cost_grid``), a panel per type,
    on one logarithmic colour scale: where a type hurts, and how much more the next type down does."""
    finite = [g[np.isfinite(g) & (g > 0)] for _, _, g in grids.values()]
    values = np.concatenate(finite) if finite else np.array([1.0])
    lo, hi = (np.log10(values.min()), np.log10(values.max())) if values.size else (0.0, 1.0)
    kinds, layers, _ = next(iter(grids.values()))
    fig = Figure(figsize=(4 + 3.2 * len(grids), 0.3 * len(kinds) + 1.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(grids), sharey=True))
    im = None
    for ax, (type_name, (_, _, grid)) in zip(axes, grids.items()):
        with np.errstate(divide="ignore"):
            shown = np.where(grid > 0, np.log10(np.where(grid > 0, grid, 1.0)), np.nan)
        im = ax.imshow(shown, aspect="auto", cmap="magma", vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_title(type_name)
        ax.set_xlabel("layer")
        step = max(1, len(layers) // 8)
        ax.set_xticks(range(0, len(layers), step), [layers[k] for k in range(0, len(layers), step)])
    axes[0].set_yticks(range(len(kinds)), kinds, fontsize="small")
    if im is not None:
        fig.colorbar(im, ax=list(axes), label="log10 cost (expected squared change of the output)")
    return fig


def loss_curve(curve: list[tuple[int, float]], variants: list[dict[str, Any]]) -> Figure:
    """The least loss for each size (``explore.costs.loss_curve``) and each variant's own (``variant_losses``):
    a variant above the curve loses more than a mix of its size need."""
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    xs = [b / 1e6 for b, _ in curve]
    ys = [max(loss, 1e-12) for _, loss in curve]
    ax.plot(xs, ys, "-", color="tab:blue", label="--fit: the least loss for the size")
    for r in variants:
        if r["predicted loss"] is None:
            continue
        ax.plot(r["bytes"] / 1e6, max(r["predicted loss"], 1e-12), "o", color="tab:red")
        ax.annotate(r["variant"], (r["bytes"] / 1e6, max(r["predicted loss"], 1e-12)), fontsize="small",
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("tensor data (MB)")
    ax.set_ylabel("predicted loss")
    ax.set_title("size against loss: the curve a size is chosen from")
    ax.legend(fontsize="small")
    return fig
