"""How far a variant moves the next token, as publishers report it: ``llama-perplexity --kl-divergence``'s
figures (mean, median, 99th and 99.9th percentile KL from the lossless set, the share of positions whose
top token is the same), computed on the same tokens the same way (the tree llama-cpp-python 0.3.36
vendors, ``tools/perplexity/perplexity.cpp``):

- the text is tokenised with the model's BOS, cut into chunks of ``n_ctx`` tokens (as many whole chunks
  as it holds), each run from an empty context with its first token made BOS, in one batch of
  ``n_ctx`` (llama-perplexity's ``-b N_CTX``; by default it runs ``2048 / n_ctx`` chunks side by side) (ubatches of 512, the default f16 cache, flash attention on: llama-perplexity's "auto" takes it
  on the CPU, and it moves 1% of the logits by up to a quarter of a nat on a random-weight model);
- only the second half of each chunk is scored: the logits at positions ``n_ctx/2`` to ``n_ctx - 2``;
- the lossless set's log-probabilities are kept as llama-perplexity keeps them in its base file: per
  position a scale and a minimum over the 16 nats below the top, each token's in 16 bits; a token below
  that window counts nothing;
- per position KL = sum over those tokens of p_base (log p_base - log q), in float32 terms summed in
  float64; the top tokens compared are the variant's and the stored base's (the first of equal ones).

``tests/pipeline/test_divergence.py`` holds these figures to llama-perplexity's own on the same text."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

UBATCH = 512  # llama-perplexity's default ubatch


@dataclass(frozen=True)
class KLStats:
    """llama-perplexity's "KL divergence statistics" and "Same top p" for one variant."""

    label: str
    positions: int
    mean: float
    median: float
    p99: float
    p999: float
    maximum: float
    same_top: float  # a share, 0..1

    def line(self) -> str:
        return (f"{self.label}: KLD mean {self.mean:.6f}, median {self.median:.6f}, 99% {self.p99:.6f}, 99.9% "
                f"{self.p999:.6f}, max {self.maximum:.6f} over {self.positions} positions; same top "
                f"{100 * self.same_top:.3f}%")  # fmt: skip


def chunk_logits(gguf_path: str | Path, text: str, n_ctx: int) -> Iterator[tuple[list[int], np.ndarray]]:
    """Chunk by chunk, the chunk of ``text`` and the float32 logits at its scored positions, as
    llama-perplexity evaluates them (one ``llama_cpp.Llama`` for all chunks, its memory cleared before
    each; one chunk's logits held at a time: a long text costs time, not memory)."""
    import llama_cpp

    from k3lab.errors import K3LabError

    llm = llama_cpp.Llama(str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(UBATCH, n_ctx), n_threads=2,
                          flash_attn=True, verbose=False)  # fmt: skip
    tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
    n_chunk = len(tokens) // n_ctx
    if n_chunk < 1:
        raise K3LabError(f"the text gives {len(tokens)} tokens: fewer than one chunk of {n_ctx}")
    bos = (
        llm.token_bos()
        if llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))
        else None
    )
    first = n_ctx // 2
    n_vocab = llm.n_vocab()
    batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
    try:
        for k in range(n_chunk):
            chunk = list(tokens[k * n_ctx : (k + 1) * n_ctx])
            llm._ctx.kv_cache_clear()  # (llama-perplexity's llama_memory_clear: the recurrent states too)
            for pos, token in enumerate(chunk):
                batch.token[pos] = bos if (pos == 0 and bos is not None) else token
                batch.pos[pos] = pos
                batch.n_seq_id[pos] = 1
                batch.seq_id[pos][0] = 0
                batch.logits[pos] = pos >= first  # (only these: the output rows decide ggml's kernel)
            batch.n_tokens = n_ctx
            if llama_cpp.llama_decode(llm._ctx.ctx, batch) != 0:
                raise K3LabError(f"{gguf_path}: llama.cpp could not evaluate chunk {k + 1}")
            out = llama_cpp.llama_get_logits(llm._ctx.ctx)
            rows = np.ctypeslib.as_array(out, shape=((n_ctx - first) * n_vocab,)).reshape(
                n_ctx - first, n_vocab
            )
            yield chunk, rows[: n_ctx - 1 - first].astype(np.float32, copy=True)
    finally:
        llama_cpp.llama_batch_free(batch)


def check_text(gguf_path: str | Path, text: str, n_ctx: int) -> None:
    """One line unless ``text`` holds a whole chunk of ``n_ctx`` tokens of the set's vocabulary (read
    alone, no weights: said before a variant is made)."""
    import llama_cpp

    from k3lab.errors import K3LabError

    vocab = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    n = len(vocab.tokenize(text.encode(), add_bos=True, special=False))
    if n < n_ctx:
        raise K3LabError(f"--kl-text: {n} tokens, fewer than one chunk of --kl-context {n_ctx}")


def _stored(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The base file's rows: (scale, min log-prob, uint16 codes) per position, float32 as llama.cpp's."""
    f32 = np.float32
    max_logit = logits.max(-1)
    min_logit = np.maximum(logits.min(-1), max_logit - f32(16))
    sum_exp = np.exp(logits - max_logit[:, None]).astype(np.float64).sum(-1)
    log_sum_exp = np.log(sum_exp).astype(f32)
    min_log_prob = (min_logit - max_logit - log_sum_exp).astype(f32)
    scale = ((max_logit - min_logit) / f32(65535)).astype(f32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, f32(1) / np.where(scale > 0, scale, f32(1)), f32(0)).astype(f32)
    codes = np.where(logits > min_logit[:, None], np.rint(inv[:, None] * (logits - min_logit[:, None])), 0)
    return scale, min_log_prob, codes.astype(np.uint16)


def _kl_rows(logits: np.ndarray, scale: np.ndarray, min_log_prob: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """KL per position and whether the top tokens agree, as llama-perplexity computes them."""
    f32 = np.float32
    imax = logits.argmax(-1)
    max_logit = logits.max(-1)
    log_sum_exp = np.log(np.exp(logits - max_logit[:, None]).astype(np.float64).sum(-1)).astype(f32)
    top = (max_logit + log_sum_exp).astype(f32)
    p_log_base = (scale[:, None] * codes.astype(f32) + min_log_prob[:, None]).astype(f32)
    inside = p_log_base > f32(-16)
    terms = np.exp(p_log_base) * ((p_log_base - logits) + top[:, None])
    kl = np.where(inside, terms, f32(0)).astype(np.float64).sum(-1)
    return kl, imax == p_log_base.argmax(-1)


def kl_stats(base: str | Path, variant: str | Path, label: str, text: str, n_ctx: int = 512) -> KLStats:
    """``llama-perplexity --kl-divergence``'s figures for ``variant`` against ``base`` on ``text``."""
    kls, same = [], []  # (per position: a float and a bool; the logits go chunk by chunk)
    for (_, b), (_, v) in zip(chunk_logits(base, text, n_ctx), chunk_logits(variant, text, n_ctx)):
        k, s = _kl_rows(v, *_stored(b))
        kls.append(k)
        same.append(s)
    all_kl = np.concatenate(kls)
    values = np.sort(all_kl.astype(np.float32))
    n = values.size

    def percentile(fraction: float) -> float:
        p = np.float32(fraction) * np.float32(n - 1)
        ip = int(p)
        p -= np.float32(ip)
        return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, n - 1)])

    median = 0.5 * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2]
    return KLStats(label, n, float(all_kl.mean()), float(median), percentile(0.99), percentile(0.999),
                   float(values[-1]), float(np.concatenate(same).mean()))  # fmt: skip
