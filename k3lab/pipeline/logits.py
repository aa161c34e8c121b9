"""Proof by logits: the NumPy reference on the source vs llama.cpp on the converted GGUF.

The field's standard (llama.cpp's model-conversion check): per-position normalised MSE of the
logits, NMSE = sum((test - ref)^2) / sum(ref^2); below 1e-4 is "excellent". Also the largest
absolute difference and whether the top-1 token agrees at every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3lab.errors import K3LabError
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.reference import Reference
from k3lab.pipeline.sources import LocalSource

DEFAULT_PROMPT = (
    "The quick brown fox converts every shard of the model. 人工智能正在改变世界。 "
    "def repack(x): return x  # 12345"
)
THRESHOLD = 1e-4


@dataclass
class LogitsReport:
    tokens: list[int]
    nmse: np.ndarray  # per position
    max_abs: np.ndarray
    top1_ref: np.ndarray
    top1_test: np.ndarray
    threshold: float = THRESHOLD

    @property
    def ok(self) -> bool:
        return bool((self.nmse <= self.threshold).all() and (self.top1_ref == self.top1_test).all())

    def table(self) -> str:
        lines = [
            f"{'pos':>4} {'token':>7} {'NMSE':>10} {'max |diff|':>11} {'top-1 ref':>9} {'top-1 gguf':>10}"
        ]
        for i, tok in enumerate(self.tokens):
            mark = (
                ""
                if self.nmse[i] <= self.threshold and self.top1_ref[i] == self.top1_test[i]
                else "  <-- FAIL"
            )
            lines.append(
                f"{i:>4} {tok:>7} {self.nmse[i]:>10.3e} {self.max_abs[i]:>11.4g} {self.top1_ref[i]:>9} "
                f"{self.top1_test[i]:>10}{mark}"
            )
        agree = int((self.top1_ref == self.top1_test).sum())
        lines.append(
            f"max NMSE {self.nmse.max():.3e} (threshold {self.threshold:g}), mean {self.nmse.mean():.3e}; "
            f"top-1 agreement {agree}/{len(self.tokens)}: {'OK' if self.ok else 'FAILED'}"
        )
        return "\n".join(lines)


def compare(
    tokens: list[int], ref: np.ndarray, test: np.ndarray, threshold: float = THRESHOLD
) -> LogitsReport:
    diff = test.astype(np.float64) - ref.astype(np.float64)
    nmse = (diff**2).sum(-1) / np.maximum((ref.astype(np.float64) ** 2).sum(-1), 1e-30)
    return LogitsReport(tokens, nmse, np.abs(diff).max(-1), ref.argmax(-1), test.argmax(-1), threshold)


def llama_logits(
    gguf_path: str | Path, tokens: list[int] | None = None, prompt: str | None = None, threads: int = 2
) -> tuple[list[int], np.ndarray]:
    """Logits at every position from llama.cpp (llama-cpp-python) for the given tokens or prompt."""
    try:
        import llama_cpp
    except ImportError:
        raise K3LabError("check-logits needs llama-cpp-python (`make test` installs it)") from None
    if not Path(gguf_path).exists():
        raise K3LabError(f"{gguf_path}: not found")
    # an F32 KV cache: MLA attention is then not rounded to F16 (the reference assumes none)
    llm = llama_cpp.Llama(
        str(gguf_path),
        n_ctx=max(64, 2 * len(tokens or []) + 64),
        n_batch=512,
        n_threads=threads,
        logits_all=True,
        verbose=False,
        type_k=0,
        type_v=0,
    )
    if tokens is None:
        tokens = llm.tokenize((prompt or DEFAULT_PROMPT).encode(), add_bos=False, special=False)
    llm.eval(tokens)
    return list(tokens), np.array(llm.scores[: len(tokens)], dtype=np.float32)


def check_logits(
    meta_dir: str | Path,
    src_dir: str | Path,
    gguf_path: str | Path,
    prompt: str | None = None,
    tokens: list[int] | None = None,
    threshold: float = THRESHOLD,
    mode: str = "ggml",
) -> LogitsReport:
    tokens, test = llama_logits(gguf_path, tokens, prompt)
    cfg = K3Config.load(meta_dir)
    ref = Reference(cfg, LocalSource(src_dir, meta_dir), mode).logits(tokens)
    return compare(tokens, ref, test, threshold)


BLOCK_THRESHOLD = 1e-5


@dataclass
class BlockReport:
    rows: list[tuple[str, float]]  # (llama.cpp tensor name, max NMSE over positions)
    threshold: float = BLOCK_THRESHOLD

    @property
    def failed(self) -> list[str]:
        return [name for name, nmse in self.rows if not nmse <= self.threshold]

    def table(self) -> str:
        lines = [
            f"{'block output (llama.cpp name)':<32} {'max NMSE':>10}   given llama.cpp's own block input"
        ]
        for name, nmse in self.rows:
            lines.append(f"{name:<32} {nmse:>10.3e}{'  <-- FAIL' if not nmse <= self.threshold else ''}")
        lines.append(
            f"{len(self.rows) - len(self.failed)}/{len(self.rows)} blocks agree (threshold "
            f"{self.threshold:g})" + (f"; first wrong: {self.failed[0]}" if self.failed else "")
        )
        return "\n".join(lines)


def check_blocks(
    meta_dir: str | Path,
    src_dir: str | Path,
    gguf_path: str | Path,
    tokens: list[int],
    mode: str = "ggml",
    threshold: float = BLOCK_THRESHOLD,
) -> BlockReport:
    """Each attention and FFN block of the reference, fed llama.cpp's own input, against its output."""
    from k3lab.pipeline.llama_trace import trace

    cfg = K3Config.load(meta_dir)
    ref = Reference(cfg, LocalSource(src_dir, meta_dir), mode)
    block = int(cfg["attn_res_block_size"])
    plan: list[tuple[str, str, object]] = []
    for il in range(cfg.n_layer):
        kind = "mla" if cfg.is_mla(il) else "kda"
        # on a banked layer the attention output is the new stream, and llama.cpp names it so
        out = f"prefix_sum_attn-{il}" if block and il % block == 0 else f"{kind}_out-{il}"
        plan.append((f"attn_norm-{il}", out, ref.mla if kind == "mla" else ref.kda))
        plan.append((f"ffn_norm-{il}", f"ffn_out-{il}", ref.moe if cfg.is_moe(il) else ref.dense))
    got = trace(gguf_path, tokens, {name for pair in plan for name in pair[:2]})
    rows = []
    for inp, out, fn in plan:
        il = int(out.rsplit("-", 1)[1])
        want = fn(il, got[inp])
        nmse = ((got[out] - want) ** 2).sum(-1) / np.maximum((want**2).sum(-1), 1e-30)
        rows.append((f"{out}", float(nmse.max())))
    return BlockReport(rows, threshold)
