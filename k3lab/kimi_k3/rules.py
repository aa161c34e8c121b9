"""The one rule table: Kimi-K3 checkpoint names -> llama.cpp ``kimi-k3`` GGUF names.

A rule names its output (``{bid}`` is the layer), its source tensors (``{e}`` expands over the
routed experts), the transform (``transforms.TRANSFORMS``), the output type policy and which
layers it applies to. The planner, ``k3lab tensor-map`` (TENSOR_MAP.md) and the notebooks all
read this table; nothing else knows a tensor name.

Type policies, as upstream llama.cpp's converter writes them:
  keep   matrices keep their dtype (BF16 stays BF16); ``--outtype`` converts them
  f32    1-D tensors, the conv1d kernels and the router are F32
  mxfp4  routed experts, repacked (not dequantised) into ggml MXFP4
"""

from __future__ import annotations

import re

from k3lab.kimi_k3.config import K3Config
from k3lab.pipeline.model import ALL, ANY, OUTPUT, Rule, rules_digest

TEXT_PREFIX = "language_model."
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


_TEXT_LAYERS = TEXT_PREFIX + "model.layers."  # (holds no other "layers.": its number is the first match)


def layer_of(name: str) -> int | None:
    """The layer a checkpoint tensor name belongs to (``...layers.N....``), or None."""
    if name.startswith(_TEXT_LAYERS):  # (the text model's 500,000 names: cut, not searched)
        number, dot, _ = name[len(_TEXT_LAYERS) :].partition(".")
        if dot and number.isdecimal():  # (what ``\d+`` matches: Unicode's decimal digits)
            return int(number)
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


# which units a rule applies to (besides the pipeline's ALL and OUTPUT)
KDA, MLA, DENSE, MOE, LATENT = "kda", "mla", "dense", "moe", "latent"
VISION, VBLOCK = "vision", "vblock"  # the mmproj file: once, and per MoonViT block
# what the checkpoint must look like for the rule to apply (besides ANY)
QUANTIZED, FLOAT, ATTN_RES = "mxfp4", "float", "attn_res"


def rule_applies(rule: Rule, cfg: K3Config, bid: int | None) -> bool:
    return rule.applies(unit_tags(cfg, bid), config_tags(cfg))


def unit_tags(cfg: K3Config, bid: int | None) -> frozenset[str]:
    """Which rules a unit of the text model takes: every layer ``all``, its attention (``kda`` or
    ``mla``) and its FFN (``dense``, or ``moe`` and for a latent MoE ``latent``); then ``output``."""
    if bid is None:
        return frozenset({OUTPUT})
    tags = {ALL, MLA if cfg.is_mla(bid) else KDA, MOE if cfg.is_moe(bid) else DENSE}
    if cfg.is_moe(bid) and cfg.is_latent_moe:
        tags.add(LATENT)
    return frozenset(tags)


def config_tags(cfg: K3Config) -> frozenset[str]:
    """What the config says the checkpoint may be: MXFP4 experts (a quantization_config; the
    headers say whether they are), with or without AttnRes."""
    tags = {QUANTIZED if cfg.is_mxfp4 else FLOAT}
    if cfg["attn_res_block_size"]:
        tags.add(ATTN_RES)
    return frozenset(tags)


def vision_unit_tags(cfg: K3Config, bid: int | None) -> frozenset[str]:
    return frozenset({VISION} if bid is None else {VBLOCK})


def _text(*args: object, **kwargs: object) -> Rule:
    """A rule of the text model: its source names start with ``language_model.``."""
    return Rule(*args, **{"prefix": TEXT_PREFIX, **kwargs})  # type: ignore[arg-type]


L = "model.layers.{bid}."
A = L + "self_attn."
M = L + "block_sparse_moe."
RES = "res_score: AttnRes norm*proj fused"

