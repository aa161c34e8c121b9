"""The Kimi-K3 config as a typed, validated object, with the facts derived from it.

Reads the checkpoint's ``config.json`` (top level + ``text_config`` + ``vision_config``). A
missing required key is one clear error naming the file and the key; optional keys (the
published 0.40B test model lacks ``gate_lower_bound`` and ``quantization_config``) are None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError


class ConfigError(K3LabError):
    """config.json is missing a key or holds a value k3lab cannot convert."""


TEXT_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "attn_res_block_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "moe_renormalize",
    "moe_router_activation_func",
    "routed_scaling_factor",
    "linear_attn_config",
)
LINEAR_ATTN_REQUIRED = ("full_attn_layers", "head_dim", "num_heads", "short_conv_kernel_size")
MXFP4_FORMAT = "mxfp4-pack-quantized"


def _need(d: dict[str, Any], key: str, where: str, path: str) -> Any:
    if key not in d:
        raise ConfigError(f"{path}: {where} lacks required key '{key}'")
    return d[key]


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
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ConfigError(f"{path}: text_config is not an object")
        for key in TEXT_REQUIRED:
            _need(text, key, "text_config", path)
        lac = text["linear_attn_config"]
        for key in LINEAR_ATTN_REQUIRED:
            _need(lac, key, "text_config.linear_attn_config", path)
        n = int(text["num_hidden_layers"])
        full = [int(x) for x in lac["full_attn_layers"]]
        bad = [x for x in full if not 1 <= x <= n]
        if bad:
            raise ConfigError(f"{path}: linear_attn_config.full_attn_layers has {bad[0]} outside 1..{n}")
        if text["hidden_act"] != "situ":
            raise ConfigError(f"{path}: hidden_act is {text['hidden_act']!r}; Kimi-K3 uses 'situ'")
        if text["moe_router_activation_func"] != "sigmoid":
            raise ConfigError(
                f"{path}: moe_router_activation_func {text['moe_router_activation_func']!r} is not sigmoid"
            )
        if text.get("mla_use_nope") is False:
            raise ConfigError(f"{path}: mla_use_nope is false; Kimi-K3's MLA is NoPE")
        q = text.get("quantization_config")
        if q is not None and not (
            q.get("quant_method") == "compressed-tensors" and q.get("format") == MXFP4_FORMAT
        ):
            raise ConfigError(
                f"{path}: quantization_config {q.get('quant_method')}/{q.get('format')} is not "
                f"compressed-tensors/{MXFP4_FORMAT}"
            )
        mla = tuple(i for i in range(n) if i + 1 in full)
        kda = tuple(i for i in range(n) if i + 1 not in full)
        return cls(
            raw=raw,
            text=text,
            vision=raw.get("vision_config") or {},
            path=path,
            mla_layers=mla,
            kda_layers=kda,
        )

    @classmethod
    def load(cls, meta_dir: str | Path) -> K3Config:
        path = Path(meta_dir) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
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
