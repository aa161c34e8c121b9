"""Kimi-K3's graph for one step of the imatrix (a layer, or the head), built of ggml's operations as
llama.cpp's ``kimi-k3`` graph builds it (``src/models/kimi-k3.cpp`` and the helpers it calls in
``llama-graph.cpp`` and ``delta-net-base.cpp`` of the tree llama-cpp-python vendors): the same
operations in the same order with the same constants (see ``calibration`` for why it must be so).
The hyperparameters (``Hparams``) are file 1's metadata; the weights any holder of ggml tensors by
GGUF name."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from k3lab.formats.ggml_compute import F16, Graph, Tensor

ARCH = "kimi-k3"
F16_MIN = 6.103515625e-5  # the clamp of the expert weights' sum (the smallest normal F16)


def f32(x: float) -> float:
    """A constant as llama.cpp's float arithmetic has it (ctypes passes it on exactly)."""
    return float(np.float32(x))


@dataclass(frozen=True)
class Hparams:
    """What the graph reads of file 1's metadata, as llama.cpp reads it (floats as float32)."""

    n_layer: int
    n_embd: int
    n_head: int
    head_count_kv: tuple[int, ...]
    eps: float
    kda_head_dim: int
    d_conv: int
    gate_lower_bound: float | None
    n_lora_kv: int
    key_length_mla: int
    value_length_mla: int
    n_rot: int
    n_dense_lead: int
    n_expert: int
    n_expert_used: int
    weights_norm: bool
    weights_scale: float
    situ_beta: float
    situ_linear_beta: float
    res_block: int

    @classmethod
    def from_kvs(cls, kvs: dict[str, Any]) -> Hparams:
        def k(name: str, default: Any = None) -> Any:
            value = kvs.get(f"{ARCH}.{name}", default)
            if value is None:
                raise KeyError(f"{ARCH}.{name}")
            return value

        n_layer = int(k("block_count"))
        kv = k("attention.head_count_kv")
        heads_kv = tuple(int(v) for v in kv) if isinstance(kv, list) else (int(kv),) * n_layer
        lb = kvs.get(f"{ARCH}.kda.gate_lower_bound")
        return cls(
            n_layer=n_layer,
            n_embd=int(k("embedding_length")),
            n_head=int(k("attention.head_count")),
            head_count_kv=heads_kv,
            eps=f32(k("attention.layer_norm_rms_epsilon")),
            kda_head_dim=int(k("kda.head_dim")),
            d_conv=int(k("ssm.conv_kernel")),
            gate_lower_bound=None if lb is None else f32(lb),
            n_lora_kv=int(k("attention.kv_lora_rank")),
            key_length_mla=int(k("attention.key_length_mla")),
            value_length_mla=int(k("attention.value_length_mla")),
            n_rot=int(k("rope.dimension_count", 0)),
            n_dense_lead=int(k("leading_dense_block_count", 0)),
            n_expert=int(k("expert_count", 0)),
            n_expert_used=int(k("expert_used_count", 0)),
            weights_norm=bool(k("expert_weights_norm", False)),
            weights_scale=f32(k("expert_weights_scale", 0.0)),
            situ_beta=f32(k("activation.situ_beta")),
            situ_linear_beta=f32(k("activation.situ_linear_beta")),
            res_block=int(k("attn_res.block_size", 0)),
        )

    def is_recurrent(self, il: int) -> bool:
        return self.head_count_kv[il] == 0

    def banked(self, il: int) -> bool:
        return self.res_block > 0 and il % self.res_block == 0


class Weights(Protocol):
    def tensor(self, name: str) -> Tensor: ...

    def has(self, name: str) -> bool: ...