RULES: tuple[Rule, ...] = (
    _text("token_embd.weight", ("model.embed_tokens.weight",), layers=OUTPUT),
    _text("output_norm.weight", ("model.norm.weight",), dtype="f32", layers=OUTPUT),
    _text("output.weight", ("lm_head.weight",), layers=OUTPUT),
    _text(
        "output_res_score.weight",
        ("model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"),
        "fuse_res_score",
        "f32",
        OUTPUT,
        ATTN_RES,
        RES,
    ),
    _text("blk.{bid}.attn_norm.weight", (L + "input_layernorm.weight",), dtype="f32"),
    _text("blk.{bid}.ffn_norm.weight", (L + "post_attention_layernorm.weight",), dtype="f32"),
    _text(
        "blk.{bid}.attn_res_score.weight",
        (L + "self_attention_res_norm.weight", L + "self_attention_res_proj.weight"),
        "fuse_res_score",
        "f32",
        ALL,
        ATTN_RES,
        RES,
    ),
    _text(
        "blk.{bid}.ffn_res_score.weight",
        (L + "mlp_res_norm.weight", L + "mlp_res_proj.weight"),
        "fuse_res_score",
        "f32",
        ALL,
        ATTN_RES,
        RES,
    ),
    # KDA (linear attention) layers
    _text("blk.{bid}.attn_q.weight", (A + "q_proj.weight",), layers=KDA),
    _text("blk.{bid}.attn_k.weight", (A + "k_proj.weight",), layers=KDA),
    _text("blk.{bid}.attn_v.weight", (A + "v_proj.weight",), layers=KDA),
    _text("blk.{bid}.ssm_conv1d_q.weight", (A + "q_conv1d.weight",), "conv1d_4d", "f32", KDA),
    _text("blk.{bid}.ssm_conv1d_k.weight", (A + "k_conv1d.weight",), "conv1d_4d", "f32", KDA),
    _text("blk.{bid}.ssm_conv1d_v.weight", (A + "v_conv1d.weight",), "conv1d_4d", "f32", KDA),
    _text("blk.{bid}.ssm_f_a.weight", (A + "f_a_proj.weight",), layers=KDA),
    _text("blk.{bid}.ssm_f_b.weight", (A + "f_b_proj.weight",), layers=KDA),
    _text("blk.{bid}.ssm_beta.weight", (A + "b_proj.weight",), layers=KDA),
    _text("blk.{bid}.ssm_a", (A + "A_log",), "neg_exp", "f32", KDA, note="ssm_a = -exp(A_log)"),
    _text("blk.{bid}.ssm_dt.bias", (A + "dt_bias",), dtype="f32", layers=KDA),
    _text(
        "blk.{bid}.ssm_g.weight",
        (A + "g_proj.weight",),
        layers=KDA,
        note="g_proj on a KDA layer: full-rank gate",
    ),
    _text("blk.{bid}.ssm_norm.weight", (A + "o_norm.weight",), dtype="f32", layers=KDA),
    _text("blk.{bid}.attn_output.weight", (A + "o_proj.weight",)),
    # MLA (full attention) layers
    _text("blk.{bid}.attn_q_a.weight", (A + "q_a_proj.weight",), layers=MLA),
    _text("blk.{bid}.attn_q_a_norm.weight", (A + "q_a_layernorm.weight",), dtype="f32", layers=MLA),
    _text("blk.{bid}.attn_q_b.weight", (A + "q_b_proj.weight",), layers=MLA),
    _text("blk.{bid}.attn_kv_a_mqa.weight", (A + "kv_a_proj_with_mqa.weight",), layers=MLA),
    _text("blk.{bid}.attn_kv_a_norm.weight", (A + "kv_a_layernorm.weight",), dtype="f32", layers=MLA),
    _text(
        "blk.{bid}.attn_k_b.weight",
        (A + "kv_b_proj.weight",),
        "k_b",
        layers=MLA,
        note="kv_b split, K transposed",
    ),
    _text("blk.{bid}.attn_v_b.weight", (A + "kv_b_proj.weight",), "v_b", layers=MLA, note="kv_b split, V"),
    _text(
        "blk.{bid}.attn_gate.weight",
        (A + "g_proj.weight",),
        layers=MLA,
        note="g_proj on an MLA layer: output gate",
    ),
    # dense FFN (the leading layers)
    _text("blk.{bid}.ffn_gate.weight", (L + "mlp.gate_proj.weight",), layers=DENSE),
    _text("blk.{bid}.ffn_up.weight", (L + "mlp.up_proj.weight",), layers=DENSE),
    _text("blk.{bid}.ffn_down.weight", (L + "mlp.down_proj.weight",), layers=DENSE),
    # latent MoE
    _text("blk.{bid}.ffn_gate_inp.weight", (M + "gate.weight",), dtype="f32", layers=MOE),
    _text("blk.{bid}.exp_probs_b.bias", (M + "gate.e_score_correction_bias",), dtype="f32", layers=MOE),
    _text("blk.{bid}.ffn_gate_shexp.weight", (M + "shared_experts.gate_proj.weight",), layers=MOE),
    _text("blk.{bid}.ffn_up_shexp.weight", (M + "shared_experts.up_proj.weight",), layers=MOE),
    _text("blk.{bid}.ffn_down_shexp.weight", (M + "shared_experts.down_proj.weight",), layers=MOE),
    _text("blk.{bid}.ffn_routed_down.weight", (M + "routed_expert_down_proj.weight",), layers=LATENT),
    _text("blk.{bid}.ffn_routed_up.weight", (M + "routed_expert_up_proj.weight",), layers=LATENT),
    _text("blk.{bid}.ffn_routed_norm.weight", (M + "routed_expert_norm.weight",), dtype="f32", layers=LATENT),
    _text(
        "blk.{bid}.ffn_gate_exps.weight",
        (M + "experts.{e}.w1.weight_packed", M + "experts.{e}.w1.weight_scale"),
        "mxfp4_stack",
        "mxfp4",
        MOE,
        QUANTIZED,
        "w1 = gate",
    ),
    _text(
        "blk.{bid}.ffn_down_exps.weight",
        (M + "experts.{e}.w2.weight_packed", M + "experts.{e}.w2.weight_scale"),
        "mxfp4_stack",
        "mxfp4",
        MOE,
        QUANTIZED,
        "w2 = down",
    ),
    _text(
        "blk.{bid}.ffn_up_exps.weight",
        (M + "experts.{e}.w3.weight_packed", M + "experts.{e}.w3.weight_scale"),
        "mxfp4_stack",
        "mxfp4",
        MOE,
        QUANTIZED,
        "w3 = up",
    ),
    # plain experts (an unquantized checkpoint, or a re-save that dequantised them): the headers say
    # which form a checkpoint holds, not the config (the planner takes the variant whose sources it has)
    _text(
        "blk.{bid}.ffn_gate_exps.weight",
        (M + "experts.{e}.w1.weight",),
        "stack",
        "keep",
        MOE,
        ANY,
        "w1 = gate; plain experts",
    ),
    _text(
        "blk.{bid}.ffn_down_exps.weight",
        (M + "experts.{e}.w2.weight",),
        "stack",
        "keep",
        MOE,
        ANY,
        "w2 = down; plain experts",
    ),
    _text(
        "blk.{bid}.ffn_up_exps.weight",
        (M + "experts.{e}.w3.weight",),
        "stack",
        "keep",
        MOE,
        ANY,
        "w3 = up; plain experts",
    ),
)

