"""The Kimi-K3 config as a typed, validated object, with the facts derived from it.

Reads the checkpoint's ``config.json`` (top level + ``text_config`` + ``vision_config``). A
missing required key is one clear error naming the file and the key; optional keys (the
published 0.40B test model lacks ``gate_lower_bound`` and ``quantization_config``) are None.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError, printable


class ConfigError(K3LabError):
    """config.json is missing a key or holds a value k3lab cannot convert."""


# what each key must be: every one is checked before anything is written
POS_INT, NONNEG_INT, POS_FLOAT, FLOAT, BOOL, STR, OBJ, INT_LIST = (
    "a positive integer",
    "an integer >= 0",
    "a positive number",
    "a number",
    "true or false",
    "a string",
    "an object",
    "a list of integers",
)
TEXT_REQUIRED: dict[str, str] = {
    "hidden_size": POS_INT,
    "intermediate_size": POS_INT,
    "num_hidden_layers": POS_INT,
    "num_attention_heads": POS_INT,
    "num_key_value_heads": POS_INT,
    "vocab_size": POS_INT,
    "max_position_embeddings": POS_INT,
    "rms_norm_eps": POS_FLOAT,
    "hidden_act": STR,
    "activation_situ_beta": POS_FLOAT,
    "activation_situ_linear_beta": POS_FLOAT,
    "attn_res_block_size": NONNEG_INT,
    "kv_lora_rank": POS_INT,
    "qk_nope_head_dim": POS_INT,
    "qk_rope_head_dim": NONNEG_INT,
    "v_head_dim": POS_INT,
    "first_k_dense_replace": NONNEG_INT,
    "moe_intermediate_size": POS_INT,
    "num_experts": POS_INT,
    "num_experts_per_token": POS_INT,
    "num_shared_experts": NONNEG_INT,
    "moe_renormalize": BOOL,
    "moe_router_activation_func": STR,
    "routed_scaling_factor": POS_FLOAT,
    "linear_attn_config": OBJ,
}
TEXT_OPTIONAL: dict[str, str] = {
    "q_lora_rank": POS_INT,
    "routed_expert_hidden_size": POS_INT,
    "mla_use_nope": BOOL,
    "rope_theta": POS_FLOAT,
    "quantization_config": OBJ,
    "n_group": POS_INT,
    "topk_group": POS_INT,
}
LINEAR_ATTN_REQUIRED: dict[str, str] = {
    "full_attn_layers": INT_LIST,
    "head_dim": POS_INT,
    "num_heads": POS_INT,
    "short_conv_kernel_size": POS_INT,
}
LINEAR_ATTN_OPTIONAL: dict[str, str] = {"gate_lower_bound": FLOAT, "kda_layers": INT_LIST}
TOP_OPTIONAL: dict[str, str] = {
    "bos_token_id": NONNEG_INT,
    "eos_token_id": NONNEG_INT,
    "pad_token_id": NONNEG_INT,
    "vision_config": OBJ,
    "quantization_config": OBJ,
}
VISION_REQUIRED: dict[str, str] = {
    "vt_num_hidden_layers": POS_INT,
    "vt_hidden_size": POS_INT,
    "vt_intermediate_size": POS_INT,
    "vt_num_attention_heads": POS_INT,
    "qkv_hidden_size": POS_INT,
    "patch_size": POS_INT,
    "init_pos_emb_height": POS_INT,
    "init_pos_emb_width": POS_INT,
    "init_pos_emb_time": POS_INT,
    "merge_kernel_size": INT_LIST,
    "merge_type": STR,
    "mm_projector_type": STR,
    "norm_type": STR,
    "mm_hidden_size": POS_INT,
}
VISION_OPTIONAL: dict[str, str] = {
    "text_hidden_size": POS_INT,
    "projector_ln_eps": POS_FLOAT,
    "projector_hidden_act": STR,
}
MXFP4_FORMAT = "mxfp4-pack-quantized"
INT_MAX = 2**31 - 1  # GGUF and llama.cpp hold these counts and sizes in 32 bits
# tighter bounds, checked before anything is sized by them: a split set numbers its files with 5
# digits (layers + the output tensors <= 99,999); the real model has 896 experts and 27 vision layers
UPPER: dict[str, int] = {
    "num_hidden_layers": 99_998,
    "num_experts": 1 << 16,
    "vt_num_hidden_layers": 1 << 12,
    "vocab_size": 1 << 24,
}


def _is(kind: str, v: Any) -> bool:
    """JSON types as k3lab needs them (a bool is not a number here, a string never is; an integer
    fits in 32 bits)."""
    is_int = isinstance(v, int) and not isinstance(v, bool) and abs(v) <= INT_MAX
    is_num = is_int or (isinstance(v, float) and math.isfinite(v))
    return {
        POS_INT: is_int and v > 0,
        NONNEG_INT: is_int and v >= 0,
        POS_FLOAT: is_num and v > 0,
        FLOAT: is_num,
        BOOL: isinstance(v, bool),
        STR: isinstance(v, str),
        OBJ: isinstance(v, dict),
        INT_LIST: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    }[kind]


def _check(d: dict[str, Any], schema: dict[str, str], where: str, path: str, required: bool) -> None:
    for key, kind in schema.items():
        if key not in d or (not required and d[key] is None):
            if required:
                raise ConfigError(f"{path}: {where} lacks required key '{key}'")
            continue
        upper = UPPER.get(key, INT_MAX)
        if not _is(kind, d[key]) or (kind in (POS_INT, NONNEG_INT) and d[key] > upper):
            shown = json.dumps(d[key])[:60]
            bound = f" up to {upper:,}" if kind in (POS_INT, NONNEG_INT) else ""
            raise ConfigError(
                f"{path}: {where}{'.' if where else ''}{key} is {shown}; expected {kind}{bound}"
            )


def _check_quantization(q: dict[str, Any], where: str, path: str) -> None:
    """compressed-tensors mxfp4-pack-quantized, 4-bit float groups of 32: what the repack assumes."""
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != MXFP4_FORMAT:
        raise ConfigError(
            f"{path}: {where} is {method}/{fmt}; k3lab converts compressed-tensors/{MXFP4_FORMAT} only"
        )
    groups = q.get("config_groups")
    if groups is None:
        return
    if not isinstance(groups, dict):
        raise ConfigError(f"{path}: {where}.config_groups is not an object")
    for key_name, group in groups.items():
        name = printable(str(key_name))  # (a stranger's key: said, never sent to the terminal raw)
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            raise ConfigError(f"{path}: {where}.config_groups.{name}.weights is missing or not an object")
        for key, want in (("num_bits", 4), ("type", "float"), ("group_size", 32)):
            if key in w and w[key] != want:
                raise ConfigError(
                    f"{path}: {where}.config_groups.{name}.weights.{key} is {w[key]!r}; MXFP4 needs {want!r}"
                )


def _check_consistency(t: dict[str, Any], lac: dict[str, Any], path: str) -> None:
    n = t["num_hidden_layers"]
    if t["num_experts_per_token"] > t["num_experts"]:
        raise ConfigError(
            f"{path}: text_config.num_experts_per_token {t['num_experts_per_token']} exceeds "
            f"num_experts {t['num_experts']}"
        )
    if t["first_k_dense_replace"] > n:
        raise ConfigError(
            f"{path}: text_config.first_k_dense_replace {t['first_k_dense_replace']} exceeds "
            f"num_hidden_layers {n}"
        )
    if t["num_attention_heads"] % t["num_key_value_heads"]:
        raise ConfigError(
            f"{path}: text_config.num_attention_heads {t['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads {t['num_key_value_heads']}"
        )
    full = lac["full_attn_layers"]
    bad = [x for x in full if not 1 <= x <= n]
    if bad:
        raise ConfigError(f"{path}: linear_attn_config.full_attn_layers has {bad[0]} outside 1..{n}")
    if len(set(full)) != len(full):
        raise ConfigError(f"{path}: linear_attn_config.full_attn_layers lists a layer twice")
    kda = lac.get("kda_layers")
    split = kda is None or (  # (counted, never expanded: n is bounded, but the lists may be long)
        len(set(kda)) == len(kda)
        and not set(kda) & set(full)
        and len(kda) + len(full) == n
        and all(1 <= x <= n for x in kda)
    )
    if not split:
        raise ConfigError(
            f"{path}: linear_attn_config.kda_layers and full_attn_layers must split layers 1..{n} between them"
        )


@dataclass(frozen=True)
class K3Config:
    raw: dict[str, Any]
    text: dict[str, Any]
    vision: dict[str, Any]
    path: str = "config.json"
    # derived
    mla_layers: tuple[int, ...] = field(default=())  # 0-based
    kda_layers: tuple[int, ...] = field(default=())

    # --- construction ---
    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "config.json") -> K3Config:
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a JSON object")
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ConfigError(f"{path}: text_config is not an object")
        _check(raw, TOP_OPTIONAL, "", path, required=False)
        _check(text, TEXT_REQUIRED, "text_config", path, required=True)
        _check(text, TEXT_OPTIONAL, "text_config", path, required=False)
        lac = text["linear_attn_config"]
        _check(lac, LINEAR_ATTN_REQUIRED, "text_config.linear_attn_config", path, required=True)
        _check(lac, LINEAR_ATTN_OPTIONAL, "text_config.linear_attn_config", path, required=False)
        _check_consistency(text, lac, path)
        n = text["num_hidden_layers"]
        full = lac["full_attn_layers"]
        if text["hidden_act"] != "situ":
            raise ConfigError(f"{path}: hidden_act is {text['hidden_act']!r}; Kimi-K3 uses 'situ'")
        if text["moe_router_activation_func"] != "sigmoid":
            raise ConfigError(
                f"{path}: moe_router_activation_func {text['moe_router_activation_func']!r} is not sigmoid"
            )
        if text.get("mla_use_nope") is False:
            raise ConfigError(f"{path}: mla_use_nope is false; Kimi-K3's MLA is NoPE")
        if text.get("quantization_config") is not None:
            _check_quantization(text["quantization_config"], "text_config.quantization_config", path)
        if raw is not text and raw.get("quantization_config") is not None:
            _check_quantization(raw["quantization_config"], "quantization_config", path)
        full_set = set(full)
        mla = tuple(sorted(x - 1 for x in full_set))
        kda = tuple(i for i in range(n) if i + 1 not in full_set)
        return cls(
            raw=raw,
            text=text,
            vision=raw.get("vision_config") or {},
            path=path,
            mla_layers=mla,
            kda_layers=kda,
        )

    def check_vision(self) -> None:
        """The vision_config keys the mmproj conversion reads (checked when it runs)."""
        if not self.vision:
            raise ConfigError(f"{self.path}: no vision_config")
        _check(self.vision, VISION_REQUIRED, "vision_config", self.path, required=True)
        _check(self.vision, VISION_OPTIONAL, "vision_config", self.path, required=False)
        v = self.vision
        if len(v["merge_kernel_size"]) != 2:
            raise ConfigError(f"{self.path}: vision_config.merge_kernel_size needs 2 entries")
        # what the kimik3 mmproj convention describes: MoonViT with RMSNorm and no biases,
        # patchmergerv2 over 2-D merges, heads whose width the 2-D RoPE splits in four
        described = {"norm_type": "rmsnorm", "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2"}
        for key, want in described.items():
            if v.get(key) != want:
                raise ConfigError(
                    f"{self.path}: vision_config.{key} is {v.get(key)!r}; the mmproj describes {want!r}"
                )
        for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if v.get(key):
                raise ConfigError(f"{self.path}: vision_config.{key} is true; Kimi-K3's tower has no biases")
        heads, qkv = int(v["vt_num_attention_heads"]), int(v["qkv_hidden_size"])
        if qkv % heads or (qkv // heads) % 4:
            raise ConfigError(
                f"{self.path}: vision_config.qkv_hidden_size {qkv} over {heads} heads is not a head width "
                "divisible by 4 (the 2-D RoPE turns it in four parts)"
            )

    @classmethod
    def load(cls, meta_dir: str | Path) -> K3Config:
        from k3lab.formats.files import InputFileError, read_json

        path = Path(meta_dir) / "config.json"
        try:
            raw = read_json(path, 16 * 1024 * 1024, "config")
        except InputFileError as e:
            raise ConfigError(str(e)) from None
        return cls.from_dict(raw, str(path))

    # --- plain facts ---
    def __getitem__(self, key: str) -> Any:
        return self.text[key]

    @property
    def n_layer(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def n_embd(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def n_head(self) -> int:
        return int(self.text["num_attention_heads"])

    @property
    def n_vocab(self) -> int:
        return int(self.text["vocab_size"])

    @property
    def n_expert(self) -> int:
        return int(self.text["num_experts"])

    @property
    def linear_attn(self) -> dict[str, Any]:
        return self.text["linear_attn_config"]

    @property
    def kda_head_dim(self) -> int:
        return int(self.linear_attn["head_dim"])

    @property
    def kda_n_head(self) -> int:
        return int(self.linear_attn["num_heads"])

    @property
    def gate_lower_bound(self) -> float | None:
        v = self.linear_attn.get("gate_lower_bound")
        return None if v is None else float(v)

    @property
    def n_dense_lead(self) -> int:
        return int(self.text["first_k_dense_replace"])

    @property
    def latent_dim(self) -> int:
        """Width the routed experts run at (routed_expert_hidden_size, else hidden_size)."""
        return int(self.text.get("routed_expert_hidden_size") or self.n_embd)

    @property
    def is_latent_moe(self) -> bool:
        return self.text.get("routed_expert_hidden_size") is not None

    @property
    def quantization(self) -> dict[str, Any] | None:
        return self.text.get("quantization_config") or self.raw.get("quantization_config")

    @property
    def is_mxfp4(self) -> bool:
        return self.quantization is not None

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_lead

    def token_id(self, key: str) -> int | None:
        """bos/eos/pad ids: the top level wins (K3), text_config as a fallback (test model)."""
        v = self.raw.get(key, self.text.get(key))
        return None if v is None else int(v)
