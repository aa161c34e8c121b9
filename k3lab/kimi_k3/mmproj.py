"""Kimi-K3's vision mmproj: the MoonViT tower and the patchmergerv2 projector as one ``clip`` GGUF.

The pipeline writes it as a single file beside the split set (``pipeline.writing.single``); this module says
what it is: ``VISION_RULES`` (rules.py), the source layout, and llama.cpp's ``clip`` keys. The keys
follow llama.cpp's Kimi-K2.5 converter (``KimiK25Model``: projector type ``kimik25``, the
``vision.pos_emb_*`` keys); K3's own hyperparameters are recorded beside them as ``clip.vision.*``
keys (see ``CLIP_K3_KEYS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFValueType, Keys, LlamaFileType

from k3lab.errors import K3LabError
from k3lab.formats.files import read_json
from k3lab.formats.gguf_stream import KV
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.layout import vision_layout
from k3lab.kimi_k3.rules import VISION_RULES, vision_unit_tags
from k3lab.pipeline.model import SingleFileModel

CLIP_ARCH = "clip"
PROJECTOR_TYPE = "kimik25"
S, U32, F32, BOOL, ARR = (
    GGUFValueType.STRING,
    GGUFValueType.UINT32,
    GGUFValueType.FLOAT32,
    GGUFValueType.BOOL,
    GGUFValueType.ARRAY,
)
# MoonViT normalises pixels to [-1, 1]; used when the checkpoint ships no preprocessor_config.json
DEFAULT_PREPROCESSOR = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 16384}
CLIP_K3_KEYS = (
    "clip.vision.qkv_hidden_size",
    "clip.vision.merge_kernel_size",
    "clip.vision.merge_type",
    "clip.vision.mm_projector_type",
    "clip.vision.norm_type",
    "clip.vision.projector_hidden_act",
    "clip.vision.mm_hidden_size",
)


def preprocessor_config(meta_dir: str | Path) -> dict[str, Any]:
    path = Path(meta_dir) / "preprocessor_config.json"
    cfg = dict(DEFAULT_PREPROCESSOR)
    if path.exists():
        given = read_json(path, 1 << 20, "preprocessor config")
        if not isinstance(given, dict):
            raise K3LabError(f"{path}: not a JSON object")
        cfg.update(given)
    return cfg


def clip_kvs(cfg: K3Config, pre: dict[str, Any], file_type: int = int(LlamaFileType.MOSTLY_BF16)) -> list[KV]:
    """The mmproj metadata: Kimi-K2.5's keys with K3's values, then K3's own."""
    v = cfg.vision
    patch = int(v["patch_size"])
    merge_kernel = [int(x) for x in v["merge_kernel_size"]]
    return [
        KV(Keys.General.ARCHITECTURE, CLIP_ARCH, S),
        KV(Keys.General.NAME, "Kimi-K3 MoonViT mmproj", S),
        KV(Keys.General.FILE_TYPE, file_type, U32),
        KV("clip.has_vision_encoder", True, BOOL),
        KV("clip.projector_type", PROJECTOR_TYPE, S),
        KV("clip.vision.projection_dim", int(v.get("text_hidden_size", cfg.n_embd)), U32),
        KV("clip.vision.image_size", int(v["init_pos_emb_height"]) * patch, U32),
        KV("clip.vision.patch_size", patch, U32),
        KV("clip.vision.embedding_length", int(v["vt_hidden_size"]), U32),
        KV("clip.vision.feed_forward_length", int(v["vt_intermediate_size"]), U32),
        KV("clip.vision.block_count", int(v["vt_num_hidden_layers"]), U32),
        KV("clip.vision.attention.head_count", int(v["vt_num_attention_heads"]), U32),
        KV("clip.vision.image_mean", [float(x) for x in pre["image_mean"]], ARR, F32),
        KV("clip.vision.image_std", [float(x) for x in pre["image_std"]], ARR, F32),
        KV("vision.pos_emb_height", int(v["init_pos_emb_height"]), U32),
        KV("vision.pos_emb_width", int(v["init_pos_emb_width"]), U32),
        KV("vision.pos_emb_time", int(v["init_pos_emb_time"]), U32),
        KV("clip.use_gelu", v.get("projector_hidden_act", "gelu") == "gelu", BOOL),
        KV("clip.vision.attention.layer_norm_epsilon", float(v.get("projector_ln_eps", 1e-5)), F32),
        KV("clip.vision.projector.scale_factor", merge_kernel[0], U32),
        KV("clip.vision.image_min_pixels", 8 * patch * patch, U32),
        KV("clip.vision.image_max_pixels", int(pre["in_patch_limit"]) * patch * patch, U32),
        # K3's own, in the same naming style
        KV("clip.vision.qkv_hidden_size", int(v["qkv_hidden_size"]), U32),
        KV("clip.vision.merge_kernel_size", merge_kernel, ARR, GGUFValueType.INT32),
        KV("clip.vision.merge_type", str(v["merge_type"]), S),
        KV("clip.vision.mm_projector_type", str(v["mm_projector_type"]), S),
        KV("clip.vision.norm_type", str(v["norm_type"]), S),
        KV("clip.vision.projector_hidden_act", str(v.get("projector_hidden_act", "gelu")), S),
        KV("clip.vision.mm_hidden_size", int(v["mm_hidden_size"]), U32),
    ]


def mmproj_kvs(cfg: K3Config, meta_dir: Path) -> list[KV]:
    return clip_kvs(cfg, preprocessor_config(meta_dir))


def vision_units(cfg: K3Config) -> list[int | None]:
    return [None, *range(int(cfg.vision["vt_num_hidden_layers"]))]


MMPROJ = SingleFileModel(
    arch=CLIP_ARCH,
    kind="vision",
    key="mmproj",
    prefixes=("vision_tower.", "mm_projector."),
    rules=VISION_RULES,
    units=vision_units,
    unit_tags=vision_unit_tags,
    layout=vision_layout,
    kvs=mmproj_kvs,
    check_config=K3Config.check_vision,
    file_name="mmproj-{basename}-BF16.gguf",
)
