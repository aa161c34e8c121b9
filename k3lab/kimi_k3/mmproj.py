"""Kimi-K3's vision mmproj: the MoonViT tower and the patchmergerv2 projector as one ``clip`` GGUF in
the ``kimik3`` convention, the one a llama.cpp runs K3's tower with (unsloth's fork, PR #70:
``tools/mtmd/models/kimik3.cpp``; upstream has no K3 vision yet, ggml-org/llama.cpp#28264).

The pipeline writes it as a single file beside the split set (``pipeline.writing.single``); this
module says what it is: ``VISION_RULES`` (rules.py), the source layout, and the keys. The keys are
the convention's, each from the config (or the preprocessor config); what the convention cannot say
is kept beside them as ``clip.vision.*`` keys of K3's own (``CLIP_K3_KEYS``): the tower's RMSNorm
epsilon (Moonshot's ``nn.RMSNorm(dim)``: the dtype's machine epsilon, 2^-7 in BF16; the fork uses the
projector's for both), the merge type, the projector's exact (erf) GELU (the fork uses tanh's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, Keys, LlamaFileType

from k3lab.errors import K3LabError
from k3lab.formats.files import read_json
from k3lab.formats.gguf_stream import KV
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.layout import source_dtype, vision_layout
from k3lab.kimi_k3.rules import VISION_RULES, vision_unit_tags
from k3lab.pipeline.model import SingleFileModel

CLIP_ARCH = "clip"
PROJECTOR_TYPE = "kimik3"
S, U32, F32, BOOL, ARR = (
    GGUFValueType.STRING,
    GGUFValueType.UINT32,
    GGUFValueType.FLOAT32,
    GGUFValueType.BOOL,
    GGUFValueType.ARRAY,
)
# MoonViT normalises pixels to [-1, 1]; used when the checkpoint ships no preprocessor_config.json
DEFAULT_PREPROCESSOR = {
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit": 16384,
    "patch_limit_on_one_side": 512,
}
CLIP_K3_KEYS = (
    "clip.vision.block_norm_epsilon",
    "clip.vision.projector_gelu",
    "clip.vision.qkv_hidden_size",
    "clip.vision.merge_kernel_size",
    "clip.vision.merge_type",
    "clip.vision.mm_projector_type",
    "clip.vision.norm_type",
    "clip.vision.projector_hidden_act",
    "clip.vision.mm_hidden_size",
)
MACHINE_EPS = {"BF16": 2.0**-7, "F16": 2.0**-10, "F32": float(np.finfo(np.float32).eps)}


def preprocessor_config(meta_dir: str | Path) -> dict[str, Any]:
    """The image preprocessor's settings (``preprocessor_config.json``, flat or under
    ``media_proc_cfg`` as Moonshot's processor keeps them), over the defaults."""
    path = Path(meta_dir) / "preprocessor_config.json"
    cfg = dict(DEFAULT_PREPROCESSOR)
    if path.exists():
        given = read_json(path, 1 << 20, "preprocessor config")
        if not isinstance(given, dict):
            raise K3LabError(f"{path}: not a JSON object")
        nested = given.get("media_proc_cfg")
        cfg.update(given)
        if isinstance(nested, dict):
            cfg.update(nested)
    _check_preprocessor(cfg, path)
    return cfg


def _check_preprocessor(cfg: dict[str, Any], path: Path) -> None:
    """One line when a setting the tower's input depends on is not a sane number."""
    for key in ("image_mean", "image_std"):
        v = cfg[key]
        if not (
            isinstance(v, list)
            and len(v) == 3
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and -1e3 <= x <= 1e3 for x in v)
            and (key == "image_mean" or all(x != 0 for x in v))
        ):
            raise K3LabError(f"{path}: {key} is {str(v)[:60]}, not three numbers")
    for key in ("in_patch_limit", "patch_limit_on_one_side"):
        v = cfg[key]
        if not (isinstance(v, int) and not isinstance(v, bool) and 4 <= v <= 1 << 20):
            raise K3LabError(f"{path}: {key} is {str(v)[:60]}, not a whole number in 4..{1 << 20}")


def tower_eps(cfg: K3Config) -> float:
    """The tower's RMSNorm epsilon: ``nn.RMSNorm(dim)`` with eps None is the machine epsilon of the
    dtype the tower runs in (its weights', as config.json declares them)."""
    return MACHINE_EPS[source_dtype(cfg)]


def clip_kvs(cfg: K3Config, pre: dict[str, Any], file_type: int = int(LlamaFileType.MOSTLY_BF16)) -> list[KV]:
    """The mmproj metadata: the ``kimik3`` convention's keys with K3's values, then K3's own."""
    v = cfg.vision
    patch = int(v["patch_size"])
    merge_kernel = [int(x) for x in v["merge_kernel_size"]]
    heads = int(v["vt_num_attention_heads"])
    qkv = int(v.get("qkv_hidden_size") or v["vt_hidden_size"])
    return [
        KV(Keys.General.ARCHITECTURE, CLIP_ARCH, S),
        KV(Keys.General.TYPE, "mmproj", S),
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
        KV("clip.vision.attention.head_count", heads, U32),
        KV("clip.vision.attention.head_dim", qkv // heads, U32),  # (qkv != embedding: not derivable)
        KV("clip.vision.image_mean", [float(x) for x in pre["image_mean"]], ARR, F32),
        KV("clip.vision.image_std", [float(x) for x in pre["image_std"]], ARR, F32),
        KV("clip.use_gelu", True, BOOL),
        KV("clip.vision.attention.layer_norm_epsilon", float(v.get("projector_ln_eps", 1e-5)), F32),
        KV("clip.vision.projector.scale_factor", merge_kernel[0], U32),
        KV("clip.vision.image_min_pixels", 8 * patch * patch, U32),
        KV("clip.vision.image_max_pixels", int(pre["in_patch_limit"]) * patch * patch, U32),
        # K3's own, what the convention cannot say
        KV("clip.vision.block_norm_epsilon", tower_eps(cfg), F32),
        KV("clip.vision.projector_gelu", "erf", S),
        KV("clip.vision.qkv_hidden_size", qkv, U32),
        KV("clip.vision.merge_kernel_size", merge_kernel, ARR, GGUFValueType.INT32),
        KV("clip.vision.merge_type", str(v["merge_type"]), S),
        KV("clip.vision.mm_projector_type", str(v["mm_projector_type"]), S),
        KV("clip.vision.norm_type", str(v["norm_type"]), S),
        KV("clip.vision.projector_hidden_act", str(v.get("projector_hidden_act", "gelu")), S),
        KV("clip.vision.mm_hidden_size", int(v["mm_hidden_size"]), U32),
    ]


FILE_TYPES = {
    "BF16": LlamaFileType.MOSTLY_BF16,
    "F16": LlamaFileType.MOSTLY_F16,
    "F32": LlamaFileType.ALL_F32,
}


def mmproj_kvs(cfg: K3Config, meta_dir: Path) -> list[KV]:
    """The mmproj's metadata; its file type is its matrices' (the source's float type)."""
    return clip_kvs(cfg, preprocessor_config(meta_dir), int(FILE_TYPES[source_dtype(cfg)]))


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
    file_name="mmproj-{basename}-{type}.gguf",  # (as publishers name it: mmproj-BF16.gguf)
    type_name=source_dtype,  # (what mmproj_kvs says its file type is)
)
