"""Configs of the synthetic checkpoints: the real Kimi-K3 config, and small ones shaped like it.

Every preset carries every key of the real ``text_config`` / ``vision_config`` /
``quantization_config``; only sizes change. ``testmodel`` is the published unquantized test model
(inference-optimization/Kimi-K3-0.40B: its config as the facts file records it, float32, plain
experts, no gate_lower_bound, rope keys present, a 163,840-id vocabulary, ~1.6 GB in one
``model.safetensors``); ``tiny-f32`` is that shape (float32, plain experts, no gate_lower_bound,
head_dim 74) at tiny's size, for quick checks of the unquantized path.
"""

from __future__ import annotations

import copy
from typing import Any

N_SPECIAL = 256  # special tokens sit at the top of the vocabulary

QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "float",
                "scale_dtype": "torch.uint8",
            },
        }
    },
    "format": "mxfp4-pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|down)_proj.*",
        "lm_head",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _full_attn_layers(n_layer: int, every: int) -> list[int]:
    """1-based MLA layers: every `every`-th layer, and always the last (K3: 4, 8, ..., 92, 93)."""
    layers = list(range(every, n_layer + 1, every))
    if layers[-1] != n_layer:
        layers.append(n_layer)
    return layers


def real_config() -> dict[str, Any]:
    """moonshotai/Kimi-K3 config.json, as the facts file records it."""
    n_layer = 93
    full = _full_attn_layers(n_layer, 4)
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 33792,
        "num_hidden_layers": n_layer,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "vocab_size": 163840,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, n_layer + 1) if i not in full],
            "head_dim": 128,
            "num_heads": 96,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
    }
    vision = {
        "model_type": "moonvit",
        "vt_num_hidden_layers": 27,
        "vt_hidden_size": 1024,
        "vt_intermediate_size": 4096,
        "vt_num_attention_heads": 12,
        "qkv_hidden_size": 1536,
        "patch_size": 14,
        "norm_type": "rmsnorm",
        "attn_bias": False,
        "linear_bias": False,
        "patch_embed_proj_bias": False,
        "pos_emb_interpolation_mode": "bilinear",
        "init_pos_emb_height": 64,
        "init_pos_emb_width": 64,
        "init_pos_emb_time": 4,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": 1024,
        "text_hidden_size": 7168,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
    }


def _small(
    n_layer: int,
    *,
    vocab: int,
    hidden: int,
    heads: int,
    ff: int,
    q_lora: int,
    kv_lora: int,
    nope: int,
    rope: int,
    v: int,
    kda_head: int,
    experts: int,
    topk: int,
    shared: int,
    moe_ff: int,
    latent: int | None,
    res_block: int,
    vt_layers: int,
    vt_hidden: int,
    full_every: int = 4,
) -> dict:
    cfg = real_config()
    t, vis = cfg["text_config"], cfg["vision_config"]
    full = _full_attn_layers(n_layer, full_every)
    t.update(
        {
            "hidden_size": hidden,
            "intermediate_size": ff,
            "num_hidden_layers": n_layer,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "vocab_size": vocab,
            "max_position_embeddings": 4096,
            "attn_res_block_size": res_block,
            "q_lora_rank": q_lora,
            "kv_lora_rank": kv_lora,
            "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope,
            "v_head_dim": v,
            "moe_intermediate_size": moe_ff,
            "routed_expert_hidden_size": latent,
            "num_experts": experts,
            "num_experts_per_token": topk,
            "num_shared_experts": shared,
        }
    )
    if latent is None:
        del t["routed_expert_hidden_size"]
    t["linear_attn_config"].update(
        {
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, n_layer + 1) if i not in full],
            "head_dim": kda_head,
            "num_heads": heads,
        }
    )
    bos, eos, pad = vocab - N_SPECIAL, vocab - N_SPECIAL + 2, vocab - 1
    for d in (cfg, t):
        d.update({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})
    cfg["media_placeholder_token_id"] = vocab - N_SPECIAL + 21
    vis.update(
        {
            "vt_num_hidden_layers": vt_layers,
            "vt_hidden_size": vt_hidden,
            "vt_intermediate_size": 4 * vt_hidden,
            "vt_num_attention_heads": 2,
            "qkv_hidden_size": vt_hidden,
            "init_pos_emb_height": 8,
            "init_pos_emb_width": 8,
            "mm_hidden_size": vt_hidden,
            "text_hidden_size": hidden,
        }
    )
    return cfg


