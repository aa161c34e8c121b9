"""A NumPy forward pass of the Kimi-K3 text model, read from the *source* checkpoint.

Written for clarity over speed, in float32, following llama.cpp's ``src/models/kimi-k3.cpp``
(the graph that runs our GGUFs) and the facts file. It reads the safetensors checkpoint (MXFP4
experts decoded by the compressed-tensors definition in ``mxfp4``), never the GGUF, so comparing
its logits with llama.cpp's proves the converted tensors *mean* the same thing.

Two arithmetic modes. ``f32`` is the model as written. ``ggml`` also rounds activations where
llama.cpp's CPU kernels do, so that only accumulation order separates the two and the check is
sharp: the input of a matmul with a BF16 weight is rounded to BF16, of an MXFP4 weight quantised
to Q8_0 (32-value blocks, F16 scale), and, with ``kv_type="f16"`` (llama.cpp's default cache),
MLA attention reads Q, K, V and the probabilities in F16. Which weights are BF16, F32 or MXFP4
comes from the rule table.

Two semantics. ``runtime`` names the epsilons taken as llama.cpp's graph takes them
(``runtime.EPSILONS``, the default: the KDA q/k L2 norm and the MLA q_a/kv_a norms with the model's
``rms_norm_eps``); an epsilon not named is Moonshot's (1e-6). ``runtime=()`` with ``mode="f32"`` is
Moonshot's forward exactly; the default with ``mode="ggml"`` is the graph llama.cpp runs.
"""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from k3lab.formats import mxfp4
from k3lab.formats.numerics import bf16_bits_to_f32, f32_to_bf16_bits
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.rules import RULES, rule_applies
from k3lab.kimi_k3.runtime import EPSILONS, KDA_L2_EPS, MLA_NORM_EPS, MOONSHOT_EPS

LM = "language_model."


class Weights:
    """Source tensors as float32 by HF name (cached), experts decoded from MXFP4 on first use."""

    def __init__(self, cfg: K3Config, source: Any):
        self.cfg, self.source = cfg, source
        self._cache: dict[str, np.ndarray] = {}

    def __call__(self, name: str) -> np.ndarray:
        name = LM + name
        if name not in self._cache:
            e = self.source.entry(name)
            a = self.source.array(name)
            self._cache[name] = bf16_bits_to_f32(a) if e.dtype == "BF16" else np.asarray(a, dtype=np.float32)
        return self._cache[name]

    def expert(self, layer: int, e: int, w: str) -> np.ndarray:
        base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
        key = LM + base + "dequantised"
        if key not in self._cache:
            if self.packed(layer, e, w):
                packed = self.source.array(LM + base + "weight_packed")
                scale = self.source.array(LM + base + "weight_scale")
                self._cache[key] = mxfp4.decode_compressed_tensors(packed, scale)
            else:
                self._cache[key] = self(base + "weight")
        return self._cache[key]

    def packed(self, layer: int, e: int, w: str) -> bool:
        """Whether the checkpoint holds this expert MXFP4-packed (read from the index, not the config)."""
        base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
        return LM + base + "weight_packed" in self.source.weight_map


