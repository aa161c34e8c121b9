"""MoonViT-3d and patchmergerv2 in NumPy: the reference an mmproj is checked against (``check-vision``).

Written from Moonshot's forward (``modeling_kimi_k3.py``: ``MoonViT3dPretrainedModel`` and
``PatchMergerMLPV2``) and its image processor, for one image (t = 1: no time embedding, no temporal
pooling), in float32:

- preprocess: resized (bicubic, as PIL does) so the patch count stays within ``in_patch_limit`` and
  ``patch_limit_on_one_side``, padded with black to multiples of patch x merge (28), scaled to
  [-1, 1] by the image mean and std, cut into 14 x 14 patches in row order;
- patch embed: the bias-free conv, one matmul per patch; the 64 x 64 position table added, resized
  bilinearly to the patch grid (half-pixel centres, ``align_corners`` false);
- each block: ``h = x + wo(attn(rms0(x)))``, ``x = h + fc1(gelu_tanh(fc0(rms1(h))))``, with 2-D RoPE on
  Q and K (theta 10000; pair k of a head turns by the x position for even k and y for odd, at
  frequency index k // 2), full attention, scale d^-0.5; the tower's RMSNorm eps is the machine
  epsilon of its dtype (``nn.RMSNorm(dim)``);
- the final RMSNorm; the 2 x 2 merge (features ordered dy, dx, c); the projector: Linear, exact
  (erf) GELU, Linear, RMSNorm (``projector_ln_eps``).

Weights come from either side: the source checkpoint's tensors, or an mmproj read back with gguf-py
(its Q/K de-interleave undone), so the same forward on both says, stage by stage, whether the file
computes what the tower does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.numerics import bf16_bits_to_f32

THETA = 10000.0
MAX_IMAGE_BYTES = 64 << 20
MAX_HEADER_BYTES = 16 << 20  # an mmproj's header is a few KB: its keys and ~170 tensor infos
MAX_IMAGE_PIXELS = 64 << 20  # (Moonshot's processor scales anything to at most 512 x 512 patches)
ERF = np.frompyfunc(math.erf, 1, 1)


@dataclass(frozen=True)
class Tower:
    """The tower's shape and constants, from vision_config (and the preprocessor's settings)."""

    patch: int
    hidden: int
    heads: int
    head_dim: int
    blocks: int
    merge: tuple[int, int]
    block_eps: float
    projector_eps: float
    pos_hw: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    in_patch_limit: int
    patch_limit_on_one_side: int


@dataclass
class Image:
    """An image as the tower sees it: its patches (row order), the grid, and the sizes on the way."""

    patches: np.ndarray  # [h * w, 3, patch, patch] float32
    grid: tuple[int, int]  # (h, w) patches
    original: tuple[int, int]  # (width, height) as given
    resized: tuple[int, int]  # (width, height) before padding
    padded: tuple[int, int]  # (width, height) after padding
    pixels: np.ndarray = field(repr=False)  # [H, W, 3] uint8, resized and padded

    @property
    def tokens(self) -> int:
        return (self.grid[0] // 2) * (self.grid[1] // 2)


def resize_plan(width: int, height: int, t: Tower) -> tuple[int, int, int, int]:
    """(new width, new height, pad width, pad height), as Moonshot's processor scales an image to
    the patch limits and pads it to multiples of patch x merge."""
    p = t.patch
    s1 = math.sqrt(t.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    s2 = t.patch_limit_on_one_side * p / width
    s3 = t.patch_limit_on_one_side * p / height
    scale = min(1.0, s1, s2, s3)
    new_w, new_h = max(1, int(width * scale)), max(1, int(height * scale))
    new_w, new_h = min(new_w, t.patch_limit_on_one_side * p), min(new_h, t.patch_limit_on_one_side * p)
    factor = t.merge[0] * p
    return new_w, new_h, (factor - new_w % factor) % factor, (factor - new_h % factor) % factor


def preprocess(image: Any, t: Tower) -> Image:
    """An image (a PIL image, or a path to one) as Moonshot's processor makes it."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if isinstance(image, PILImage.Image):
        img = image
    else:
        if Path(image).stat().st_size > MAX_IMAGE_BYTES:
            raise K3LabError(f"{image}: over {MAX_IMAGE_BYTES >> 20} MiB, not an image to check a tower on")
        try:
            img = PILImage.open(image)  # (reads the header only: the size is known before decoding)
        except (UnidentifiedImageError, OSError) as e:
            raise K3LabError(f"{image}: not an image PIL reads ({str(e)[:80]})") from None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise K3LabError(f"{image}: {w}x{h} is over {MAX_IMAGE_PIXELS} pixels")
    try:
        img = img.convert("RGB")
    except OSError as e:  # truncated or corrupt pixel data
        raise K3LabError(f"{image}: its pixels do not decode ({str(e)[:80]})") from None
    new_w, new_h, pad_w, pad_h = resize_plan(w, h, t)
    resized = img.resize((new_w, new_h), resample=PILImage.Resampling.BICUBIC)
    pixels = np.pad(np.asarray(resized), ((0, pad_h), (0, pad_w), (0, 0)))
    x = (pixels / 255.0).astype(np.float32)
    x = (x - np.array(t.mean, np.float32)) * (1.0 / np.array(t.std, np.float32)).astype(np.float32)
    H, W = x.shape[:2]
    gh, gw = H // t.patch, W // t.patch
    patches = x.reshape(gh, t.patch, gw, t.patch, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, t.patch, t.patch)
    return Image(patches.astype(np.float32), (gh, gw), (w, h), (new_w, new_h), (W, H), pixels)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))) * w


