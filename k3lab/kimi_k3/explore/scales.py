"""MXFP4 experts up close (notebooks 02 and 03): E8M0 scale statistics of one projection across a
layer's experts, one expert's FP4 codes, one block before and after the repack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats import mxfp4
from k3lab.kimi_k3.rules import expert_tensor
from k3lab.pipeline.sources.base import Source

OUTLIER_LOW, OUTLIER_HIGH = 0, 250  # E8M0 bytes worth a look: an all-zero block, or ~2**123


def _expert_names(source: Source, layer: int, proj: str, part: str = "weight_scale") -> list[tuple[int, str]]:
    """(expert, tensor name) of every routed expert the index has for that layer and projection."""
    names, weight_map = [], source.weight_map
    while (name := expert_tensor(layer, len(names), proj, part)) in weight_map:
        names.append((len(names), name))
    return names


def _expert(source: Source, layer: int, proj: str, expert: int) -> None:
    """One line when the checkpoint has no such expert (never another tensor's bytes)."""
    count = len(_expert_names(source, layer, proj)) if _is_index(layer) else 0
    if not count:
        raise K3LabError(f"layer {layer!r}: no routed experts of {proj!r} in this checkpoint")
    if not _is_index(expert) or not 0 <= expert < count:
        raise K3LabError(f"expert {expert!r}: layer {layer} has experts 0 to {count - 1}")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def moe_layers(cfg: Any, layers: list[int]) -> list[int]:
    """The layers of ``layers`` that have routed experts (a dense layer, or one past the model's
    end, is left out, as the notebook says and prints); none left is one line naming the parameter."""
    have = [layer for layer in range(cfg.n_layer) if cfg.is_moe(layer)]
    if not any(layer in have for layer in layers):
        span = f"MoE layers {have[0]} to {have[-1]}" if have else "no MoE layer"
        raise K3LabError(
            f"notebook parameter layers={layers!r}: this checkpoint has {cfg.n_layer} layers, {span}"
        )
    return [layer for layer in layers if layer in have]


def nearest_moe_layers(cfg: Any, layers: list[int]) -> tuple[list[int], str]:
    """The layers of ``layers`` that have routed experts; when none has (a batch run's output file
    holding only a dense layer, the embedding or the head), the first MoE layer after them, with the
    line that says so (the page then shows what it says it shows)."""
    have = [layer for layer in range(cfg.n_layer) if cfg.is_moe(layer)]
    chosen = [layer for layer in layers if layer in have]
    if chosen or not have:
        return moe_layers(cfg, layers), ""
    if not layers:
        return [
            have[0]
        ], f"no layer here (the embedding, the head): showing layer {have[0]}, the first MoE layer"
    after = [layer for layer in have if layer > max(layers)]
    pick, which = (after[0], "next") if after else (have[-1], "last")
    return [pick], f"layers {layers} hold no routed experts: showing layer {pick}, the {which} that has"


BATCH = 64  # experts whose scales are fetched at once (a Hub source: side by side)


@dataclass
class ScaleStats:
    """One projection of one MoE layer, every expert: how often each scale byte occurs, the mean
    exponent per expert and block column, and the outlier blocks (byte 0, or >= 250)."""

    layer: int
    proj: str
    counts: np.ndarray  # int64 [256]: blocks per scale byte
    means: np.ndarray  # float32 [n_expert, blocks per row]: mean exponent over rows
    outliers: list[dict[str, int]]

    def summary(self) -> dict[str, Any]:
        byte = np.arange(256)
        valid = self.counts.copy()
        valid[255] = 0  # E8M0's NaN, not a scale
        n = int(valid.sum())
        mean = float((valid * byte).sum() / max(n, 1))
        std = float(np.sqrt((valid * (byte - mean) ** 2).sum() / max(n, 1)))
        present = np.nonzero(valid)[0]
        return {
            "layer": self.layer,
            "proj": PROJ_NAMES.get(self.proj, self.proj),
            "mean exponent": round(mean - 127, 2),
            "std": round(std, 2),
            "min exponent": int(present.min()) - 127 if present.size else None,
            "max exponent": int(present.max()) - 127 if present.size else None,
            "blocks": n,
        }


PROJ_NAMES = {"w1": "gate (w1)", "w2": "down (w2)", "w3": "up (w3)"}


def scale_stats(source: Source, layer: int, proj: str, outlier_limit: int = 50) -> ScaleStats:
    """Streams the experts one at a time (memory: one expert's scales), counting with bincount on
    the uint8 bytes as they are: no copy of a whole stack, no float64 of it."""
    if proj not in PROJ_NAMES:
        raise K3LabError(f"proj {proj!r}: give one of {', '.join(PROJ_NAMES)}")
    experts = _expert_names(source, layer, proj) if _is_index(layer) else []
    plain = _is_index(layer) and expert_tensor(layer, 0, proj, "weight") in source.weight_map
    if not experts and not plain:  # (plain experts have no scales: an empty view, said by the page)
        raise K3LabError(f"layer {layer!r}: no routed experts of {proj!r} in this checkpoint")
    counts = np.zeros(256, dtype=np.int64)
    rows_means: list[np.ndarray] = []
    outliers: list[dict[str, int]] = []
    for k, (e, name) in enumerate(experts):
        if k % BATCH == 0:
            source.warm([n for _, n in experts[k : k + BATCH]])
        sc = np.asarray(source.array(name))
        counts += np.bincount(sc.ravel(), minlength=256)
        rows_means.append(sc.mean(axis=0, dtype=np.float32) - 127)
        if len(outliers) < outlier_limit:
            for r, b in zip(*np.nonzero((sc == OUTLIER_LOW) | (sc >= OUTLIER_HIGH))):
                outliers.append(
                    {
                        "layer": layer,
                        "proj": proj,
                        "expert": e,
                        "row": int(r),
                        "block": int(b),
                        "byte": int(sc[r, b]),
                    }
                )
                if len(outliers) >= outlier_limit:
                    break
    means = np.stack(rows_means) if rows_means else np.zeros((0, 0), np.float32)
    return ScaleStats(layer, proj, counts, means, outliers)


def expert_codes(source: Source, layer: int, proj: str, expert: int = 0) -> np.ndarray:
    """The FP4 codes (0..15) of one expert matrix."""
    _expert(source, layer, proj, expert)
    name = expert_tensor(layer, expert, proj, "weight_packed")
    return mxfp4.unpack_codes(np.asarray(source.array(name)))


def first_block(
    source: Source, layer: int, proj: str, expert: int = 0, row: int = 0, block: int = 0
) -> dict[str, Any]:
    """One 32-value block before and after the repack: the 16 + 1 source bytes and the 17 ggml bytes."""
    _expert(source, layer, proj, expert)
    base = expert_tensor(layer, expert, proj, "")
    blocks = source.entry(base + "weight_scale").shape[-1]
    if not _is_index(block) or block >= blocks:
        raise K3LabError(f"block {block!r}: a row of {base}weight_packed has blocks 0 to {blocks - 1}")
    packed = np.asarray(source.rows(base + "weight_packed", row, row + 1))[:, block * 16 : block * 16 + 16]
    scale = np.asarray(source.rows(base + "weight_scale", row, row + 1))[:, block : block + 1]
    ggml = mxfp4.repack(packed, scale)
    return {
        "tensor": base + "weight_packed",
        "row": row,
        "block": block,
        "scale byte": int(scale[0, 0]),
        "source bytes": packed[0].tobytes().hex(" "),
        "ggml bytes": ggml[0].tobytes().hex(" "),
        "codes": mxfp4.unpack_codes(packed)[0].tolist(),
        "values": mxfp4.decode_compressed_tensors(packed, scale)[0].tolist(),
        "values from ggml bytes": mxfp4.decode_ggml(ggml, 32)[0].tolist(),
    }