def round_bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def round_f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def _q8_0_kernel() -> str:
    """Which of ggml's quantize_row_q8_0 builds the local llama.cpp runs (they round differently)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86"  # the AVX/AVX2 path; every x86-64 build of llama.cpp today has AVX
    return "arm" if machine in ("aarch64", "arm64") else "ref"


Q8_0_KERNEL = _q8_0_kernel()


def round_q8_0(x: np.ndarray, kernel: str | None = None) -> np.ndarray:
    """ggml's quantize_row_q8_0 and back: per 32 values d = amax/127 (stored as F16), q = round(x/d).

    The builds differ in the last bit, which matters when a value sits on a rounding boundary:
    ``ref`` (quantize_row_q8_0_ref, gguf-py) multiplies by 1/d and rounds half away from zero;
    ``arm`` (NEON) multiplies by 1/d and rounds half to even; ``x86`` (AVX) multiplies by 127/amax
    and rounds half to even. The default is the kernel of this machine.
    """
    kernel = kernel or Q8_0_KERNEL
    if kernel not in ("ref", "arm", "x86"):
        raise ValueError(f"unknown Q8_0 kernel {kernel!r} (ref, arm or x86)")
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = amax / np.float32(127)
    if kernel == "x86":
        scaled = blocks * np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    else:
        scaled = blocks * np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    if kernel == "ref":  # roundf; v - trunc(v) is exact in float32, so the tie test is too
        q = np.trunc(scaled)
        q += np.where(np.abs(scaled - q) >= 0.5, np.sign(scaled), np.float32(0))
    else:
        q = np.rint(scaled)
    return (q * round_f16(d)).reshape(x.shape)


def rms_norm(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * weight if weight is not None else y


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def situ(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    """SiTU(g, u) = beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb)."""
    act = beta * np.tanh(gate / beta) * sigmoid(gate)
    if linear_beta > 0:
        up = linear_beta * np.tanh(up / linear_beta)
    return act * up


def _runtime_types(cfg: K3Config, source: Any) -> dict[str, str]:
    """HF name -> how llama.cpp multiplies by it: 'bf16', 'f16', 'f32' or 'q8' (an MXFP4 weight)."""
    out: dict[str, str] = {}
    for bid in [*range(cfg.n_layer), None]:
        for rule in RULES:
            if rule_applies(rule, cfg, bid):
                names = rule.source_names(cfg, bid)
                kind = {"mxfp4": "q8", "f32": "f32"}.get(rule.dtype)
                for n in names:
                    if n in source.weight_map:
                        out[n] = kind or source.entry(n).dtype.lower()
    return out


class Reference:
    def __init__(
        self,
        cfg: K3Config,
        source: Any,
        mode: str = "ggml",
        kv_type: str = "f32",
        runtime: tuple[str, ...] = EPSILONS,
    ):
        if mode not in ("f32", "ggml"):
            raise ValueError(f"mode {mode!r}: 'f32' or 'ggml'")
        self.cfg, self.mode, self.kv_type = cfg, mode, kv_type
        self.w = Weights(cfg, source)
        self.types = _runtime_types(cfg, source) if mode == "ggml" else {}
        t = cfg.text
        self.eps = float(t["rms_norm_eps"])
        self.l2_eps = self.eps if KDA_L2_EPS.name in runtime else MOONSHOT_EPS
        self.mla_eps = self.eps if MLA_NORM_EPS.name in runtime else MOONSHOT_EPS
        self.beta, self.lbeta = float(t["activation_situ_beta"]), float(t["activation_situ_linear_beta"])
        self.block = int(t["attn_res_block_size"])

    # --- arithmetic ---
    def act(self, x: np.ndarray, kind: str) -> np.ndarray:
        """The activation as the runtime's matmul kernel sees it."""
        if self.mode == "f32" or kind == "f32":
            return x
        return {"bf16": round_bf16, "f16": round_f16, "q8": round_q8_0}[kind](x)

    def lin(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T for the source weight ``name``."""
        return self.act(x, self.types.get(LM + name, "f32")) @ self.w(name).T

    def expert(self, layer: int, e: int, w: str, x: np.ndarray) -> np.ndarray:
        kind = (
            "q8"
            if self.w.packed(layer, e, w)
            else self.types.get(LM + f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight", "f32")
        )
        return self.w.expert(layer, e, w) @ self.act(x, kind)

    # --- AttnRes: softmax mixing over banked checkpoints and the current stream ---
    def res_score(self, prefix: str) -> np.ndarray:
        return self.w(f"{prefix}_norm.weight").reshape(-1) * self.w(f"{prefix}_proj.weight").reshape(-1)

    def res_probs(self, cur: np.ndarray, bank: list[np.ndarray], score_w: np.ndarray) -> np.ndarray:
        """(T, n_bank + 1): softmax over the banked checkpoints and the current stream of
        sum(rms_norm(entry) * score_w), as llama.cpp's ``res_probs``."""
        entries = np.stack([*bank, cur])  # (n, T, H)
        scores = (rms_norm(entries, self.eps) * score_w).sum(-1)  # scored on normalised values
        probs = np.exp(scores - scores.max(0))
        return (probs / probs.sum(0)).T

    @staticmethod
    def mix(cur: np.ndarray, bank: list[np.ndarray], probs: np.ndarray) -> np.ndarray:
        """The probability-weighted sum of the raw entries (probs as ``res_probs`` gives them)."""
        entries = np.stack([*bank, cur])
        return (probs.T[..., None] * entries).sum(0)

    def res_mix(self, cur: np.ndarray, bank: list[np.ndarray], score_w: np.ndarray) -> np.ndarray:
        if not bank:
            return cur
        return self.mix(cur, bank, self.res_probs(cur, bank, score_w))

    # --- KDA ---
    def kda(self, il: int, x: np.ndarray) -> np.ndarray:
        w, cfg = self.w, self.cfg
        p = f"model.layers.{il}.self_attn."
        T = x.shape[0]
        nh, hd = cfg.kda_n_head, cfg.kda_head_dim

        def conv(name: str) -> np.ndarray:
            y = self.lin(x, p + f"{name}_proj.weight")  # (T, d)
            k = w(p + f"{name}_conv1d.weight").reshape(y.shape[1], -1)  # (d, K)
            K = k.shape[1]
            padded = np.concatenate([np.zeros((K - 1, y.shape[1]), np.float32), y])
            out = sum(padded[j : j + T] * k[:, j] for j in range(K))  # causal depthwise
            out = out * sigmoid(out)  # SiLU
            return out.reshape(T, nh, hd)

        q, k, v = conv("q"), conv("k"), conv("v")
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + self.l2_eps)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + self.l2_eps)
        g1 = (self.lin(self.lin(x, p + "f_a_proj.weight"), p + "f_b_proj.weight") + w(p + "dt_bias")).reshape(
            T, nh, hd
        )
        a = np.exp(w(p + "A_log").reshape(-1)[:nh])[None, :, None]
        lb = cfg.gate_lower_bound
        g = lb * sigmoid(a * g1) if lb is not None else -a * softplus(g1)  # log-decay per key dim
        beta = sigmoid(self.lin(x, p + "b_proj.weight"))  # (T, nh)
        S = np.zeros((nh, hd, hd), np.float32)  # [head, key, value]
        out = np.empty((T, nh, hd), np.float32)
        scale = 1.0 / np.sqrt(hd)
        for t in range(T):  # the delta rule with a per-key-dimension decay
            S = S * np.exp(g[t])[:, :, None]
            pred = np.einsum("hk,hkv->hv", k[t], S)
            delta = (v[t] - pred) * beta[t][:, None]
            S = S + np.einsum("hk,hv->hkv", k[t], delta)
            out[t] = np.einsum("hk,hkv->hv", q[t], S) * scale
        o = rms_norm(out, self.eps, w(p + "o_norm.weight"))
        gate = sigmoid(self.lin(x, p + "g_proj.weight")).reshape(T, nh, hd)
        return self.lin((o * gate).reshape(T, nh * hd), p + "o_proj.weight")

    # --- MLA (NoPE, with the output gate) ---
    def mla(self, il: int, x: np.ndarray) -> np.ndarray:
        """Written in the absorbed form llama.cpp runs (the same function as the textbook one):
        q_nope is taken into the latent space through kv_b's K half, attention runs over the
        normalised latent (plus the shared k_pe), and kv_b's V half is applied to the result."""
        w, t = self.w, self.cfg.text
        p = f"model.layers.{il}.self_attn."
        T, nh = x.shape[0], self.cfg.n_head
        nope, rope, vd, kvl = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"], t["kv_lora_rank"]
        if t.get("q_lora_rank") is not None:
            qa = rms_norm(self.lin(x, p + "q_a_proj.weight"), self.mla_eps, w(p + "q_a_layernorm.weight"))
            q = self.lin(qa, p + "q_b_proj.weight").reshape(T, nh, nope + rope)
        else:
            q = self.lin(x, p + "q_proj.weight").reshape(T, nh, nope + rope)
        ckv = self.lin(x, p + "kv_a_proj_with_mqa.weight")
        latent = rms_norm(ckv[:, :kvl], self.mla_eps, w(p + "kv_a_layernorm.weight"))
        k_pe = ckv[:, kvl:]  # shared by all heads; NoPE: no rotation
        kv_b = w(p + "kv_b_proj.weight").reshape(nh, nope + vd, kvl)
        kind = self.types.get(LM + p + "kv_b_proj.weight", "f32")
        q_abs = np.einsum("hnr,thn->thr", kv_b[:, :nope], self.act(q[..., :nope], kind))  # (T, nh, kvl)
        cache = self.act(np.concatenate([latent, k_pe], -1), self.kv_type)  # the K cache: latent + k_pe
        query = self.act(np.concatenate([q_abs, q[..., nope:]], -1), self.kv_type)
        scores = np.einsum("thd,sd->hts", query, cache) / np.sqrt(nope + rope)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = np.einsum("hts,sr->thr", self.act(probs, self.kv_type), cache[:, :kvl])  # (T, nh, kvl)
        out = np.einsum("hvr,thr->thv", kv_b[:, nope:], self.act(ctx, kind)).reshape(T, nh * vd)
        if (LM + p + "g_proj.weight") in self.w.source.weight_map:  # mla_use_output_gate
            out = out * sigmoid(self.lin(x, p + "g_proj.weight"))
        return self.lin(out, p + "o_proj.weight")

    # --- FFN ---
    def dense(self, il: int, x: np.ndarray) -> np.ndarray:
        p = f"model.layers.{il}.mlp."
        h = situ(
            self.lin(x, p + "gate_proj.weight"), self.lin(x, p + "up_proj.weight"), self.beta, self.lbeta
        )
        return self.lin(h, p + "down_proj.weight")

    def router(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(probs, selection scores), each (T, E): sigmoid of the router on the full-width input, and
        the same plus the correction bias, which only steers the choice."""
        p = f"model.layers.{il}.block_sparse_moe."
        probs = sigmoid(self.lin(x, p + "gate.weight"))
        return probs, probs + self.w(p + "gate.e_score_correction_bias")

    def select(self, il: int, x: np.ndarray) -> np.ndarray:
        """(T, k) the experts the reference chooses."""
        _, chosen = self.router(il, x)
        return np.argsort(-chosen, axis=-1, kind="stable")[:, : int(self.cfg["num_experts_per_token"])]

    def moe(self, il: int, x: np.ndarray, selected: np.ndarray | None = None) -> np.ndarray:
        """The MoE FFN; with ``selected`` (T, k) it uses that expert choice (llama.cpp's own, so that
        a near-tie in the router cannot turn a correct file into a mismatch)."""
        w, cfg, t = self.w, self.cfg, self.cfg.text
        p = f"model.layers.{il}.block_sparse_moe."
        probs, _ = self.router(il, x)
        selected = self.select(il, x) if selected is None else selected
        latent_in = self.lin(x, p + "routed_expert_down_proj.weight") if cfg.is_latent_moe else x
        out = np.zeros_like(latent_in)
        for ti in range(x.shape[0]):
            idx = selected[ti]
            weights = probs[ti, idx]
            if t["moe_renormalize"]:
                weights = weights / max(weights.sum(), 6.103515625e-5)
            weights = weights * float(t["routed_scaling_factor"])
            for e, wt in zip(idx, weights):
                h = situ(
                    self.expert(il, e, "w1", latent_in[ti]),
                    self.expert(il, e, "w3", latent_in[ti]),
                    self.beta,
                    self.lbeta,
                )
                out[ti] += wt * self.expert(il, e, "w2", h)
        if cfg.is_latent_moe:
            if (LM + p + "routed_expert_norm.weight") in self.w.source.weight_map:
                out = rms_norm(out, self.eps, w(p + "routed_expert_norm.weight"))
            out = self.lin(out, p + "routed_expert_up_proj.weight")
        s = p + "shared_experts."
        shared = situ(
            self.lin(x, s + "gate_proj.weight"), self.lin(x, s + "up_proj.weight"), self.beta, self.lbeta
        )
        return out + self.lin(shared, s + "down_proj.weight")

    # --- the model ---
    def logits(self, tokens: list[int], trace: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """float32 logits (T, vocab) for a token sequence, every position. ``trace`` collects the
        intermediate values under llama.cpp's callback names (``attn_out-3``, ``l_out-3``, ...)."""
        w, cfg = self.w, self.cfg
        trace = trace if trace is not None else {}
        x = w("model.embed_tokens.weight")[np.asarray(tokens)]
        bank: list[np.ndarray] = []
        use_res = self.block > 0
        for il in range(cfg.n_layer):
            p = f"model.layers.{il}."
            prefix = x
            cur = self.res_mix(prefix, bank, self.res_score(p + "self_attention_res")) if use_res else prefix
            banked = use_res and il % self.block == 0
            if banked:
                bank.append(prefix)  # the raw layer input, not the mix
            h = rms_norm(cur, self.eps, w(p + "input_layernorm.weight"))
            trace[f"attn_norm-{il}"] = h
            attn = self.mla(il, h) if cfg.is_mla(il) else self.kda(il, h)
            trace[f"{'mla' if cfg.is_mla(il) else 'kda'}_out-{il}"] = attn
            prefix = attn if banked else prefix + attn  # a checkpoint restarts the stream
            cur = self.res_mix(prefix, bank, self.res_score(p + "mlp_res")) if use_res else prefix
            h = rms_norm(cur, self.eps, w(p + "post_attention_layernorm.weight"))
            trace[f"ffn_norm-{il}"] = h
            ffn = self.moe(il, h) if cfg.is_moe(il) else self.dense(il, h)
            trace[f"ffn_out-{il}"] = ffn
            x = prefix + ffn
            trace[f"l_out-{il}"] = x
        if use_res:
            x = self.res_mix(x, bank, self.res_score("model.output_attn_res"))
        x = rms_norm(x, self.eps, w("model.norm.weight"))
        trace["result_norm"] = x
        return self.lin(x, "lm_head.weight")
