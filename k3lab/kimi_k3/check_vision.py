"""``k3lab check-vision``: does an mmproj compute what Moonshot's tower computes?

One image, preprocessed as Moonshot's processor does it, through the NumPy reference of MoonViT and
patchmergerv2 (``vision_ref``) twice: with the weights the mmproj holds, read back as a runtime reads
them (gguf-py; the Q/K de-interleave undone), and with the source checkpoint's. The verdict is per
stage (patch embed, position table, each block, the final norm, the merge, the projector): a file that
is the tower, bit for bit, after the stated transforms agrees at every one; a wrong transform is
named at the first stage it moves. Also said: the image's way in (its size, grid, tokens) and the
prompt it becomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.numerics import bf16_bits_to_f32
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.mmproj import preprocessor_config, tower_eps
from k3lab.kimi_k3.transforms import qkv_rope_merge
from k3lab.kimi_k3.vision_ref import Image, Tower, compare, forward, mmproj_weights, preprocess

SAMPLE_IMAGE = (
    Path(__file__).resolve().parent / "data" / "kimi-k3-sample.png"
)  # 200 x 150: not a multiple of 28


def tower(cfg: K3Config, meta_dir: str | Path) -> Tower:
    """The tower's shape and constants from config.json and the preprocessor's settings."""
    cfg.check_vision()
    v, pre = cfg.vision, preprocessor_config(meta_dir)
    heads = int(v["vt_num_attention_heads"])
    qkv = int(v.get("qkv_hidden_size") or v["vt_hidden_size"])
    return Tower(
        patch=int(v["patch_size"]),
        hidden=int(v["vt_hidden_size"]),
        heads=heads,
        head_dim=qkv // heads,
        blocks=int(v["vt_num_hidden_layers"]),
        merge=(int(v["merge_kernel_size"][0]), int(v["merge_kernel_size"][1])),
        block_eps=tower_eps(cfg),
        projector_eps=float(v.get("projector_ln_eps", 1e-5)),
        pos_hw=(int(v["init_pos_emb_height"]), int(v["init_pos_emb_width"])),
        mean=tuple(float(x) for x in pre["image_mean"]),  # type: ignore[arg-type]
        std=tuple(float(x) for x in pre["image_std"]),  # type: ignore[arg-type]
        in_patch_limit=int(pre["in_patch_limit"]),
        patch_limit_on_one_side=int(pre.get("patch_limit_on_one_side", 512)),
    )


def source_weights(source: Any) -> Any:
    """The source checkpoint's vision tensors as float32, by name."""

    def read(name: str) -> np.ndarray:
        e = source.entry(name)
        a = np.asarray(source.array(name))
        return bf16_bits_to_f32(a) if e.dtype == "BF16" else a.astype(np.float32)

    return read


def image_prompt(image: Image) -> str:
    """The text an image becomes in a prompt, as Moonshot's processor writes it: its original size,
    and one ``<|media_pad|>`` the model widens to the image's tokens."""
    w, h = image.original
    return f"<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>"


def image_sequence(image: Image) -> str:
    """What the model sees of it, position by position: the one placeholder widened to one
    ``<|media_pad|>`` per merged token (where the embeddings go; llama.cpp's mtmd puts them there)."""
    w, h = image.original
    return f"<|media_begin|>image {w}x{h}<|media_content|>" + "<|media_pad|>" * image.tokens + "<|media_end|>"


@dataclass
class VisionCheck:
    image: Image
    stages: list[dict[str, Any]]
    embeddings: np.ndarray = field(repr=False)
    reference: np.ndarray = field(repr=False)

    @property
    def ok(self) -> bool:
        return all(s["ok"] for s in self.stages)

    @property
    def failed(self) -> list[str]:
        return [s["stage"] for s in self.stages if not s["ok"]]

    def table(self) -> str:
        lines = [f"{'stage':<16} {'max abs':>11} {'max rel':>11}  verdict"]
        for s in self.stages:
            lines.append(
                f"{s['stage']:<16} {s['max abs']:>11.3g} {s['max rel']:>11.3g}  {'ok' if s['ok'] else 'DIFFERS'}"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        img = self.image
        last = self.stages[-1]
        return (
            f"image {img.original[0]}x{img.original[1]} -> resized {img.resized[0]}x{img.resized[1]}, padded "
            f"{img.padded[0]}x{img.padded[1]}: {img.grid[1]}x{img.grid[0]} patches, {img.tokens} tokens of "
            f"{self.embeddings.shape[-1]}; embeddings max abs error {last['max abs']:.3g}, max relative "
            f"{last['max rel']:.3g}"
        )


def check_vision(
    source: Any,
    cfg: K3Config,
    meta_dir: str | Path,
    mmproj: str | Path,
    image: Any = None,
    threshold: float = 1e-4,
) -> VisionCheck:
    """The mmproj at ``mmproj`` against the source's tower, on ``image`` (default: the sample)."""
    for path, what in ((mmproj, "mmproj"), (image, "image")):
        if isinstance(path, (str, Path)) and not Path(path).is_file():  # (nor a FIFO, a folder)
            raise K3LabError(
                f"{path}: {'not a regular file' if Path(path).exists() else 'no such ' + what + ' file'}"
            )
    t = tower(cfg, meta_dir)
    img = preprocess(image if image is not None else SAMPLE_IMAGE, t)
    theirs = source_weights(source)
    held = mmproj_weights(mmproj, lambda w: qkv_rope_merge(w, cfg))

    def ours(name: str) -> np.ndarray:
        a, want = held(name), source.entry(name).shape
        if a.shape != tuple(want):
            raise K3LabError(
                f"{mmproj}: {name} of the tower is {list(a.shape)} there, {list(want)} in the source"
            )
        return a

    reference = forward(img, t, theirs)
    ours_stages = forward(img, t, ours)
    return VisionCheck(img, compare(ours_stages, reference, threshold), ours_stages[-1][1], reference[-1][1])
