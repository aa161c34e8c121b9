"""Kimi-K3's transforms: small pure functions, arrays in, array out, with an exact inverse where one
exists.

Each transform takes the source arrays and the config and returns the output array in numpy
order. ``shape`` computes the output shape from the source shapes alone (the planner uses it; no
data is read). ``on_values`` marks the two that compute (on float32, BF16 widened exactly); the
others only move bytes, so they run on BF16 bit patterns as they are. How each streams and what it
holds at once is the pipeline's (``pipeline.streams``); the generic ones (copy, expert stacks, MXFP4
stacks) come from there too.
"""

from __future__ import annotations

import numpy as np

from k3lab.kimi_k3.config import K3Config
from k3lab.pipeline.streams import GENERIC, Shape, Transform, TransformError


def neg_exp(a_log: np.ndarray, cfg: K3Config) -> np.ndarray:
    """ssm_a = -exp(A_log), folded at conversion so the graph need not (first n_head entries)."""
    return -np.exp(a_log.astype(np.float32).reshape(-1)[: cfg.kda_n_head])


def _neg_exp_shape(s: Shape, cfg: K3Config) -> Shape:
    n = int(np.prod(s))
    if n < cfg.kda_n_head:
        raise TransformError(f"A_log has {n} values, fewer than num_heads {cfg.kda_n_head}")
    return (cfg.kda_n_head,)


def conv1d_4d(w: np.ndarray, cfg: K3Config | None = None) -> np.ndarray:
    """HF [d_inner, 1, d_conv] (or [d_inner, d_conv]) -> numpy [1, d_inner, 1, d_conv], ggml ne
    [d_conv, 1, d_inner, 1]. d_conv varies fastest in both, so this is a pure reshape."""
    return w.reshape(_conv_shape(w.shape))


def _conv_shape(s: Shape, cfg: K3Config | None = None) -> Shape:
    if len(s) == 3 and s[1] == 1:
        return (1, s[0], 1, s[2])
    if len(s) == 2:
        return (1, s[0], 1, s[1])
    raise TransformError(f"conv1d weight of shape {list(s)}: expected [d_inner, 1, d_conv]")


def conv1d_from_4d(w: np.ndarray, cfg: K3Config | None = None) -> np.ndarray:
    return w.reshape(w.shape[1], 1, w.shape[3])


def fuse_res_score(norm: np.ndarray, proj: np.ndarray, cfg: K3Config | None = None) -> np.ndarray:
    """AttnRes: the model only ever uses norm.weight * proj.weight, so store the product. Both are
    BF16 (8-bit significands), so their product is exact in float32 (24-bit significand)."""
    return norm.astype(np.float32).reshape(-1) * proj.astype(np.float32).reshape(-1)


def _fuse_shape(norm: Shape, proj: Shape, cfg: K3Config | None = None) -> Shape:
    n, p = int(np.prod(norm)), int(np.prod(proj))
    if n != p:
        raise TransformError(f"AttnRes norm has {n} values but proj has {p}")
    return (n,)


def _kv_b_dims(cfg: K3Config) -> tuple[int, int, int]:
    t = cfg.text
    return cfg.n_head, t["qk_nope_head_dim"], t["v_head_dim"]


def _kv_b_check(s: Shape, cfg: K3Config) -> tuple[int, int, int, int]:
    nh, nope, v = _kv_b_dims(cfg)
    if len(s) != 2 or s[0] != nh * (nope + v):
        raise TransformError(
            f"kv_b_proj of shape {list(s)}: expected [{nh} heads x ({nope} + {v}), kv_lora_rank]"
        )
    return nh, nope, v, s[1]


def k_b_from_kv_b(kv_b: np.ndarray, cfg: K3Config) -> np.ndarray:
    """MLA absorption: per head, the first qk_nope rows of kv_b are K; transpose them.
    numpy (n_head, kv_lora, qk_nope), ggml ne [qk_nope, kv_lora, n_head]."""
    nh, nope, v, r = _kv_b_check(kv_b.shape, cfg)
    return np.ascontiguousarray(kv_b.reshape(nh, nope + v, r)[:, :nope, :].transpose(0, 2, 1))