# a saved plan names rules by position: it is only reused by the same table
RULES_DIGEST = rules_digest(RULES)


# MoonViT tower + patchmergerv2 projector -> one mmproj GGUF in the ``kimik3`` convention (the one
# llama.cpp that runs K3's tower reads it so: unsloth's fork, PR #70). Norms and the position table
# F32 (exact widening), the patch conv F32 (a conv kernel ggml wants in F32/F16), every matrix as the
# source (BF16 stays BF16 byte for byte). The tower has no biases and no time weight: a tensor the
# table does not name is one error, never dropped or guessed.
VT, VB, MP = "vision_tower.", "vision_tower.encoder.blocks.{bid}.", "mm_projector."


def _vision(
    output: str,
    source: str,
    transform: str = "copy",
    dtype: str = "keep",
    layers: str = VISION,
    note: str = "",
) -> Rule:
    return Rule(output, (source,), transform, dtype, layers, ANY, note, prefix="")


VISION_RULES: tuple[Rule, ...] = (
    _vision("v.patch_embd.weight", VT + "patch_embed.proj.weight", dtype="f32", note="the patch conv, F32"),
    _vision(
        "v.position_embd.weight",
        VT + "patch_embed.pos_emb.weight",
        dtype="f32",
        note="[H, W, C] kept 3-D (the runtime reads the grid from it), F32",
    ),
    _vision("v.blk.{bid}.ln1.weight", VB + "norm0.weight", dtype="f32", layers=VBLOCK),
    _vision(
        "v.blk.{bid}.attn_qkv.weight",
        VB + "wqkv.weight",
        "qkv_rope_split",
        layers=VBLOCK,
        note="fused qkv; Q and K rows de-interleaved per head for the runtime's 2-D RoPE",
    ),
    _vision("v.blk.{bid}.attn_out.weight", VB + "wo.weight", layers=VBLOCK),
    _vision("v.blk.{bid}.ln2.weight", VB + "norm1.weight", dtype="f32", layers=VBLOCK),
    _vision("v.blk.{bid}.ffn_up.weight", VB + "mlp.fc0.weight", layers=VBLOCK),
    _vision("v.blk.{bid}.ffn_down.weight", VB + "mlp.fc1.weight", layers=VBLOCK),
    _vision("v.post_ln.weight", VT + "encoder.final_layernorm.weight", dtype="f32"),
    _vision("mm.1.weight", MP + "proj.0.weight", note="patchmergerv2 first linear"),
    _vision("mm.2.weight", MP + "proj.2.weight", note="patchmergerv2 second linear"),
    _vision(
        "mm.post_norm.weight", MP + "post_norm.weight", dtype="f32", note="the RMSNorm after the projector"
    ),
)


def expert_tensor(layer: int, expert: int, proj: str, part: str) -> str:
    """A routed expert's source tensor: ``proj`` w1/w2/w3, ``part`` weight_packed/weight_scale/weight."""
    return TEXT_PREFIX + M.format(bid=layer) + f"experts.{expert}.{proj}.{part}"


def expert_of(name: str, layer: int, proj: str, part: str) -> int | None:
    """The expert a source tensor name is, for that layer, projection and part; else None."""
    head, tail = TEXT_PREFIX + M.format(bid=layer) + "experts.", f".{proj}.{part}"
    if name.startswith(head) and name.endswith(tail) and name[len(head) : -len(tail)].isdigit():
        return int(name[len(head) : -len(tail)])
    return None


def vision_block_prefix(block: int) -> str:
    return VB.format(bid=block)


def expert_dims(cfg: K3Config, output: str) -> tuple[int, int]:
    """(rows, cols) of one routed expert matrix of a stacked output (gate/up: ff x latent)."""
    ff, lat = cfg["moe_intermediate_size"], cfg.latent_dim
    return (lat, ff) if "down_exps" in output else (ff, lat)
