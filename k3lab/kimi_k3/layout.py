"""Which tensors a Kimi-K3 checkpoint holds, with dtype and shape, unit by unit, from its config.

The planner checks every source tensor against this (a header whose shape or dtype disagrees with
the config is one error before anything is written) and ``k3lab synth`` writes checkpoints from it.
Which file holds a tensor is not the model's business: the planner reads it from the index.

A tensor's float type is the one config.json declares (``torch_dtype``/``dtype``: BF16 for Kimi-K3,
F32 for the published 0.40B test model; F16 in a re-save), and the few Moonshot keeps in F32
(``A_log``, ``dt_bias``, the router's bias) may be F32 or that type. Routed experts are
compressed-tensors MXFP4 (``weight_packed`` + ``weight_scale``, U8) or plain ``weight``: a checkpoint
with a quantization_config may hold either (the headers say which), one without holds plain ones.

Facts for messages and for ``k3lab synth``: Moonshot's repo holds layer k-1 in shard k of 96
(``model-000NN-of-000096.safetensors``), the embeddings, lm_head, final norm and output AttnRes pair
in shard 94, ``mm_projector`` in 95 and ``vision_tower`` in 96; transformers' ``save_pretrained``
writes the tensors in module order (``save_order``) into size-based shards, or one
``model.safetensors`` below its shard size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from k3lab.errors import K3LabError
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.rules import TEXT_PREFIX
from k3lab.pipeline.model import TensorSpec

LM = TEXT_PREFIX


DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MOONSHOT_SHARDS = 96  # the real repo's file count (its names have five digits of six)


def declared_dtype(cfg: K3Config) -> str | None:
    """The float type config.json declares for the tensors (``text_config``'s, else the top level's)."""
    for d in (cfg.text, cfg.raw):
        for key in ("torch_dtype", "dtype"):
            if d.get(key) in DTYPES:
                return DTYPES[d[key]]
    return None


def _text_layer(cfg: K3Config, i: int, float_dtype: str, experts: str = "config") -> list[TensorSpec]:
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
    if experts == "config":
        experts = "mxfp4" if cfg.is_mxfp4 else "plain"
    for e in range(E):
        for w, (rows, cols) in shapes.items():
            base = f"{m}experts.{e}.{w}."
            if experts in ("mxfp4", "both"):
                specs += [
                    TensorSpec(base + "weight_packed", "U8", (rows, cols // 2), "mxfp4_packed"),
                    TensorSpec(base + "weight_scale", "U8", (rows, cols // 32), "mxfp4_scale"),
                ]
            if experts in ("plain", "both"):
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
    """patchmergerv2, as Moonshot's ``PatchMergerMLPV2`` holds it: two bias-free linears, then an
    RMSNorm over the text width (no norm before, no bias anywhere)."""
    v = cfg.vision
    C, T = v["mm_hidden_size"], v["text_hidden_size"]
    kh, kw = v["merge_kernel_size"]
    merged = C * kh * kw
    return [
        TensorSpec("mm_projector.proj.0.weight", f, (merged, merged), "linear"),
        TensorSpec("mm_projector.proj.2.weight", f, (T, merged), "linear"),
        TensorSpec("mm_projector.post_norm.weight", f, (T,), "norm"),
    ]


def _vision_shard(cfg: K3Config, f: str) -> list[TensorSpec]:
    """MoonViT-3d as the real checkpoint holds it: a bias-free patch conv, the 2-D position table
    (the time embedding is a buffer, never saved), bias-free blocks, the final RMSNorm."""
    v = cfg.vision
    C, ff, qkv, ps = v["vt_hidden_size"], v["vt_intermediate_size"], v["qkv_hidden_size"], v["patch_size"]
    p = "vision_tower."
    specs = [
        TensorSpec(p + "patch_embed.proj.weight", f, (C, 3, ps, ps), "patch"),
        TensorSpec(
            p + "patch_embed.pos_emb.weight", f, (v["init_pos_emb_height"], v["init_pos_emb_width"], C), "pos"
        ),
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
    """The tensors of each of Moonshot's shards, in shard order (index 0 is shard 1)."""
    f = source_dtype(cfg)
    shards = [_text_layer(cfg, i, f) for i in range(cfg.n_layer)]
    shards.append(_output_shard(cfg, f))
    if cfg.vision:
        shards += [_projector_shard(cfg, f), _vision_shard(cfg, f)]
    return shards


# where transformers' module order puts a tensor of a decoder layer: a module's own parameters
# (A_log, dt_bias) before its submodules, attention before the FFN before the norms
_LAYER_ORDER = (
    "self_attn.A_log", "self_attn.dt_bias", "self_attn.", "block_sparse_moe.experts.", "block_sparse_moe.gate.",
    "block_sparse_moe.", "mlp.", "input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
    "mlp_res_norm", "self_attention_res_proj", "mlp_res_proj",
)  # fmt: skip


def save_order(cfg: K3Config) -> list[TensorSpec]:
    """Every tensor in the order transformers' ``save_pretrained`` writes them (the module order of
    ``KimiK3ForConditionalGeneration``: the vision tower, the projector, then the text model's
    embeddings, layers, final norm and output AttnRes pair, and lm_head): what size-based shards cut."""
    f = source_dtype(cfg)
    out = (_vision_shard(cfg, f) + _projector_shard(cfg, f)) if cfg.vision else []
    output = _output_shard(cfg, f)
    out += [s for s in output if "embed_tokens" in s.name]
    for i in range(cfg.n_layer):
        prefix = f"{LM}model.layers.{i}."

        def rank(spec: TensorSpec, prefix: str = prefix) -> int:
            rest = spec.name[len(prefix) :]
            return next(k for k, p in enumerate(_LAYER_ORDER) if rest.startswith(p))

        out += sorted(_text_layer(cfg, i, f), key=rank)  # (stable: experts stay in order)
    out += [s for s in output if "embed_tokens" not in s.name and "lm_head" not in s.name]
    return out + [s for s in output if "lm_head" in s.name]