def v_b_from_kv_b(kv_b: np.ndarray, cfg: K3Config) -> np.ndarray:
    """Per head, the last v_head_dim rows of kv_b are V. numpy (n_head, v_head, kv_lora)."""
    nh, nope, v, r = _kv_b_check(kv_b.shape, cfg)
    return np.ascontiguousarray(kv_b.reshape(nh, nope + v, r)[:, nope:, :])


def kv_b_from_k_b_v_b(k_b: np.ndarray, v_b: np.ndarray, cfg: K3Config) -> np.ndarray:
    """The exact inverse of the split: interleave each head's K (transposed back) and V rows."""
    nh, nope, v = _kv_b_dims(cfg)
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(nh * (nope + v), -1)


def _k_b_shape(s: Shape, cfg: K3Config) -> Shape:
    nh, nope, _, r = _kv_b_check(s, cfg)
    return (nh, r, nope)


def _v_b_shape(s: Shape, cfg: K3Config) -> Shape:
    nh, _, v, r = _kv_b_check(s, cfg)
    return (nh, v, r)


def _vision_heads(cfg: K3Config) -> int:
    return int(cfg.vision["vt_num_attention_heads"])


def _rope_perm(n_head: int, head_dim: int) -> np.ndarray:
    """Row order that turns each head's interleaved 2-D RoPE pairs into llama.cpp's split layout:
    within a head, rows (d//4, 2, 2) -> (2, d//4, 2)."""
    return np.arange(n_head * head_dim).reshape(n_head, head_dim // 4, 2, 2).transpose(0, 2, 1, 3).reshape(-1)


def qkv_rope_split(w: np.ndarray, cfg: K3Config) -> np.ndarray:
    """MoonViT's fused wqkv [3*qkv, C] (or its bias): Q and K rows permuted per head, V untouched."""
    qkv = w.shape[0] // 3
    n_head = _vision_heads(cfg)
    perm = _rope_perm(n_head, qkv // n_head)
    return np.concatenate([w[:qkv][perm], w[qkv : 2 * qkv][perm], w[2 * qkv :]])


def qkv_rope_merge(w: np.ndarray, cfg: K3Config) -> np.ndarray:
    """The exact inverse of qkv_rope_split."""
    qkv = w.shape[0] // 3
    n_head = _vision_heads(cfg)
    inv = np.argsort(_rope_perm(n_head, qkv // n_head))
    return np.concatenate([w[:qkv][inv], w[qkv : 2 * qkv][inv], w[2 * qkv :]])


def _qkv_shape(s: Shape, cfg: K3Config) -> Shape:
    n_head = _vision_heads(cfg)
    if s[0] % 3 or (s[0] // 3) % (4 * n_head):
        raise TransformError(f"wqkv of shape {list(s)}: rows must be 3 x heads ({n_head}) x a multiple of 4")
    return s


TRANSFORMS: dict[str, Transform] = GENERIC | {
    t.name: t
    for t in [
        Transform("neg_exp", neg_exp, _neg_exp_shape, "-exp(A_log), first num_heads values", on_values=True),
        Transform(
            "conv1d_4d",
            conv1d_4d,
            _conv_shape,
            "reshape [d_inner, 1, d_conv] -> ne [d_conv, 1, d_inner, 1]",
            inverse=conv1d_from_4d,
        ),
        Transform(
            "fuse_res_score",
            fuse_res_score,
            _fuse_shape,
            "norm.weight * proj.weight, exact in F32",
            on_values=True,
        ),
        Transform("k_b", k_b_from_kv_b, _k_b_shape, "kv_b per head: first qk_nope rows, transposed"),
        Transform("v_b", v_b_from_kv_b, _v_b_shape, "kv_b per head: last v_head_dim rows"),
        Transform(
            "qkv_rope_split",
            qkv_rope_split,
            _qkv_shape,
            "Q and K rows permuted per head (interleaved -> split 2-D RoPE), V as is",
            inverse=qkv_rope_merge,
        ),
    ]
}