class LayerGraph:
    """One step's graph, built on ``g`` from the weights ``w`` holds (by GGUF name) for a set of
    these hyperparameters: ``build_layer``, ``build_head``."""

    def __init__(self, hp: Hparams, g: Graph, w: Weights, slices: list[tuple[int, int]] | None = None):
        self.hp, self.g, self.w = hp, g, w
        self.slices = slices or []  # the chunk's tokens as llama.cpp's ubatches hold them

    def mm(self, name: str, x: Tensor, part: int | None = None) -> Tensor:
        return self.g.mul_mat(self.w.tensor(name), x, part)

    def mm_id(self, name: str, x: Tensor, ids: Tensor) -> Tensor:
        return self.g.mul_mat_id(self.w.tensor(name), x, ids)

    # --- helpers (llama-graph.cpp) ---
    def norm(self, x: Tensor, weight: str) -> Tensor:
        """build_norm(LLM_NORM_RMS): rms_norm, then the weight."""
        return self.g.mul(self.g.rms_norm(x, self.hp.eps), self.w.tensor(weight))

    def situ(self, g: Graph, gate: Tensor, up: Tensor) -> Tensor:
        """kimi_k3_situ: beta*tanh(gate/beta)*sigmoid(gate) * lb*tanh(up/lb)."""
        beta, lb = self.hp.situ_beta, self.hp.situ_linear_beta
        a = g.scale(g.tanh(g.scale(gate, f32(np.float32(1) / np.float32(beta)))), beta)
        a = g.mul(a, g.sigmoid(gate))
        if lb > 0.0:
            up = g.scale(g.tanh(g.scale(up, f32(np.float32(1) / np.float32(lb)))), lb)
        return g.mul(a, up)

    def res_mix(self, cur: Tensor, stack: Tensor | None, score: str, n_tokens: int) -> Tensor:
        """llama_model_kimi_k3::graph::res_mix."""
        if stack is None:
            return cur
        g, w = self.g, self.w.tensor(score)
        n_ckpt = stack.ne[1]
        sc_src = g.sum_rows(g.mul(g.rms_norm(stack, self.hp.eps), w))
        sc_src = g.reshape_2d(sc_src, n_ckpt, n_tokens)
        sc_cur = g.sum_rows(g.mul(g.rms_norm(cur, self.hp.eps), w))
        probs = g.soft_max(g.concat(sc_src, sc_cur, 0))
        p_src = g.cont(g.view_2d(probs, n_ckpt, n_tokens, probs.nb[1], 0))
        p_cur = g.cont(g.view_2d(probs, 1, n_tokens, probs.nb[1], probs.nb[0] * n_ckpt))
        return g.add(g.dsv4_hc_pre(stack, p_src), g.mul(cur, p_cur))

    @staticmethod
    def stack(g: Graph, bank: list[Tensor]) -> Tensor | None:
        """res_push, once per banked checkpoint: [n_embd, n_ckpt, n_tokens]."""
        out = None
        for entry in bank:
            ckpt = g.reshape_3d(entry, entry.ne[0], 1, entry.ne[1])
            out = ckpt if out is None else g.concat(out, ckpt, 1)
        return out

    # --- a layer (the graph's loop body) ---
    def build_layer(self, il: int, x: Tensor, bank: list[Tensor]) -> Tensor:
        g, hp = self.g, self.hp
        pre = f"blk.{il}."
        n_tokens = x.ne[1]
        use_res = hp.res_block > 0
        stack = self.stack(g, bank)
        cur = self.res_mix(x, stack, pre + "attn_res_score.weight", n_tokens) if use_res else x
        banked = hp.banked(il)
        if banked:  # res_push: the raw layer input, appended
            ckpt = g.reshape_3d(x, x.ne[0], 1, n_tokens)
            stack = ckpt if stack is None else g.concat(stack, ckpt, 1)
        cur = self.norm(cur, pre + "attn_norm.weight")
        cur = self.kda(il, cur) if hp.is_recurrent(il) else self.mla(il, cur)
        prefix = cur if banked else g.add(x, cur)
        cur = self.res_mix(prefix, stack, pre + "ffn_res_score.weight", n_tokens) if use_res else prefix
        cur = self.norm(cur, pre + "ffn_norm.weight")
        if il < hp.n_dense_lead:
            gate = self.mm(pre + "ffn_gate.weight", cur)
            up = self.mm(pre + "ffn_up.weight", cur)
            cur = self.mm(pre + "ffn_down.weight", self.situ(g, gate, up))
        else:
            cur = self.latent_moe(il, cur)
        return g.add(prefix, cur)

    def build_head(self, x: Tensor, bank: list[Tensor]) -> Tensor:
        g = self.g
        cur = x
        if self.hp.res_block > 0:
            cur = self.res_mix(cur, self.stack(g, bank), "output_res_score.weight", x.ne[1])
        cur = self.norm(cur, "output_norm.weight")
        return self.mm("output.weight", cur)

    # --- KDA (build_kda_layer; the delta rule as build_delta_net_fused) ---
    def conv(self, x: Tensor, proj: str, conv_w: str) -> Tensor:
        g, hp = self.g, self.hp
        d_inner, n_tokens = hp.kda_head_dim * hp.n_head, x.ne[1]
        x_proj = self.mm(proj, x)
        x_3d = g.reshape_3d(x_proj, d_inner, n_tokens, 1)
        state = g.zeros((hp.d_conv - 1, d_inner, 1))  # a new sequence's
        conv_x = g.concat(state, g.transpose(x_3d), 0)
        cur = g.ssm_conv(conv_x, g.reshape_2d(self.w.tensor(conv_w), hp.d_conv, d_inner))
        cur = g.silu(g.reshape_2d(cur, d_inner, n_tokens))
        return g.reshape_4d(cur, hp.kda_head_dim, hp.n_head, n_tokens, 1)

    def l2_norm(self, g: Graph, x: Tensor) -> Tensor:
        """build_gdn_l2_norm: an RMS norm rescaled."""
        n = np.float32(x.ne[0])
        return g.scale(g.rms_norm(x, f32(np.float32(self.hp.eps) / n)), f32(np.float32(1) / np.sqrt(n)))

    def kda(self, il: int, cur: Tensor) -> Tensor:
        g, hp = self.g, self.hp
        pre = f"blk.{il}."
        hd, nh, n_tokens = hp.kda_head_dim, hp.n_head, cur.ne[1]
        q = self.conv(cur, pre + "attn_q.weight", pre + "ssm_conv1d_q.weight")
        k = self.conv(cur, pre + "attn_k.weight", pre + "ssm_conv1d_k.weight")
        v = self.conv(cur, pre + "attn_v.weight", pre + "ssm_conv1d_v.weight")
        f_a = self.mm(pre + "ssm_f_a.weight", cur)
        g1 = g.add(self.mm(pre + "ssm_f_b.weight", f_a), self.w.tensor(pre + "ssm_dt.bias"))
        a = g.reshape_3d(self.w.tensor(pre + "ssm_a"), 1, nh, 1)
        if hp.gate_lower_bound is not None:
            g1 = g.mul(g.reshape_3d(g1, hd, nh, n_tokens), a)
            g1 = g.scale(g.sigmoid(g.scale(g1, -1.0)), hp.gate_lower_bound)
        else:
            g1 = g.mul(g.reshape_3d(g.softplus(g1), hd, nh, n_tokens), a)
        g1 = g.reshape_4d(g1, hd, nh, n_tokens, 1)
        beta = g.sigmoid(g.reshape_4d(self.mm(pre + "ssm_beta.weight", cur), 1, nh, n_tokens, 1))
        state = g.reshape_4d(g.zeros((hd * hd * nh, 1)), hd, hd, nh, 1)
        q, k = self.l2_norm(g, q), self.l2_norm(g, k)
        result = g.gated_delta_net(q, k, v, g1, beta, state, 1)
        out = g.view_4d(result, hd, nh, n_tokens, 1, 4 * hd, 4 * hd * nh, 4 * hd * nh * n_tokens, 0)
        out = g.cont(out)
        g2 = g.reshape_3d(self.mm(pre + "ssm_g.weight", cur), hd, nh, n_tokens)
        normed = self.norm(g.reshape_3d(out, hd, nh, n_tokens), pre + "ssm_norm.weight")
        gated = g.cont_2d(g.mul(normed, g.sigmoid(g2)), hd * nh, n_tokens)
        return self.mm(pre + "attn_output.weight", gated)

    # --- MLA (build_mla_layer; attention as build_attn with a K-only F16 cache and flash attention) ---
    def mla(self, il: int, cur: Tensor) -> Tensor:
        g, hp = self.g, self.hp
        pre = f"blk.{il}."
        n_tokens, nh = cur.ne[1], hp.n_head
        kvl, rope = hp.n_lora_kv, hp.n_rot
        k_mla = hp.key_length_mla
        nope = k_mla - rope
        row = 4  # F32
        inp_gate = cur
        if self.w.has(pre + "attn_q_a.weight"):
            q = self.mm(pre + "attn_q_a.weight", cur)
            q = self.mm(pre + "attn_q_b.weight", self.norm(q, pre + "attn_q_a_norm.weight"))
        else:
            q = self.mm(pre + "attn_q.weight", cur)
        kv_pe = self.mm(pre + "attn_kv_a_mqa.weight", cur)
        kv_cmpr = g.view_2d(kv_pe, kvl, n_tokens, row * (kvl + rope), 0)
        k_pe = g.view_3d(kv_pe, rope, 1, n_tokens, row * (kvl + rope), row * (kvl + rope), row * kvl)
        kv_cmpr = self.norm(kv_cmpr, pre + "attn_kv_a_norm.weight")
        q_nope = g.view_3d(q, nope, nh, n_tokens, row * k_mla, row * k_mla * nh, 0)
        q_pe = g.view_3d(q, rope, nh, n_tokens, row * k_mla, row * k_mla * nh, row * nope)
        q_abs = self.mm(pre + "attn_k_b.weight", g.permute(q_nope, 0, 2, 1, 3))
        q_abs = g.permute(q_abs, 0, 2, 1, 3)
        Q = g.concat(q_abs, q_pe, 0)
        kv_3d = g.reshape_3d(kv_cmpr, kvl, 1, n_tokens)
        K = g.concat(kv_3d, k_pe, 0)
        g.expand(Q, kv_3d, K)
        cache = g.cast(K, F16)  # the K cache (K-only: V is its first kv_lora_rank values)
        scale = f32(np.float32(1) / np.sqrt(np.float32(k_mla)))
        out = self.attention(Q, cache, kvl, pre + "attn_v_b.weight", scale)
        if self.w.has(pre + "attn_gate.weight"):
            out = g.mul(out, g.sigmoid(self.mm(pre + "attn_gate.weight", inp_gate)))
        return self.mm(pre + "attn_output.weight", out)

    def attention(self, Q: Tensor, cache: Tensor, dv: int, v_mla: str, scale: float) -> Tensor:
        """build_attn_mha with flash attention and ``v_mla``, once per ubatch llama.cpp cuts the chunk
        into (``self.slices``: its queries [a, b) attend to the cache's first b cells): the flash
        attention kernel ggml picks depends on how many queries it is given, so they are given as
        llama.cpp gives them."""
        g = self.g
        outs = []
        for i, (a, b) in enumerate(self.slices):
            q = g.view_3d(Q, Q.ne[0], Q.ne[1], b - a, Q.nb[1], Q.nb[2], a * Q.nb[2])
            k = g.view_4d(cache, cache.ne[0], cache.ne[1], b, 1, cache.nb[1], cache.nb[2], cache.nb[2] * b, 0)
            v = g.view_4d(cache, dv, k.ne[1], k.ne[2], k.ne[3], k.nb[1], k.nb[2], k.nb[3], 0)
            q = g.view_4d(q, q.ne[0], q.ne[1], q.ne[2], 1, q.nb[1], q.nb[2], q.nb[2] * q.ne[2], 0)
            q, k, v = g.permute(q, 0, 2, 1, 3), g.permute(k, 0, 2, 1, 3), g.permute(v, 0, 2, 1, 3)
            seen = np.arange(b)[None, :] <= np.arange(a, b)[:, None]
            causal = np.where(seen, 0.0, -np.inf).astype(np.float16)
            cur = g.flash_attn_ext(q, k, v, g.input(causal, F16), scale, 0.0, 0.0)
            g.set_n_kv_max(cur, 0)
            g.set_prec_f32(cur)
            cur = g.permute(cur, 0, 2, 1, 3)
            cur = self.mm(v_mla, cur, part=i)  # (llama.cpp multiplies it per sequence: a chunk's slice)
            cur = g.cont(g.permute(cur, 0, 2, 1, 3))
            outs.append(g.reshape_2d(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]))
        out = outs[0]
        for more in outs[1:]:
            out = g.concat(out, more, 1)
        return out

    # --- the latent MoE (build_latent_moe, build_moe_ffn) ---
    def latent_moe(self, il: int, cur: Tensor) -> Tensor:
        g = self.g
        pre = f"blk.{il}."
        n_tokens = cur.ne[1]
        identity = cur
        routed_in = (
            self.mm(pre + "ffn_routed_down.weight", cur)
            if self.w.has(pre + "ffn_routed_down.weight")
            else cur
        )
        logits = self.mm(pre + "ffn_gate_inp.weight", identity)
        moe_out = self.moe_ffn(pre, routed_in, logits, n_tokens)
        if self.w.has(pre + "ffn_routed_norm.weight"):
            moe_out = self.norm(moe_out, pre + "ffn_routed_norm.weight")
        if self.w.has(pre + "ffn_routed_up.weight"):
            moe_out = self.mm(pre + "ffn_routed_up.weight", moe_out)
        if self.w.has(pre + "ffn_gate_shexp.weight"):
            gate = self.mm(pre + "ffn_gate_shexp.weight", identity)
            up = self.mm(pre + "ffn_up_shexp.weight", identity)
            sh = self.mm(pre + "ffn_down_shexp.weight", self.situ(g, gate, up))
            moe_out = g.add(moe_out, sh)
        return moe_out

    def moe_ffn(self, pre: str, cur: Tensor, logits: Tensor, n_tokens: int) -> Tensor:
        g, hp = self.g, self.hp
        n_used, n_expert = hp.n_expert_used, hp.n_expert
        probs = g.sigmoid(logits)
        selection = g.add(probs, self.w.tensor(pre + "exp_probs_b.bias"))
        selected = g.argsort_top_k(selection, n_used)
        weights = g.get_rows(g.reshape_3d(probs, 1, n_expert, n_tokens), selected)
        if hp.weights_norm:
            weights = g.reshape_2d(weights, n_used, n_tokens)
            total = g.clamp(g.sum_rows(weights), F16_MIN, math.inf)
            weights = g.reshape_3d(g.div(weights, total), 1, n_used, n_tokens)
        if hp.weights_scale not in (0.0, 1.0):
            weights = g.scale(weights, hp.weights_scale)
        g.expand(weights)
        x = g.reshape_3d(cur, cur.ne[0], 1, n_tokens)
        up = self.mm_id(pre + "ffn_up_exps.weight", x, selected)
        gate = self.mm_id(pre + "ffn_gate_exps.weight", x, selected)
        experts = self.mm_id(pre + "ffn_down_exps.weight", self.situ(g, gate, up), selected)
        experts = g.mul(experts, weights)
        g.expand(experts)
        n_embd = experts.ne[0]
        views = [
            g.view_2d(experts, n_embd, n_tokens, experts.nb[2], i * experts.nb[1]) for i in range(n_used)
        ]
        g.expand(*views)
        out = views[0]
        for view in views[1:]:
            out = g.add(out, view)
            g.expand(out)
        return g.cont(out) if n_used == 1 else out