def source_dtype(cfg: K3Config) -> str:
    """The float type synthetic tensors are written in: the declared one, else BF16."""
    return declared_dtype(cfg) or "BF16"


def _accepting(specs: list[TensorSpec], declared: str | None) -> dict[str, TensorSpec]:
    """The specs as a checkpoint is checked against them: floats in the declared type (the few
    Moonshot keeps in F32 may be either); any float type when the config declares none."""
    out = {}
    for s in specs:
        if s.dtype in ("BF16", "F16", "F32") and declared is not None:
            pinned = s.kind in ("a_log", "dt_bias", "router_bias")
            s = TensorSpec(s.name, s.dtype, s.shape, s.kind, (declared, "F32") if pinned else (declared,))
        out[s.name] = s
    return out


class UnitLayout(Mapping[str, TensorSpec]):
    """A unit's source tensors by name, the routed experts' made when asked: a Kimi-K3 MoE layer has
    896 x 3 of them in two forms (8,064 specs), and a plan looks up only the ones the checkpoint holds,
    so building every one for each of 93 layers was a third of a plan's time. Iterating makes them all."""

    def __init__(self, fixed: dict[str, TensorSpec], experts: dict[str, TensorSpec], prefix: str, count: int):
        # ``experts``: expert 0's specs, by name; any other expert's differ only in its number
        self.fixed, self.experts, self.prefix, self.count = fixed, experts, prefix, count
        self.start = prefix + "experts."
        self.kinds = {
            tuple(n[len(self.start) :].split(".", 1)[1].split(".", 1)): s for n, s in experts.items()
        }
        self.numbers = frozenset(str(e) for e in range(count))  # (as written: no sign, no leading zero)

    def get(self, name: str, default: Any = None) -> Any:
        spec = self.fixed.get(name)
        if spec is not None or not name.startswith(self.start):
            return spec if spec is not None else default
        parts = name[len(self.start) :].split(".")  # expert, projection, tensor
        zero = self.kinds.get((parts[1], parts[2])) if len(parts) == 3 and parts[0] in self.numbers else None
        if zero is None:
            return default
        spec = object.__new__(TensorSpec)  # (expert 0's, renamed: a frozen dataclass's __init__ is slow)
        spec.__dict__.update(zero.__dict__, name=name)
        return spec

    def __getitem__(self, name: str) -> TensorSpec:
        spec = self.get(name)
        if spec is None:
            raise KeyError(name)
        return spec

    def __iter__(self) -> Iterator[str]:
        yield from self.fixed
        for e in range(self.count):
            for name in self.experts:
                yield name.replace(f"{self.prefix}experts.0.", f"{self.prefix}experts.{e}.", 1)

    def __len__(self) -> int:
        return len(self.fixed) + self.count * len(self.experts)


def unit_layout(cfg: K3Config, bid: int | None) -> Mapping[str, TensorSpec]:
    """The source tensors of one unit of the text model (layer ``bid``, or None: the output
    tensors), by name: what the config says each must be (experts in either form the config allows)."""
    f = source_dtype(cfg)
    experts = "both" if cfg.is_mxfp4 else "plain"
    if bid is None:
        return _accepting(_output_shard(cfg, f), declared_dtype(cfg))
    if not cfg.is_moe(bid):
        return _accepting(_text_layer(cfg, bid, f, experts), declared_dtype(cfg))
    declared = declared_dtype(cfg)
    prefix = f"{LM}model.layers.{bid}.block_sparse_moe."
    fixed = _accepting(_text_layer(cfg, bid, f, "none"), declared)
    one = dataclasses.replace(cfg, text={**cfg.text, "num_experts": 1})  # (expert 0 stands for all)
    zero = {
        n: s for n, s in _accepting(_text_layer(one, bid, f, experts), declared).items() if n not in fixed
    }
    return UnitLayout(fixed, zero, prefix, cfg.n_expert)


def check_formats(cfg: K3Config, weight_map: dict[str, str]) -> None:
    """MXFP4-packed experts are only read as MXFP4 under a compressed-tensors quantization_config
    (its group size and scale type say what the bytes are); without one they are one line."""
    if cfg.is_mxfp4:
        return
    packed = next((n for n in weight_map if n.endswith((".weight_packed", ".weight_scale"))), None)
    if packed is not None:
        raise K3LabError(
            f"{weight_map[packed]}: tensor {packed} is MXFP4-packed, but {cfg.path} has no "
            "quantization_config to say how its bytes read"
        )


def vision_layout(cfg: K3Config) -> dict[str, TensorSpec]:
    """The vision tower's and projector's source tensors, by name (in the declared float type)."""
    f = source_dtype(cfg)
    return _accepting([*_projector_shard(cfg, f), *_vision_shard(cfg, f)], declared_dtype(cfg))


def shard_filename(k: int, n: int, moonshot: bool = False) -> str:
    """transformers' shard names (five digits each); Moonshot's repo writes its count in six."""
    return f"model-{k:05d}-of-{n:06d}.safetensors" if moonshot else f"model-{k:05d}-of-{n:05d}.safetensors"
