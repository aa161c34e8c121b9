"""Which tensors a Kimi-K3 checkpoint holds, with dtype and shape, shard by shard, from its config.

The planner checks every source tensor against this (a header whose shape disagrees with the config
is one error before anything is written) and ``k3lab synth`` writes checkpoints from it.

This is the published layout: shard k (1..n_layer) holds exactly layer k-1; shard n_layer+1 the
embeddings, lm_head, final norm and output AttnRes pair; then one shard of ``mm_projector`` and
one of ``vision_tower``. Routed experts are compressed-tensors MXFP4 (``weight_packed`` +
``weight_scale``) when the config has a quantization_config, plain ``weight`` otherwise.
"""

from __future__ import annotations

from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.rules import TEXT_PREFIX
from k3lab.pipeline.model import TensorSpec

LM = TEXT_PREFIX


def _text_layer(cfg: K3Config, i: int, float_dtype: str) -> list[TensorSpec]:
    t = cfg.text
    H, f = cfg.n_embd, float_dtype
    p = f"{LM}model.layers.{i}."
    specs = [
        TensorSpec(p + "input_layernorm.weight", f, (H,), "norm"),
        TensorSpec(p + "post_attention_layernorm.weight", f, (H,), "norm"),
    ]
    if t["attn_res_block_size"]:
        for pair in ("self_attention_res", "mlp_res"):
            specs += [
                TensorSpec(p + f"{pair}_norm.weight", f, (H,), "norm"),
                TensorSpec(p + f"{pair}_proj.weight", f, (1, H), "res_proj"),
            ]
    a = p + "self_attn."
    if cfg.is_mla(i):
        nh, nope, rope, v = cfg.n_head, t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
        ql, kvl = t.get("q_lora_rank"), t["kv_lora_rank"]
        specs += [
            TensorSpec(a + "q_a_proj.weight", f, (ql, H), "linear"),
            TensorSpec(a + "q_a_layernorm.weight", f, (ql,), "norm"),
            TensorSpec(a + "q_b_proj.weight", f, (nh * (nope + rope), ql), "linear"),
            TensorSpec(a + "kv_a_proj_with_mqa.weight", f, (kvl + rope, H), "linear"),
            TensorSpec(a + "kv_a_layernorm.weight", f, (kvl,), "norm"),
            TensorSpec(a + "kv_b_proj.weight", f, (nh * (nope + v), kvl), "linear"),
            TensorSpec(a + "g_proj.weight", f, (nh * v, H), "linear"),
            TensorSpec(a + "o_proj.weight", f, (H, nh * v), "linear"),
        ]
    else:
        hd, nh, k = cfg.kda_head_dim, cfg.kda_n_head, cfg.linear_attn["short_conv_kernel_size"]
        d = hd * nh
        specs += [TensorSpec(a + f"{x}_proj.weight", f, (d, H), "linear") for x in ("q", "k", "v")]
        specs += [TensorSpec(a + f"{x}_conv1d.weight", f, (d, 1, k), "conv") for x in ("q", "k", "v")]
        specs += [
            TensorSpec(a + "g_proj.weight", f, (d, H), "linear"),
            TensorSpec(a + "f_a_proj.weight", f, (hd, H), "linear"),
            TensorSpec(a + "f_b_proj.weight", f, (d, hd), "linear"),
            TensorSpec(a + "b_proj.weight", f, (nh, H), "linear"),
            TensorSpec(a + "o_norm.weight", f, (hd,), "norm"),
            TensorSpec(a + "o_proj.weight", f, (H, d), "linear"),
            TensorSpec(a + "dt_bias", "F32", (d,), "dt_bias"),
            TensorSpec(a + "A_log", "F32", (nh,), "a_log"),
        ]
    if not cfg.is_moe(i):
        ff = t["intermediate_size"]
        m = p + "mlp."
        specs += [
            TensorSpec(m + "gate_proj.weight", f, (ff, H), "linear"),
            TensorSpec(m + "up_proj.weight", f, (ff, H), "linear"),
            TensorSpec(m + "down_proj.weight", f, (H, ff), "linear"),
        ]
        return specs
    m = p + "block_sparse_moe."
    E, ff, L = cfg.n_expert, t["moe_intermediate_size"], cfg.latent_dim
    sh = ff * t["num_shared_experts"]
    specs += [
        TensorSpec(m + "gate.weight", f, (E, H), "linear"),
        TensorSpec(m + "gate.e_score_correction_bias", "F32", (E,), "router_bias"),
        TensorSpec(m + "shared_experts.gate_proj.weight", f, (sh, H), "linear"),
        TensorSpec(m + "shared_experts.up_proj.weight", f, (sh, H), "linear"),
        TensorSpec(m + "shared_experts.down_proj.weight", f, (H, sh), "linear"),
    ]
    if cfg.is_latent_moe:
        specs += [
            TensorSpec(m + "routed_expert_down_proj.weight", f, (L, H), "linear"),
            TensorSpec(m + "routed_expert_up_proj.weight", f, (H, L), "linear"),
        ]
        if t.get("latent_moe_use_norm", True):
            specs.append(TensorSpec(m + "routed_expert_norm.weight", f, (L,), "norm"))
    shapes = {"w1": (ff, L), "w2": (L, ff), "w3": (ff, L)}
    for e in range(E):
        for w, (rows, cols) in shapes.items():
            base = f"{m}experts.{e}.{w}."
            if cfg.is_mxfp4:
                specs += [
                    TensorSpec(base + "weight_packed", "U8", (rows, cols // 2), "mxfp4_packed"),
                    TensorSpec(base + "weight_scale", "U8", (rows, cols // 32), "mxfp4_scale"),
                ]
            else:
                specs.append(TensorSpec(base + "weight", f, (rows, cols), "linear"))
    return specs


def _output_shard(cfg: K3Config, f: str) -> list[TensorSpec]:
    H, V = cfg.n_embd, cfg.n_vocab
    specs = [
        TensorSpec(LM + "model.embed_tokens.weight", f, (V, H), "embed"),
        TensorSpec(LM + "model.norm.weight", f, (H,), "norm"),
        TensorSpec(LM + "lm_head.weight", f, (V, H), "lm_head"),
    ]
    if cfg["attn_res_block_size"]:
        specs += [
            TensorSpec(LM + "model.output_attn_res_norm.weight", f, (H,), "norm"),
            TensorSpec(LM + "model.output_attn_res_proj.weight", f, (1, H), "res_proj"),
        ]
    return specs


def _projector_shard(cfg: K3Config, f: str) -> list[TensorSpec]:
    v = cfg.vision
    C, T = v["mm_hidden_size"], v["text_hidden_size"]
    kh, kw = v["merge_kernel_size"]
    merged = C * kh * kw
    return [
        TensorSpec("mm_projector.pre_norm.weight", f, (C,), "norm"),
        TensorSpec("mm_projector.proj.0.weight", f, (merged, merged), "linear"),
        TensorSpec("mm_projector.proj.0.bias", f, (merged,), "bias"),
        TensorSpec("mm_projector.proj.2.weight", f, (T, merged), "linear"),
        TensorSpec("mm_projector.proj.2.bias", f, (T,), "bias"),
    ]


def _vision_shard(cfg: K3Config, f: str) -> list[TensorSpec]:
    v = cfg.vision
    C, ff, qkv, ps = v["vt_hidden_size"], v["vt_intermediate_size"], v["qkv_hidden_size"], v["patch_size"]
    p = "vision_tower."
    specs = [
        TensorSpec(p + "patch_embed.proj.weight", f, (C, 3, ps, ps), "patch"),
        TensorSpec(
            p + "patch_embed.pos_emb.weight", f, (v["init_pos_emb_height"], v["init_pos_emb_width"], C), "pos"
        ),
        TensorSpec(p + "patch_embed.pos_emb.time_weight", f, (v["init_pos_emb_time"], 1, C), "pos"),
    ]
    for i in range(v["vt_num_hidden_layers"]):
        b = f"{p}encoder.blocks.{i}."
        specs += [
            TensorSpec(b + "norm0.weight", f, (C,), "norm"),
            TensorSpec(b + "norm1.weight", f, (C,), "norm"),
            TensorSpec(b + "wqkv.weight", f, (3 * qkv, C), "linear"),
            TensorSpec(b + "wo.weight", f, (C, qkv), "linear"),
            TensorSpec(b + "mlp.fc0.weight", f, (ff, C), "linear"),
            TensorSpec(b + "mlp.fc1.weight", f, (C, ff), "linear"),
        ]
    specs.append(TensorSpec(p + "encoder.final_layernorm.weight", f, (C,), "norm"))
    return specs


def checkpoint_layout(cfg: K3Config) -> list[list[TensorSpec]]:
    """The tensors of each source shard, in shard order (index 0 is shard 1)."""
    f = source_dtype(cfg)
    shards = [_text_layer(cfg, i, f) for i in range(cfg.n_layer)]
    shards.append(_output_shard(cfg, f))
    if cfg.vision:
        shards += [_projector_shard(cfg, f), _vision_shard(cfg, f)]
    return shards


def source_dtype(cfg: K3Config) -> str:
    return "F32" if cfg.raw.get("dtype") == "float32" else "BF16"


def unit_layout(cfg: K3Config, bid: int | None) -> dict[str, TensorSpec]:
    """The source tensors of one unit of the text model (layer ``bid``, or None: the output
    tensors), by name: what the config says each must be."""
    f = source_dtype(cfg)
    specs = _text_layer(cfg, bid, f) if bid is not None else _output_shard(cfg, f)
    return {s.name: s for s in specs}


def vision_layout(cfg: K3Config) -> dict[str, TensorSpec]:
    """The vision tower's and projector's source tensors, by name."""
    f = source_dtype(cfg)
    return {s.name: s for s in (*_projector_shard(cfg, f), *_vision_shard(cfg, f))}


def shard_filename(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"
