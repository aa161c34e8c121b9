"""llama.cpp's ``kimi-k3`` architecture: its GGUF hyperparameter keys, derived from the config.

PyPI gguf 0.19 predates ``kimi-k3``, so the key names live here, in one table, spelled as
upstream's gguf-py constants spell them. llama.cpp's loader (``src/models/kimi-k3.cpp``) is the
judge of which are required; the tests load our files with it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
from gguf import ExpertGatingFuncType, GGUFValueType, LlamaFileType

from k3lab.formats.gguf_stream import KV
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.tokenizer import build_vocabulary

ARCH = "kimi-k3"
FILE_TYPE = {
    "MXFP4_MOE": LlamaFileType.MOSTLY_MXFP4_MOE,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "F16": LlamaFileType.MOSTLY_F16,
    "F32": LlamaFileType.ALL_F32,
}


U32, F32, BOOL, ARR, I32 = (
    GGUFValueType.UINT32,
    GGUFValueType.FLOAT32,
    GGUFValueType.BOOL,
    GGUFValueType.ARRAY,
    GGUFValueType.INT32,
)


def hyperparameters(cfg: K3Config) -> list[KV]:
    """Every ``kimi-k3.*`` key llama.cpp reads, from the config (the order is the file's order)."""
    t = cfg.text
    kv_lora, rope, nope = t["kv_lora_rank"], t["qk_rope_head_dim"], t["qk_nope_head_dim"]
    kvs = [
        KV(f"{ARCH}.block_count", cfg.n_layer, U32),
        KV(f"{ARCH}.context_length", t["max_position_embeddings"], U32),
        KV(f"{ARCH}.embedding_length", cfg.n_embd, U32),
        KV(f"{ARCH}.feed_forward_length", t["intermediate_size"], U32),
        KV(f"{ARCH}.attention.head_count", cfg.n_head, U32),
        # MLA is served as MQA over the compressed latent (1 kv head); 0 marks a KDA layer
        KV(
            f"{ARCH}.attention.head_count_kv",
            [1 if cfg.is_mla(i) else 0 for i in range(cfg.n_layer)],
            ARR,
            I32,
        ),
        KV(f"{ARCH}.attention.layer_norm_rms_epsilon", t["rms_norm_eps"], F32),
        KV(f"{ARCH}.expert_count", cfg.n_expert, U32),
        KV(f"{ARCH}.expert_used_count", t["num_experts_per_token"], U32),
        # grouped routing, as upstream writes it when the config names it
        *([KV(f"{ARCH}.expert_group_count", t["n_group"], U32)] if t.get("n_group") is not None else []),
        *(
            [KV(f"{ARCH}.expert_group_used_count", t["topk_group"], U32)]
            if t.get("topk_group") is not None
            else []
        ),
        KV(f"{ARCH}.expert_gating_func", int(ExpertGatingFuncType.SIGMOID), U32),
        KV(f"{ARCH}.vocab_size", cfg.n_vocab, U32),
        KV(f"{ARCH}.ssm.conv_kernel", cfg.linear_attn["short_conv_kernel_size"], U32),
        KV(f"{ARCH}.kda.head_dim", cfg.kda_head_dim, U32),
    ]
    if cfg.gate_lower_bound is not None:
        kvs.append(KV(f"{ARCH}.kda.gate_lower_bound", cfg.gate_lower_bound, F32))
    if t.get("q_lora_rank") is not None:
        kvs.append(KV(f"{ARCH}.attention.q_lora_rank", t["q_lora_rank"], U32))
    kvs += [
        KV(f"{ARCH}.attention.kv_lora_rank", kv_lora, U32),
        KV(f"{ARCH}.rope.dimension_count", rope, U32),
        KV(f"{ARCH}.attention.key_length", kv_lora + rope, U32),
        KV(f"{ARCH}.attention.value_length", kv_lora, U32),
        KV(f"{ARCH}.attention.key_length_mla", nope + rope, U32),
        KV(f"{ARCH}.attention.value_length_mla", t["v_head_dim"], U32),
        KV(f"{ARCH}.expert_feed_forward_length", t["moe_intermediate_size"], U32),
        KV(f"{ARCH}.expert_shared_count", t["num_shared_experts"], U32),
        KV(f"{ARCH}.leading_dense_block_count", cfg.n_dense_lead, U32),
        KV(f"{ARCH}.expert_weights_scale", float(t["routed_scaling_factor"]), F32),
        KV(f"{ARCH}.expert_weights_norm", bool(t["moe_renormalize"]), BOOL),
    ]
    if cfg.is_latent_moe:
        kvs.append(KV(f"{ARCH}.expert_latent_length", cfg.latent_dim, U32))
    kvs += [
        KV(f"{ARCH}.activation.situ_beta", float(t["activation_situ_beta"]), F32),
        KV(f"{ARCH}.activation.situ_linear_beta", float(t["activation_situ_linear_beta"]), F32),
        KV(f"{ARCH}.attn_res.block_size", t["attn_res_block_size"], U32),
    ]
    theta = t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:  # the test model carries one; MLA is NoPE, so it is informational
        kvs.append(KV(f"{ARCH}.rope.freq_base", float(theta), F32))
    return kvs


def size_label(tensors: list[tuple[str, tuple[int, ...]]]) -> str:
    """gguf-py's parameter class (``8x1.4M``, ``2.8T``), counted as upstream's writer counts it: a
    stacked ``*_exps`` tensor contributes one expert's parameters, everything else all of its own."""
    total = shared = expert = expert_sum = n_expert_tensors = 0
    for name, shape in tensors:  # shape in numpy order, values (not bytes)
        size = 1
        for d in shape:
            size *= d
        total += size
        if "_exps." in name and len(shape) >= 3:
            n = shape[-2] if ".bias" in name else shape[-3]
            expert += size // n
            expert_sum += n
            n_expert_tensors += 1
        else:
            shared += size
    count = expert_sum // n_expert_tensors if n_expert_tensors else 0
    return gguf.size_label(total, shared, expert, count)


def general(cfg: K3Config, name: str, file_type: str, size: str | None = None) -> list[KV]:
    kvs = [
        KV(gguf.Keys.General.ARCHITECTURE, ARCH, GGUFValueType.STRING),
        KV(gguf.Keys.General.TYPE, "model", GGUFValueType.STRING),
        KV(gguf.Keys.General.NAME, name, GGUFValueType.STRING),
    ]
    if size:
        kvs.append(KV(gguf.Keys.General.SIZE_LABEL, size, GGUFValueType.STRING))
    return kvs + [
        KV(gguf.Keys.General.FILE_TYPE, int(FILE_TYPE[file_type]), U32),
        KV(gguf.Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION, U32),
    ]


def model_kvs(
    cfg: K3Config,
    meta_dir: str | Path,
    name: str,
    file_type: str,
    chat_template: str | None = None,
    size: str | None = None,
) -> list[KV]:
    """Everything the first file of a split set (or the standalone tokenizer GGUF) carries besides
    the split keys: general.*, every kimi-k3.* hyperparameter and the tokenizer. ``chat_template``
    (a template's text) replaces the source's own; ``size`` is the size label."""
    vocab = build_vocabulary(meta_dir, cfg, chat_template)
    return general(cfg, name, file_type, size) + hyperparameters(cfg) + vocab.kvs()


def file_kvs(
    cfg: K3Config,
    meta_dir: Path,
    name: str,
    file_type: str,
    chat_template: str | None,
    tensors: list[tuple[str, tuple[int, ...]]],
) -> list[KV]:
    """File 1's metadata, with the size label counted over the planned ``tensors``."""
    return model_kvs(cfg, meta_dir, name, file_type, chat_template, size_label(tensors))


def tokenizer_kvs(meta_dir: str | Path, chat_template: str | None = None) -> list[KV]:
    """The standalone tokenizer GGUF's metadata: the vocabulary plus every ``kimi-k3.*``
    hyperparameter. ``chat_template`` (a template's text) replaces the source's own."""
    cfg = K3Config.load(meta_dir)
    return model_kvs(
        cfg, meta_dir, "Kimi-K3 tokenizer", "MXFP4_MOE" if cfg.is_mxfp4 else "BF16", chat_template
    )