def tiny_config() -> dict[str, Any]:
    """8 layers (MLA at 1-based 4 and 8), 8 experts top-2, 2 shared, latent MoE, AttnRes block 4."""
    return _small(
        8,
        vocab=1792,
        hidden=128,
        heads=4,
        ff=256,
        q_lora=64,
        kv_lora=64,
        nope=32,
        rope=16,
        v=32,
        kda_head=32,
        experts=8,
        topk=2,
        shared=2,
        moe_ff=64,
        latent=96,
        res_block=4,
        vt_layers=2,
        vt_hidden=64,
    )


def testmodel_config() -> dict[str, Any]:
    """inference-optimization/Kimi-K3-0.40B's config.json (the facts file's record of it)."""
    cfg = real_config()
    t, vis = cfg["text_config"], cfg["vision_config"]
    del t["quantization_config"]
    del t["linear_attn_config"]["gate_lower_bound"]
    t.update(
        {
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 74,
            "vocab_size": 163840,
            "max_position_embeddings": 4096,
            "attn_res_block_size": 4,
            "q_lora_rank": 256,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "num_experts": 8,
            "num_experts_per_token": 2,
            "num_shared_experts": 1,
            "moe_intermediate_size": 256,
            "routed_expert_hidden_size": 512,
            "first_k_dense_replace": 1,
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "torch_dtype": "float32",
        }
    )
    t["linear_attn_config"].update(
        {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 8, "head_dim": 32}
    )
    vis.update(
        {
            "vt_num_hidden_layers": 2,
            "vt_hidden_size": 256,
            "vt_intermediate_size": 512,
            "vt_num_attention_heads": 4,
            "qkv_hidden_size": 1536,
            "mm_hidden_size": 256,
            "text_hidden_size": 1024,
        }
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        del cfg[key]
    cfg["dtype"] = "float32"
    return cfg


def tiny_f32_config() -> dict[str, Any]:
    """The 0.40B's shape (unquantized float32, plain experts, no gate_lower_bound) at tiny's size."""
    cfg = tiny_config()
    cfg["text_config"]["num_shared_experts"] = 1
    t = cfg["text_config"]
    del t["quantization_config"]
    del t["linear_attn_config"]["gate_lower_bound"]
    t.update(
        {
            "head_dim": 74,
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "torch_dtype": "float32",
        }
    )
    cfg["dtype"] = "float32"
    return cfg


def preprocessor_config(vision: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json as Moonshot's processor keeps it (``KimiK3VisionProcessor(media_proc_cfg)``:
    its ``merge_kernel_size`` one int, every key it reads present)."""
    return {
        "media_proc_cfg": {
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "patch_size": vision["patch_size"],
            "merge_kernel_size": int(vision["merge_kernel_size"][0]),
            "in_patch_limit": 16384,
            "patch_limit_on_one_side": 512,
            "fixed_output_tokens": None,
        },
        "image_processor_type": "KimiK3VisionProcessor",
    }


def layer_config(layers: int = 2) -> dict[str, Any]:
    """MoE layers at the real expert dims (latent 3584, expert ff 3072), after one dense layer
    (``layers`` in all), for benchmarks."""
    return _small(layers, vocab=1792, hidden=1024, heads=8, ff=2048, q_lora=256, kv_lora=128, nope=64,
                  rope=32, v=64, kda_head=64, experts=16, topk=8, shared=1, moe_ff=3072, latent=3584,
                  res_block=4, vt_layers=1, vt_hidden=64, full_every=2)  # fmt: skip


def widths_config() -> dict[str, Any]:
    """Kimi-K3's row widths in miniature: every width that is a multiple of 256 in the real model
    (hidden 7168, the LoRA ranks, latent 3584, expert ff 3072...) is 256 or 512 here, every other is
    the real one (head dims 128, rope 64); 4 experts (more than llama.cpp's "8 experts" rules, as
    Kimi-K3's 896); 6 layers. So llama.cpp's quantiser treats each tensor as it treats Kimi-K3's
    (the same fallbacks, the same mix), on a checkpoint of a few MB."""
    return _small(6, vocab=1792, hidden=256, heads=2, ff=256, q_lora=256, kv_lora=256, nope=128, rope=64,
                  v=128, kda_head=128, experts=4, topk=2, shared=2, moe_ff=256, latent=256, res_block=4,
                  vt_layers=1, vt_hidden=64, full_every=3)  # fmt: skip


PRESETS = {
    "tiny": tiny_config,
    "widths": widths_config,
    "tiny-f32": tiny_f32_config,
    "testmodel": testmodel_config,
    "layer": layer_config,
    "full": real_config,
}
PRESET_LAYOUT = {"testmodel": "one-file"}  # as it is published; the others as Moonshot ships K3
