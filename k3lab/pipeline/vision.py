"""Vision: the MoonViT tower and the patchmergerv2 projector -> one mmproj GGUF, lossless.

The same pipeline as the text shards with another front and back: ``VISION_RULES`` (rules.py)
instead of ``RULES``, llama.cpp's ``clip`` keys instead of ``kimi-k3`` ones, and one file. The
keys follow llama.cpp's Kimi-K2.5 converter (``KimiK25Model``: projector type ``kimik25``, the
``vision.pos_emb_*`` keys); K3's own hyperparameters are recorded beside them as
``clip.vision.*`` keys (see ``CLIP_K3_KEYS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from k3lab.formats.files import read_json
from k3lab.formats.gguf_stream import KV
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.layout import vision_layout
from k3lab.kimi_k3.rules import VISION_RULES
from k3lab.pipeline.convert import Reader, write_tensors
from k3lab.pipeline.folder import OutputFolder
from k3lab.pipeline.plan import OTHER_PREFIXES, PlanError, PlannedTensor, plan_tensor
from k3lab.pipeline.sources import LocalSource

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
            raise PlanError(f"{path}: not a JSON object")
        cfg.update(given)
    return cfg


def clip_kvs(cfg: K3Config, pre: dict[str, Any], file_type: int = 32) -> list[KV]:
    """The mmproj metadata: Kimi-K2.5's keys with K3's values, then K3's own."""
    v = cfg.vision
    patch = int(v["patch_size"])
    merge_kernel = [int(x) for x in v["merge_kernel_size"]]
    return [
        KV("general.architecture", CLIP_ARCH, S),
        KV("general.name", "Kimi-K3 MoonViT mmproj", S),
        KV("general.file_type", file_type, U32),
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


def plan_vision(cfg: K3Config, source: Any) -> list[PlannedTensor]:
    """Every vision_tower.* and mm_projector.* tensor, each used exactly once."""
    cfg.check_vision()
    names = [n for n in source.weight_map if n.startswith(OTHER_PREFIXES)]
    if not names:
        raise PlanError(f"{source.index_path}: no vision_tower.* or mm_projector.* tensors")
    where = source.weight_map[names[0]]
    expected = vision_layout(cfg)
    planned: list[PlannedTensor] = []
    for bid in [None, *range(int(cfg.vision["vt_num_hidden_layers"]))]:
        for rule in VISION_RULES:
            pt = plan_tensor(rule, cfg, source, bid, "auto", where, expected)
            if pt is not None:
                planned.append(pt)
    used = {n for pt in planned for n in pt.sources}
    unused = [n for n in names if n not in used]
    if unused:
        raise PlanError(f"{source.weight_map[unused[0]]}: tensor {unused[0]} is not used by any vision rule")
    return planned


def convert_vision(meta_dir: str | Path, src_dir: str | Path, out: str | Path) -> Path:
    """Write the mmproj GGUF and its manifest record (``OUT_DIR/.k3lab/mmproj.json``): planned and
    checked first (``out`` may not be part of a split set), then written holding the folder's lock."""
    out = Path(out)
    folder = OutputFolder(out.parent)
    folder.check_single_output(out)
    cfg = K3Config.load(meta_dir)
    source = LocalSource(src_dir, meta_dir)
    planned = plan_vision(cfg, source)
    files = sorted({source.weight_map[n] for pt in planned for n in pt.sources})
    entries = {n: e for f in files for n, e in source.header(f).items()}
    kvs = clip_kvs(cfg, preprocessor_config(meta_dir))
    with folder.hold():
        folder.check_single_output(out)  # (a plan saved meanwhile)
        return _write_mmproj(folder, out, kvs, planned, source, entries)


def _write_mmproj(
    folder: OutputFolder,
    out: Path,
    kvs: list[KV],
    planned: list[PlannedTensor],
    source: LocalSource,
    entries: dict,
) -> Path:
    files = sorted({source.weight_map[n] for n in entries})
    try:
        records, data_start = write_tensors(
            out,
            CLIP_ARCH,
            kvs,
            planned,
            Reader(source, entries),
            {n: source.weight_map[n] for n in entries},
        )
    finally:
        for f in files:
            source.release(f)
    folder.record_single(out, "vision", "mmproj", data_start, records)
    return out


def convert_tokenizer(meta_dir: str | Path, out: str | Path, chat_template: str | None = None) -> Path:
    """The standalone tokenizer GGUF (vocabulary and hyperparameters, no tensors), with its manifest
    record beside it, written holding the folder's lock."""
    from k3lab.formats.gguf_stream import write_metadata_only
    from k3lab.kimi_k3.keys import ARCH
    from k3lab.kimi_k3.tokenizer import tokenizer_kvs

    out = Path(out)
    folder = OutputFolder(out.parent)
    folder.check_single_output(out)
    kvs = tokenizer_kvs(meta_dir, chat_template)  # every input checked before the folder is touched
    with folder.hold():
        folder.check_single_output(out)
        write_metadata_only(out, ARCH, kvs)
        folder.record_single(out, "tokenizer", "tokenizer", out.stat().st_size, [])
    return out
