"""Judges of what a conversion wrote, written from the facts file and the safetensors library alone
(nothing of k3lab's reading or transforms): a checkpoint read with the safetensors library, and what
each output tensor must be."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from k3lab.formats import mxfp4

LM = "language_model.model."


class Source:
    """The source checkpoint read with the safetensors library (BF16 as raw bits, via numpy views)."""

    def __init__(self, root: Path):
        self.root = root
        index = root / "model.safetensors.index.json"
        if index.exists():
            self.index = json.loads(index.read_text())["weight_map"]
        else:  # one model.safetensors: every tensor is in it
            with safe_open(str(root / "model.safetensors"), framework="numpy") as f:
                self.index = dict.fromkeys(f.keys(), "model.safetensors")

    def raw(self, name: str) -> np.ndarray:
        with safe_open(str(self.root / self.index[name]), framework="numpy") as f:
            sl = f.get_slice(name)
            dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
        # safetensors' numpy backend has no bfloat16: read the bytes through the header offsets
        import struct

        path = self.root / self.index[name]
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            a, b = header[name]["data_offsets"]
            fh.seek(8 + n + a)
            data = fh.read(b - a)
        np_dtype = {"BF16": np.uint16, "F32": np.float32, "U8": np.uint8, "F16": np.float16}[dtype]
        return np.frombuffer(data, dtype=np_dtype).reshape(shape)

    def dtype(self, name: str) -> str:
        with safe_open(str(self.root / self.index[name]), framework="numpy") as f:
            return f.get_slice(name).get_dtype()

    def f32(self, name: str) -> np.ndarray:
        a = self.raw(name)
        return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)

    def has(self, name: str) -> bool:
        return name in self.index


def expected_tensor(src: Source, name: str, cfg: dict) -> tuple[str, np.ndarray]:
    """(ggml type, expected decoded values) for one output tensor, written from the facts file."""
    t = cfg["text_config"]
    m = name.split(".")
    if name in ("token_embd.weight", "output.weight"):
        return "BF16", src.raw(
            LM + "embed_tokens.weight" if name.startswith("token") else "language_model.lm_head.weight"
        )
    if name == "output_norm.weight":
        return "F32", src.f32(LM + "norm.weight")
    if name == "output_res_score.weight":
        return "F32", src.f32(LM + "output_attn_res_norm.weight") * src.f32(
            LM + "output_attn_res_proj.weight"
        )[0]
    bid, what = int(m[1]), ".".join(m[2:])
    p, a, moe = f"{LM}layers.{bid}.", f"{LM}layers.{bid}.self_attn.", f"{LM}layers.{bid}.block_sparse_moe."
    mla = bid + 1 in t["linear_attn_config"]["full_attn_layers"]
    nh, nope, v = t["num_attention_heads"], t["qk_nope_head_dim"], t["v_head_dim"]
    simple_f32 = {
        "attn_norm.weight": p + "input_layernorm.weight",
        "ffn_norm.weight": p + "post_attention_layernorm.weight",
        "ssm_norm.weight": a + "o_norm.weight",
        "ssm_dt.bias": a + "dt_bias",
        "attn_q_a_norm.weight": a + "q_a_layernorm.weight",
        "attn_kv_a_norm.weight": a + "kv_a_layernorm.weight",
        "ffn_gate_inp.weight": moe + "gate.weight",
        "exp_probs_b.bias": moe + "gate.e_score_correction_bias",
        "ffn_routed_norm.weight": moe + "routed_expert_norm.weight",
    }
    simple_bf16 = {
        "attn_q.weight": a + "q_proj.weight",
        "attn_k.weight": a + "k_proj.weight",
        "attn_v.weight": a + "v_proj.weight",
        "ssm_f_a.weight": a + "f_a_proj.weight",
        "ssm_f_b.weight": a + "f_b_proj.weight",
        "ssm_beta.weight": a + "b_proj.weight",
        "attn_output.weight": a + "o_proj.weight",
        "attn_q_a.weight": a + "q_a_proj.weight",
        "attn_q_b.weight": a + "q_b_proj.weight",
        "attn_kv_a_mqa.weight": a + "kv_a_proj_with_mqa.weight",
        "ffn_gate.weight": p + "mlp.gate_proj.weight",
        "ffn_up.weight": p + "mlp.up_proj.weight",
        "ffn_down.weight": p + "mlp.down_proj.weight",
        "ffn_gate_shexp.weight": moe + "shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": moe + "shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": moe + "shared_experts.down_proj.weight",
        "ffn_routed_down.weight": moe + "routed_expert_down_proj.weight",
        "ffn_routed_up.weight": moe + "routed_expert_up_proj.weight",
    }
    if what in simple_f32:
        return "F32", src.f32(simple_f32[what])
    if what in simple_bf16:
        return "BF16", src.raw(simple_bf16[what])
    if what in ("ssm_g.weight", "attn_gate.weight"):
        assert (what == "attn_gate.weight") == mla, "g_proj resolved by layer type"
        return "BF16", src.raw(a + "g_proj.weight")
    if what in ("attn_res_score.weight", "ffn_res_score.weight"):
        pair = "self_attention_res" if what.startswith("attn") else "mlp_res"
        return "F32", src.f32(p + f"{pair}_norm.weight") * src.f32(p + f"{pair}_proj.weight")[0]
    if what.startswith("ssm_conv1d_"):
        w = src.f32(a + f"{what[11]}_conv1d.weight")  # [d_inner, 1, d_conv]
        return "F32", w[None, :, :, :].transpose(0, 1, 2, 3).reshape(1, w.shape[0], 1, w.shape[2])
    if what == "ssm_a":
        return "F32", -np.exp(src.f32(a + "A_log"))
    if what in ("attn_k_b.weight", "attn_v_b.weight"):
        kv = src.raw(a + "kv_b_proj.weight")
        heads = [kv[h * (nope + v) : (h + 1) * (nope + v)] for h in range(nh)]
        if what == "attn_k_b.weight":
            return "BF16", np.stack([hd[:nope].T for hd in heads])  # (head, kv_lora, nope)
        return "BF16", np.stack([hd[nope:] for hd in heads])  # (head, v, kv_lora)
    if what.endswith("_exps.weight"):
        w = {"gate": "w1", "down": "w2", "up": "w3"}[what.split("_")[1]]
        if src.has(moe + f"experts.0.{w}.weight"):  # plain experts: stacked as they are
            return "BF16", np.stack(
                [src.raw(moe + f"experts.{e}.{w}.weight") for e in range(t["num_experts"])]
            )
        return "MXFP4", np.stack(
            [
                mxfp4.decode_compressed_tensors(
                    src.raw(moe + f"experts.{e}.{w}.weight_packed"),
                    src.raw(moe + f"experts.{e}.{w}.weight_scale"),
                )
                for e in range(t["num_experts"])
            ]
        )
    raise AssertionError(f"no expectation for {name}")


# the facts file's table: each GGUF name, its source tensor and its type ("src": the source's)
VT, VB = "vision_tower.", "vision_tower.encoder.blocks.{i}."
TABLE = {
    "v.patch_embd.weight": (VT + "patch_embed.proj.weight", "F32"),
    "v.position_embd.weight": (VT + "patch_embed.pos_emb.weight", "F32"),
    "v.blk.{i}.ln1.weight": (VB + "norm0.weight", "F32"),
    "v.blk.{i}.ln2.weight": (VB + "norm1.weight", "F32"),
    "v.blk.{i}.attn_qkv.weight": (VB + "wqkv.weight", "src"),
    "v.blk.{i}.attn_out.weight": (VB + "wo.weight", "src"),
    "v.blk.{i}.ffn_up.weight": (VB + "mlp.fc0.weight", "src"),
    "v.blk.{i}.ffn_down.weight": (VB + "mlp.fc1.weight", "src"),
    "v.post_ln.weight": (VT + "encoder.final_layernorm.weight", "F32"),
    "mm.1.weight": ("mm_projector.proj.0.weight", "src"),
    "mm.2.weight": ("mm_projector.proj.2.weight", "src"),
    "mm.post_norm.weight": ("mm_projector.post_norm.weight", "F32"),
}


def mmproj_names(blocks: int) -> dict[str, tuple[str, str]]:
    """Every GGUF tensor of the table for a tower of ``blocks`` blocks: (source tensor, type)."""
    out = {}
    for name, (source, kind) in TABLE.items():
        for i in range(blocks) if "{i}" in name else [0]:
            out[name.format(i=i)] = (source.format(i=i), kind)
    return out


def fork_deinterleave(w: np.ndarray, heads: int) -> np.ndarray:
    """The fork's converter (KimiK3VisionModel), restated: Q and K blocks as (H, d/4, 2, 2, C), axes 1
    and 2 swapped; V as is."""
    q = w.shape[0] // 3
    d = q // heads

    def permute(block: np.ndarray) -> np.ndarray:
        return block.reshape(heads, d // 4, 2, 2, *block.shape[1:]).swapaxes(1, 2).reshape(block.shape)

    return np.concatenate([permute(w[:q]), permute(w[q : 2 * q]), w[2 * q :]])


def check_mmproj(src_dir: Path, path: Path) -> None:
    """The mmproj at ``path`` read with gguf-py: every tensor of the table and nothing else, of its
    type, each its source tensor's values exactly (BF16 widened to F32 exactly; ``wqkv`` as the
    fork's converter de-interleaves it); every vision source tensor used."""
    import gguf

    src = Source(src_dir)
    vision = json.loads((src_dir / "config.json").read_text())["vision_config"]
    table = mmproj_names(int(vision["vt_num_hidden_layers"]))
    tensors = gguf.GGUFReader(path).tensors
    assert sorted(t.name for t in tensors) == sorted(table)
    for t in tensors:
        source, kind = table[t.name]
        original, dtype = src.raw(source), src.dtype(source)
        assert t.tensor_type.name == (dtype if kind == "src" else "F32"), t.name
        data = np.asarray(t.data)
        data = (data.view(np.uint16) if t.tensor_type.name == "BF16" else data).reshape(original.shape)
        if t.tensor_type.name == "F32" and dtype == "BF16":  # widened: the low 16 bits are zero
            bits = data.view(np.uint32)
            assert not np.any(bits & 0xFFFF), t.name
            data = (bits >> 16).astype(np.uint16)
        expected = (
            fork_deinterleave(original, int(vision["vt_num_attention_heads"]))
            if "attn_qkv" in t.name
            else original
        )
        assert np.array_equal(data.view(original.dtype), expected), t.name
    wanted = {n for n in src.index if n.startswith(("vision_tower.", "mm_projector."))}
    assert wanted == {source for source, _ in table.values()}, sorted(
        wanted ^ {s for s, _ in table.values()}
    )[:3]
