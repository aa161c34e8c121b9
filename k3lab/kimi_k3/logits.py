"""Proof by logits: the NumPy reference on the source vs llama.cpp on the converted GGUF.

The verdict (``check_stages``): every stage of llama.cpp's forward pass, the reference fed
llama.cpp's *own* input for that stage, per-position NMSE = sum((test - ref)^2) / sum(ref^2) below
``STAGE_THRESHOLD``. It proves each converted tensor means what its source means, whatever the
weights look like: rounding cannot compound across stages, and a near-tie in a router cannot flip
an expert choice between the two (the reference uses llama.cpp's choice and checks it apart).

For information (``check_logits``): the whole model end to end, the field's usual check (llama.cpp's
model-conversion NMSE of the logits, "excellent" below 1e-4, and top-1 agreement). On trained or
well-conditioned weights it passes too; on weights drawn at random, tiny rounding differences
compound through the layers, so it is not the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.moonshot_judge import JUDGE_THRESHOLD
from k3lab.kimi_k3.reference import Reference, rms_norm
from k3lab.pipeline.sources.base import Source

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

    def summary(self) -> str:
        agree = int((self.top1_ref == self.top1_test).sum())
        return (
            f"{len(self.tokens)} positions, max NMSE {self.nmse.max():.3e} (mean {self.nmse.mean():.3e}), "
            f"top-1 agreement {agree}/{len(self.tokens)}"
        )

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


def llama_tokenize(gguf_path: str | Path, prompt: str) -> list[int]:
    """The prompt's ids by llama.cpp's own tokenizer (the vocabulary alone is loaded)."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    return list(vocab.tokenize(prompt.encode(), add_bos=False, special=False))