def _bilinear_index(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source indices and weights of a bilinear resize from n_in to n_out (half-pixel, clamped)."""
    src = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
    src = np.maximum(src, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, (src - i0).astype(np.float32)


def position_table(table: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """The [H, W, C] table resized to the patch grid, as [h * w, C] in row order."""
    h, w = grid
    if (h, w) == table.shape[:2]:
        return table.reshape(-1, table.shape[-1])
    y0, y1, wy = _bilinear_index(h, table.shape[0])
    x0, x1, wx = _bilinear_index(w, table.shape[1])
    rows = table[y0] * (1 - wy)[:, None, None] + table[y1] * wy[:, None, None]
    out = rows[:, x0] * (1 - wx)[None, :, None] + rows[:, x1] * wx[None, :, None]
    return out.reshape(-1, table.shape[-1]).astype(np.float32)


def _rope(x: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """2-D RoPE on [n, heads, d] in Moonshot's interleaved layout: pair k = (x[2k], x[2k+1]) turns by
    the x position (k even) or the y position (k odd) at frequency theta^(-4 (k // 2) / d)."""
    n, _, d = x.shape
    h, w = grid
    pos = np.arange(n)
    px, py = (pos % w).astype(np.float32), (pos // w).astype(np.float32)
    k = np.arange(d // 2)
    freq = (1.0 / THETA ** ((4 * (k // 2)) / d)).astype(np.float32)
    angle = np.where(k % 2 == 0, px[:, None], py[:, None]) * freq[None, :]  # [n, d/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x**3)))


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + ERF(x / np.float32(math.sqrt(2.0))).astype(np.float32))).astype(np.float32)


Weights = Callable[[str], np.ndarray]  # a source tensor name -> float32 values, the source's shape


def forward(image: Image, t: Tower, w: Weights) -> list[tuple[str, np.ndarray]]:
    """Every stage's output, in order: (name, value)."""
    stages: list[tuple[str, np.ndarray]] = []
    conv = w("vision_tower.patch_embed.proj.weight").reshape(t.hidden, -1)
    x = image.patches.reshape(len(image.patches), -1) @ conv.T
    stages.append(("patch embed", x))
    x = x + position_table(w("vision_tower.patch_embed.pos_emb.weight"), image.grid)
    stages.append(("position table", x))
    n, qkv = len(x), t.heads * t.head_dim
    for i in range(t.blocks):
        b = f"vision_tower.encoder.blocks.{i}."
        q, k, v = np.split(_rms(x, w(b + "norm0.weight"), t.block_eps) @ w(b + "wqkv.weight").T, 3, axis=-1)
        q, k = (
            _rope(q.reshape(n, t.heads, t.head_dim), image.grid),
            _rope(k.reshape(n, t.heads, t.head_dim), image.grid),
        )
        v = v.reshape(n, t.heads, t.head_dim)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.float32(math.sqrt(t.head_dim))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = np.einsum("hqk,khd->qhd", scores / scores.sum(axis=-1, keepdims=True), v).reshape(n, qkv)
        h = x + attn @ w(b + "wo.weight").T
        x = (
            h
            + _gelu_tanh(_rms(h, w(b + "norm1.weight"), t.block_eps) @ w(b + "mlp.fc0.weight").T)
            @ w(b + "mlp.fc1.weight").T
        )
        stages.append((f"block {i}", x))
    x = _rms(x, w("vision_tower.encoder.final_layernorm.weight"), t.block_eps)
    stages.append(("final norm", x))
    gh, gw = image.grid
    kh, kw = t.merge
    merged = (
        x.reshape(gh // kh, kh, gw // kw, kw, t.hidden)
        .transpose(0, 2, 1, 3, 4)
        .reshape(-1, kh * kw * t.hidden)
    )
    stages.append(("merge", merged))
    y = _gelu_erf(merged @ w("mm_projector.proj.0.weight").T) @ w("mm_projector.proj.2.weight").T
    y = _rms(y, w("mm_projector.post_norm.weight"), t.projector_eps)
    stages.append(("projector", y))
    return stages


# --- weights from an mmproj -------------------------------------------------------------------------

MMPROJ_NAMES = {  # the kimik3 name of each source tensor (the rule table's, read backwards)
    "vision_tower.patch_embed.proj.weight": "v.patch_embd.weight",
    "vision_tower.patch_embed.pos_emb.weight": "v.position_embd.weight",
    "vision_tower.encoder.final_layernorm.weight": "v.post_ln.weight",
    "mm_projector.proj.0.weight": "mm.1.weight",
    "mm_projector.proj.2.weight": "mm.2.weight",
    "mm_projector.post_norm.weight": "mm.post_norm.weight",
}
BLOCK_NAMES = {
    "norm0.weight": "ln1.weight",
    "norm1.weight": "ln2.weight",
    "wqkv.weight": "attn_qkv.weight",
    "wo.weight": "attn_out.weight",
    "mlp.fc0.weight": "ffn_up.weight",
    "mlp.fc1.weight": "ffn_down.weight",
}


def mmproj_weights(path: str | Path, undo_qkv: Callable[[np.ndarray], np.ndarray]) -> Weights:
    """The weights an mmproj holds, by their source names, read with gguf-py (``undo_qkv``: the
    inverse of the Q/K de-interleave, so the reference runs them in Moonshot's layout)."""
    import gguf

    _check_header(Path(path))
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    kind = reader.fields.get("clip.projector_type")
    if kind is None or kind.contents() != "kimik3":
        found = "none" if kind is None else repr(kind.contents())[:40]
        raise K3LabError(f"{path}: clip.projector_type is {found}, not kimik3 (not K3's mmproj)")

    def read(source: str) -> np.ndarray:
        name = MMPROJ_NAMES.get(source)
        if name is None and source.startswith("vision_tower.encoder.blocks."):
            block, _, rest = source.removeprefix("vision_tower.encoder.blocks.").partition(".")
            name = f"v.blk.{block}.{BLOCK_NAMES[rest]}"
        t = tensors.get(name or "")
        if t is None or t.tensor_type.name not in ("F32", "F16", "BF16"):
            found = "missing" if t is None else t.tensor_type.name
            raise K3LabError(f"{path}: tensor {name} ({source} of the tower) is {found}")
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            values = bf16_bits_to_f32(data.view(np.uint16).reshape(shape))
        else:
            values = np.asarray(data, dtype=np.float32).reshape(shape)
        return undo_qkv(values) if name.endswith("attn_qkv.weight") else values

    return read


def _check_header(path: Path) -> None:
    """One line when the file is not a whole GGUF (k3lab's bounded reader, before gguf-py's)."""
    from k3lab.formats.gguf_header import GGUFHeaderError, NeedMore, parse

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(min(size, MAX_HEADER_BYTES))
    try:
        parse(head, size=size)
    except NeedMore:
        raise K3LabError(f"{path}: its GGUF header runs past {MAX_HEADER_BYTES >> 20} MiB") from None
    except GGUFHeaderError as e:
        raise K3LabError(f"{path}: {e}") from None


def compare(
    ours: list[tuple[str, np.ndarray]], reference: list[tuple[str, np.ndarray]], threshold: float = 1e-4
) -> list[dict[str, Any]]:
    """Stage by stage: the largest absolute difference and the relative one (to the reference's
    largest magnitude), and whether it is within ``threshold``."""
    rows = []
    for (name, a), (_, b) in zip(ours, reference, strict=True):
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        rel = diff / scale if scale else diff
        rows.append({"stage": name, "max abs": diff, "max rel": rel, "ok": rel < threshold})
    return rows