def llama_logits(
    gguf_path: str | Path, tokens: list[int] | None = None, prompt: str | None = None, threads: int = 2
) -> tuple[list[int], np.ndarray]:
    """Logits at every position from llama.cpp (llama-cpp-python) for the given tokens or prompt.
    The prompt is tokenized first, so that the context fits it whatever the vocabulary makes of it."""
    try:
        import llama_cpp
    except ImportError:
        raise K3LabError("check-logits needs llama-cpp-python (`make test` installs it)") from None
    if not Path(gguf_path).is_file():
        raise K3LabError(f"{gguf_path}: not found")
    if tokens is None:
        tokens = llama_tokenize(gguf_path, prompt or DEFAULT_PROMPT)
    if not tokens:
        raise K3LabError("check-logits: the prompt gives no tokens")
    n_ctx = len(tokens) + 64
    # an F32 KV cache: MLA attention is then not rounded to F16 (the reference assumes none)
    llm = llama_cpp.Llama(
        str(gguf_path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        logits_all=True,
        verbose=False,
        type_k=0,
        type_v=0,
    )
    llm.eval(tokens)
    return list(tokens), np.array(llm.scores[: len(tokens)], dtype=np.float32)


def check_logits(
    source: Source,
    gguf_path: str | Path,
    prompt: str | None = None,
    tokens: list[int] | None = None,
    threshold: float = THRESHOLD,
    mode: str = "ggml",
) -> LogitsReport:
    """Whole-model logits, the reference against llama.cpp (information: on weights drawn at random,
    tiny rounding differences compound through the layers; the verdict is ``check_stages``)."""
    tokens, test = llama_logits(gguf_path, tokens, prompt)
    cfg = K3Config.load(source.meta_dir)
    ref = Reference(cfg, source, mode).logits(tokens)
    return compare(tokens, ref, test, threshold)


# A correct conversion differs from the reference, stage by stage, only by accumulation order and the
# odd rounding flip (an ulp of expf or sigmoid turning one BF16 or Q8_0 rounding): one BF16 flip moves
# one value by 2^-8 of itself, one Q8_0 flip by a 127th of its block's largest, so a stage's NMSE
# stays near 1e-6 (the worst seen over every checkpoint kind in the tests is in the README). A wrong
# transform moves whole rows, heads or experts: NMSE 1e-2 and up. 1e-4 sits two decades from each.
STAGE_THRESHOLD = 1e-4
ROUTER_MARGIN = 1e-4  # a different expert choice counts only where the reference's choice is this clear


@dataclass
class StageReport:
    rows: list[tuple[str, float, str]]  # (llama.cpp tensor, max NMSE over positions, what it checks)
    threshold: float = STAGE_THRESHOLD
    # with --judge moonshot: per stage, the reference with Moonshot's semantics against Moonshot's own
    # forward (a failure past JUDGE_THRESHOLD), and what llama.cpp's own choices do to Moonshot's
    # forward there, with the deviations that do it (information: ``moonshot_judge``)
    moonshot: dict[str, float] | None = None
    runtime: Any = None  # ``moonshot_judge.RuntimeEffect``
    generation: Any = None  # ``generation.Generation``: decoding token by token, judged per position

    @property
    def failed(self) -> list[str]:
        bad = [name for name, nmse, _ in self.rows if not nmse <= self.threshold]
        if self.moonshot:
            bad += [
                f"{name} (k3lab's reference against Moonshot's forward)"
                for name, nmse in self.moonshot.items()
                if not nmse <= JUDGE_THRESHOLD
            ]
        if self.generation is not None and self.generation.failed:
            bad.append(f"generation (decode against prefill: median {self.generation.median:.2e})")
        return bad

    @property
    def worst(self) -> tuple[str, float, str]:
        return max(self.rows, key=lambda r: r[1] if r[1] == r[1] else np.inf)

    def table(self, every: bool = True) -> str:
        judged = self.moonshot is not None
        lines = [
            f"{'stage (llama.cpp tensor)':<30} {'max NMSE':>10}"
            + (f" {'Moonshot':>10} {'runtime':>10}" if judged else "")
            + "  checks"
        ]
        for name, nmse, checks in self.rows:
            other = _judged(self.moonshot, name)
            moved = _judged(self.runtime.stages if self.runtime is not None else None, name)
            bad = not nmse <= self.threshold or (other is not None and not other <= JUDGE_THRESHOLD)
            column = ""
            if judged:
                column = f" {other:>10.3e}" if other is not None else f" {'':>10}"
                column += f" {moved[0]:>10.3e}" if moved is not None else f" {'':>10}"
            cause = f"  (runtime: {moved[1]})" if moved is not None and moved[1] != "none" else ""
            if every or bad:
                lines.append(
                    f"{name:<30} {nmse:>10.3e}{column}  {checks}{cause}{'  <-- FAIL' if bad else ''}"
                )
        if judged:
            worst = max(self.moonshot.values(), default=0.0)
            lines.append(
                f"Moonshot's own forward (float32, fla's references) against the reference with Moonshot's "
                f"semantics: {len(self.moonshot)} stages, worst {worst:.2e} (threshold {JUDGE_THRESHOLD:g})"
            )
            lines += self.runtime.lines() if self.runtime is not None else []
        if self.generation is not None:
            lines += [self.generation.table()] if every else []
            lines.append(self.generation.summary())
        name, nmse, _ = self.worst
        wrong = sum(1 for _, v, _ in self.rows if not v <= self.threshold)
        lines.append(
            f"{len(self.rows) - wrong}/{len(self.rows)} stages agree, each given llama.cpp's own "
            f"input (threshold {self.threshold:g}; worst {name} {nmse:.2e})"
            + (f"; first wrong: {self.failed[0]}" if self.failed else "")
        )
        return "\n".join(lines)


def _judged(found: dict[str, Any] | None, name: str) -> Any:
    """A judged stage by llama.cpp's row name (a banked layer's attention is its ``prefix_sum_attn``)."""
    if not found:
        return None
    if name.startswith("prefix_sum_attn-"):
        il = name.rsplit("-", 1)[1]
        return found.get(f"kda_out-{il}", found.get(f"mla_out-{il}"))
    return found.get(name)


def _nmse(want: np.ndarray, have: np.ndarray) -> float:
    want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
    if want.shape != have.shape:
        return float("inf")
    return float((((have - want) ** 2).sum(-1) / np.maximum((want**2).sum(-1), 1e-30)).max())


STAGE_NAMES = (
    "res_probs",
    "attn_norm",
    "kda_out",
    "mla_out",
    "prefix_sum_attn",
    "ffn_norm",
    "ffn_out",
    "l_out",
    "ffn_moe_topk",
    "ffn_moe_argsort",
)


def check_stages(
    source: Source,
    gguf_path: str | Path,
    tokens: list[int],
    mode: str = "ggml",
    threshold: float = STAGE_THRESHOLD,
) -> StageReport:
    """Every stage of the forward pass, the reference given llama.cpp's own input for it: the embedding
    lookup, each AttnRes mix, each norm, each attention block, each router's choice, each FFN, the
    final mix, norm and head. A wrong tensor is named where it acts, whatever the weights look like."""
    from k3lab.kimi_k3.llama_trace import trace

    cfg = K3Config.load(source.meta_dir)
    ref = Reference(cfg, source, mode)
    w, eps, bs, n = ref.w, ref.eps, ref.block, cfg.n_layer
    names = {"inp_embd", "result_norm", "result_output", "res_probs"}
    names |= {f"{x}-{il}" for x in STAGE_NAMES for il in range(n)}
    got = trace(gguf_path, tokens, names)

    def one(name: str, i: int = 0) -> np.ndarray:
        if name not in got or len(got[name]) <= i:
            raise K3LabError(f"{gguf_path}: llama.cpp's graph did not report {name} (another kimi-k3 graph?)")
        return got[name][i]

    rows: list[tuple[str, float, str]] = []

    def row(name: str, want: np.ndarray, have: np.ndarray, checks: str) -> None:
        rows.append((name, _nmse(want, have), checks))

    k = int(cfg["num_experts_per_token"])
    row("inp_embd", w("model.embed_tokens.weight")[np.asarray(tokens)], one("inp_embd"), "token_embd")
    bank: list[np.ndarray] = []

    def res_mix(
        cur: np.ndarray, probs_name: str, occurrence: int, score: str, label: str, checks: str
    ) -> np.ndarray:
        """One AttnRes mix: llama.cpp's probabilities checked against the reference's, and the
        stream mixed with llama.cpp's own (so that the next stage sees only its own error)."""
        if not bs or not bank:  # no AttnRes, or nothing banked yet (layer 0's attention)
            return cur
        have = one(probs_name, occurrence)
        row(label, ref.res_probs(cur, bank, ref.res_score(score)), have, checks)
        return ref.mix(cur, bank, have)

    layer_in = one("inp_embd")
    for il in range(n):
        p = f"model.layers.{il}."
        mixes = 1 if bs and bank else 0  # res_probs-{il} occurs once per mix: the attention's, then the FFN's
        mixed = res_mix(
            layer_in,
            f"res_probs-{il}",
            0,
            p + "self_attention_res",
            f"res_probs-{il} (attention)",
            f"blk.{il}.attn_res_score",
        )
        banked = bool(bs) and il % bs == 0
        if banked:
            bank.append(layer_in)
        normed = one(f"attn_norm-{il}")
        row(
            f"attn_norm-{il}",
            rms_norm(mixed, eps, w(p + "input_layernorm.weight")),
            normed,
            f"blk.{il}.attn_norm",
        )
        kind = "mla" if cfg.is_mla(il) else "kda"
        out = f"prefix_sum_attn-{il}" if banked else f"{kind}_out-{il}"  # a banked layer's output is renamed
        attn = ref.mla(il, normed) if kind == "mla" else ref.kda(il, normed)
        row(out, attn, one(out), f"blk.{il}.{kind.upper()} attention")
        mixed = res_mix(
            one(f"prefix_sum_attn-{il}"),
            f"res_probs-{il}",
            mixes,
            p + "mlp_res",
            f"res_probs-{il} (ffn)",
            f"blk.{il}.ffn_res_score",
        )
        normed = one(f"ffn_norm-{il}")
        row(
            f"ffn_norm-{il}",
            rms_norm(mixed, eps, w(p + "post_attention_layernorm.weight")),
            normed,
            f"blk.{il}.ffn_norm",
        )
        if cfg.is_moe(il):
            chosen = got.get(f"ffn_moe_topk-{il}") or [one(f"ffn_moe_argsort-{il}")]
            selected = chosen[0][:, :k].astype(np.int64)
            rows.append(
                (
                    f"ffn_moe_topk-{il}",
                    _router_disagreement(ref, il, normed, selected),
                    f"blk.{il}.ffn_gate_inp, exp_probs_b (the expert choice)",
                )
            )
            ffn = ref.moe(il, normed, selected)
            what = f"blk.{il}.experts, shared experts, latent projections"
        else:
            ffn = ref.dense(il, normed)
            what = f"blk.{il}.ffn_gate/up/down"
        row(f"ffn_out-{il}", ffn, one(f"ffn_out-{il}"), what)
        layer_in = one(f"l_out-{il}")
    mixed = res_mix(
        layer_in, "res_probs", 0, "model.output_attn_res", "res_probs (output)", "output_res_score"
    )
    normed = one("result_norm")
    last = normed.shape[0]  # llama.cpp normalises the output rows only (here the last token)
    row("result_norm", rms_norm(mixed[-last:], eps, w("model.norm.weight")), normed, "output_norm")
    row("result_output", ref.lin(normed, "lm_head.weight"), one("result_output"), "output")
    return StageReport(rows, threshold)


def _router_disagreement(ref: Reference, il: int, x: np.ndarray, selected: np.ndarray) -> float:
    """0 when llama.cpp chose the experts the reference chooses wherever that choice is clear (its
    k-th and (k+1)-th selection scores more than ROUTER_MARGIN apart); else the share of such tokens
    that differ. Near-ties may go either way: both are correct."""
    _, scores = ref.router(il, x)
    k = selected.shape[1]
    order = np.sort(scores, axis=-1)[:, ::-1]
    clear = order[:, k - 1] - order[:, k] > ROUTER_MARGIN if scores.shape[1] > k else np.ones(len(x), bool)
    differ = (np.sort(selected, axis=-1) != np.sort(ref.select(il, x), axis=-1)).any(-1) & clear
    return float(differ.mean())
