"""llama.cpp's built-in mix (``llama_tensor_get_type_impl`` in ``src/llama-quant.cpp``) as data: one
``Arm`` per tensor category, in llama.cpp's order, each an ``else if`` chain of ``Pick``s; and
``choose_types``, which walks the whole model in llama-quantize's order with its counters (the
tables and facts it reads are ``llama_types``'s)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from k3lab.pipeline.quantizing.llama_types import (
    ALIASES,
    ATTN_K,
    ATTN_OUTPUT,
    ATTN_Q,
    ATTN_QKV,
    ATTN_V_LIKE,
    BLOCK,
    FFN_DOWN,
    FFN_GATE,
    FFN_UP,
    LAYER,
    NEEDS_IMATRIX,
    OUTPUT,
    TOKEN_EMBD,
    UNSUPPORTED_ARCHS,
    Choice,
    ModelFacts,
    QuantSpec,
    TensorFact,
    TypeChoiceError,
    category,
    compiled_pattern,
    fallback,
    may_quantize,
)
from k3lab.pipeline.quantizing.std_regex import StdRegex


# --- the built-in mix (llama_tensor_get_type_impl), as data ---------------------------------------
@dataclass
class Counters:
    """What llama-quantize counts as it walks the model (quantize_state_impl)."""

    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0


@dataclass(frozen=True)
class Ctx:
    """One tensor as the mix sees it."""

    name: str
    ne: tuple[int, ...]
    cat: str
    ft: str  # the ftype by its first name (aliases resolved: Q4_K -> Q4_K_M)
    default: str  # the type before the mix
    facts: ModelFacts
    counters: Counters
    has_imatrix: bool
    tied: bool  # no output.weight anywhere: the token embeddings serve as output
    output_tensor_type: str | None = None

    def layer(self, counter: str) -> tuple[int, int]:
        """(layer, layers) of an ffn tensor: from its name in a MoE, else the running count."""
        n_layer = self.facts.n_layer
        if self.facts.n_expert > 1:
            m = LAYER.match(self.name)  # (sscanf "blk.%d.")
            if m is None:
                raise TypeChoiceError(f"{self.name}: llama.cpp cannot find this tensor's layer")
            i = int(m.group(1))
            if not 0 <= i < n_layer:
                raise TypeChoiceError(f"{self.name}: layer {i} is outside the model's 0..{n_layer - 1}")
            return i, n_layer
        return getattr(self.counters, counter), n_layer


def more_bits(i: int, n: int) -> bool:
    """use_more_bits: the first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


Chooser = Callable[[Ctx], "str | None"]


@dataclass(frozen=True)
class Pick:
    """One ``else if`` of an arm: when ``guard`` holds the chain stops here and ``to`` gives the type
    (a name, or a function of the tensor that may say None: keep the type)."""

    guard: Callable[[Ctx], bool]
    to: str | Chooser
    why: str
    counts: str | None = None  # the counter this pick advances, chosen or not (after choosing)

    def choose(self, c: Ctx) -> str | None:
        return self.to(c) if callable(self.to) else self.to


@dataclass(frozen=True)
class Arm:
    """One arm of the cascade: the first arm whose ``applies`` holds is the only one taken; its picks
    are an ``else if`` chain, ``then`` are applied after it in turn, and ``counts`` is the counter it
    advances afterwards. ``locate``: the arm finds the tensor's layer first (and so fails, as
    llama.cpp does, for an ffn tensor of a MoE whose name holds no layer)."""

    applies: Callable[[Ctx], bool]
    picks: tuple[Pick, ...]
    then: tuple[Pick, ...] = ()
    counts: str | None = None
    locate: str | None = None
    name: str = ""


def _ft(*names: str) -> Callable[[Ctx], bool]:
    return lambda c: c.ft in names


def _cat(*cats: str) -> Callable[[Ctx], bool]:
    return lambda c: c.cat in cats


IQ2_FAMILY = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
ATTN_OUTPUT_Q5K_8X = (
    "Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M", "IQ4_XS",
)  # fmt: skip


def _output_type(c: Ctx) -> str | None:
    """The output tensor (and tied embeddings) with no --output-tensor-type."""
    if c.output_tensor_type is not None:
        return c.output_tensor_type
    if c.ft == "MXFP4_MOE":
        return "Q8_0"
    if c.ne[0] % BLOCK[c.default]:
        return "Q8_0"
    if c.ft in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
        return "Q5_K"
    return "Q6_K" if c.default != "Q8_0" else None


MIX: tuple[Arm, ...] = (
    Arm(lambda c: c.cat == OUTPUT or (c.tied and c.cat == TOKEN_EMBD),
        (Pick(lambda c: True, _output_type, "the output tensor"),), name="output"),
    Arm(_ft("MXFP4_MOE"),
        (Pick(lambda c: len(c.ne) > 2 and c.ne[2] > 1, "MXFP4", "MXFP4_MOE: a stack (ne[2] > 1) is MXFP4"),
         Pick(lambda c: True, "Q8_0", "MXFP4_MOE: the rest is Q8_0")), name="mxfp4_moe"),
    Arm(_cat(TOKEN_EMBD),
        (Pick(_ft("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"), "Q2_K", "token embeddings"),
         Pick(_ft("IQ2_S", "IQ2_M", "IQ3_XXS"), "IQ3_S", "token embeddings"),
         Pick(_ft("TQ1_0", "TQ2_0", "Q2_0"), "Q4_K", "token embeddings")), name="token_embd"),
    Arm(_ft(*IQ2_FAMILY),
        (Pick(lambda c: c.cat in ATTN_V_LIKE,
              lambda c: "Q4_K" if c.facts.n_gqa >= 4 or c.facts.n_expert >= 4
              else "IQ3_S" if c.ft in ("IQ2_S", "IQ2_M") else "Q2_K", "attention v, 2-bit mixes",
              counts="i_attention_wv"),
         Pick(lambda c: c.facts.n_expert == 8 and c.cat == ATTN_K, "Q4_K", "attention k, 8 experts"),
         Pick(_cat(FFN_DOWN),
              lambda c: ("IQ3_S" if c.ft in ("IQ2_S", "IQ2_M") else "Q2_K")
              if c.counters.i_ffn_down < c.facts.n_layer // 8 else None,
              "ffn_down: the model's first n_layer/8 of them", counts="i_ffn_down"),
         Pick(_cat(ATTN_OUTPUT),
              lambda c: "Q5_K" if c.facts.n_expert == 8
              else "IQ2_XXS" if c.ft in ("IQ1_S", "IQ1_M")
              else "IQ3_S" if c.ft in ("IQ2_S", "IQ2_M") else None, "attention output, 2-bit mixes")),
        name="iq2"),
    Arm(lambda c: c.cat in ATTN_V_LIKE,
        (Pick(_ft("Q2_K"), lambda c: "Q4_K" if c.facts.n_gqa >= 4 else "Q3_K", "attention v"),
         Pick(lambda c: c.ft == "Q2_K_S" and c.facts.n_gqa >= 4, "Q4_K", "attention v, GQA >= 4"),
         Pick(_ft("IQ3_XXS"), lambda c: "Q4_K" if c.facts.n_gqa >= 4
              else "IQ3_S" if not c.has_imatrix else "IQ3_XXS", "attention v"),
         Pick(lambda c: c.ft in ("IQ3_XS", "IQ3_S") and c.facts.n_gqa >= 4, "Q4_K", "attention v, GQA >= 4"),
         Pick(_ft("IQ3_M"), "Q4_K", "attention v"),
         Pick(_ft("Q3_K_M"), lambda c: "Q5_K" if c.counters.i_attention_wv < 2 else "Q4_K",
              "attention v: the first two Q5_K"),
         Pick(_ft("Q3_K_L"), "Q5_K", "attention v"),
         Pick(lambda c: c.ft in ("IQ4_NL", "IQ4_XS") and c.facts.n_gqa >= 4, "Q5_K", "attention v, GQA >= 4"),
         Pick(lambda c: c.ft in ("Q4_K_M", "Q5_K_M")
              and more_bits(c.counters.i_attention_wv, c.counters.n_attention_wv), "Q6_K",
              "attention v: first and last eighth, every third between"),
         Pick(lambda c: c.ft == "Q4_K_S" and c.counters.i_attention_wv < 4, "Q5_K", "attention v: the first four")),
        then=(Pick(lambda c: c.facts.n_expert == 8, "Q8_0", "attention v, 8 experts"),),
        counts="i_attention_wv", name="attn_v"),
    Arm(_cat(ATTN_K),
        (Pick(lambda c: c.facts.n_expert == 8, "Q8_0", "attention k, 8 experts"),
         Pick(_ft("IQ3_XS"), "IQ3_XXS", "attention k"),
         Pick(_ft("IQ3_XXS"), "IQ2_S", "attention k")), name="attn_k"),
    Arm(_cat(ATTN_Q),
        (Pick(_ft("IQ3_XS"), "IQ3_XXS", "attention q"),
         Pick(_ft("IQ3_XXS"), "IQ2_S", "attention q")), name="attn_q"),
    Arm(_cat(FFN_DOWN),
        (Pick(_ft("Q2_K"), "Q3_K", "ffn_down"),
         Pick(_ft("Q2_K_S"), lambda c: "Q4_K" if c.layer("i_ffn_down")[0] < c.facts.n_layer // 8 else None,
              "ffn_down: the first eighth of the layers"),
         Pick(lambda c: c.ft == "IQ3_XXS" and not c.has_imatrix,
              lambda c: "Q4_K" if c.layer("i_ffn_down")[0] < c.facts.n_layer // 8 else "Q3_K", "ffn_down, no imatrix"),
         Pick(_ft("Q3_K_M"), lambda c: "Q5_K" if c.layer("i_ffn_down")[0] < c.facts.n_layer // 16 else "Q4_K",
              "ffn_down: the first sixteenth Q5_K"),
         Pick(lambda c: c.ft == "IQ3_M" and (c.layer("i_ffn_down")[0] < c.facts.n_layer // 8 or (
             c.facts.n_expert == 8 and more_bits(*c.layer("i_ffn_down")))), "Q4_K", "ffn_down"),
         Pick(_ft("Q3_K_L"), "Q5_K", "ffn_down"),
         Pick(_ft("Q4_K_M"), lambda c: "Q6_K" if more_bits(*c.layer("i_ffn_down")) else None,
              "ffn_down: first and last eighth, every third between"),
         Pick(lambda c: c.layer("i_ffn_down")[0] < c.facts.n_layer // 8 and c.ft in ("IQ4_NL", "IQ4_XS")
              and not c.has_imatrix, "Q5_K", "ffn_down: the first eighth, no imatrix"),
         Pick(lambda c: c.ft == "Q5_K_M" and more_bits(*c.layer("i_ffn_down")), "Q6_K",
              "ffn_down: first and last eighth, every third between"),
         Pick(lambda c: c.ft == "Q4_K_S" and c.layer("i_ffn_down")[0] < c.facts.n_layer // 8, "Q5_K",
              "ffn_down: the first eighth"),
         Pick(lambda c: c.ft in ("Q4_0", "Q5_0") and c.has_imatrix
              and c.layer("i_ffn_down")[0] < c.facts.n_layer // 8,
              lambda c: "Q4_1" if c.ft == "Q4_0" else "Q5_1", "ffn_down: the first eighth, with an imatrix")),
        counts="i_ffn_down", locate="i_ffn_down", name="ffn_down"),
    Arm(_cat(ATTN_OUTPUT),
        (Pick(lambda c: c.facts.n_expert == 8,
              lambda c: "Q5_K" if c.ft in ATTN_OUTPUT_Q5K_8X else None, "attention output, 8 experts"),
         Pick(_ft("Q2_K"), "Q3_K", "attention output"),
         Pick(_ft("IQ3_XXS"), "IQ3_S", "attention output"),
         Pick(_ft("Q3_K_M"), "Q4_K", "attention output"),
         Pick(_ft("Q3_K_L"), "Q5_K", "attention output"),
         Pick(_ft("IQ3_M"), "Q4_K", "attention output")), name="attn_output"),
    Arm(_cat(ATTN_QKV),
        (Pick(_ft("Q3_K_M", "Q3_K_L", "IQ3_M"), "Q4_K", "attention qkv"),
         Pick(_ft("Q4_K_M"), "Q5_K", "attention qkv"),
         Pick(_ft("Q5_K_M"), "Q6_K", "attention qkv")), name="attn_qkv"),
    Arm(_cat(FFN_GATE),
        (Pick(lambda c: c.ft == "IQ3_XS" and c.facts.n_layer // 8 <= c.layer("i_ffn_gate")[0]
              < 7 * c.facts.n_layer // 8, "IQ3_XXS", "ffn_gate: the middle layers"),),
        counts="i_ffn_gate", locate="i_ffn_gate", name="ffn_gate"),
    Arm(_cat(FFN_UP),
        (Pick(lambda c: c.ft == "IQ3_XS" and c.facts.n_layer // 8 <= c.layer("i_ffn_up")[0]
              < 7 * c.facts.n_layer // 8, "IQ3_XXS", "ffn_up: the middle layers"),),
        counts="i_ffn_up", locate="i_ffn_up", name="ffn_up"),
)  # fmt: skip


def mix(c: Ctx) -> tuple[str, str]:
    """The ftype's built-in type for one tensor, and why (llama_tensor_get_type_impl)."""
    arm = next((a for a in MIX if a.applies(c)), None)
    if arm is None:
        return c.default, f"{c.ft}'s default"
    if arm.locate is not None:
        c.layer(arm.locate)
    chosen, why = c.default, f"{c.ft}'s default"
    pick = next((p for p in arm.picks if p.guard(c)), None)
    if pick is not None and (to := pick.choose(c)) is not None:
        chosen, why = to, f"{c.ft}: {pick.why}"
    for p in arm.then:
        if p.guard(c) and (to := p.choose(c)) is not None:
            chosen, why = to, f"{c.ft}: {p.why}"
    for counter in (pick.counts if pick is not None else None, arm.counts):
        if counter is not None:
            setattr(c.counters, counter, getattr(c.counters, counter) + 1)
    return chosen, why


def choose_types(
    tensors: Sequence[TensorFact], facts: ModelFacts, spec: QuantSpec, has_imatrix: bool
) -> list[Choice]:
    """Every tensor's type, in llama-quantize's order (the caller orders them: ``llama_order`` or
    the set's file order), with why; counters run over all of them, as llama.cpp's do."""
    if facts.arch in UNSUPPORTED_ARCHS:
        raise TypeChoiceError(
            f"architecture {facts.arch!r}: llama.cpp's quantiser has exceptions for it that k3lab does not have"
        )
    ft = spec.file_type
    ft_name = ALIASES.get(ft.name, ft.name)
    counters = Counters(n_attention_wv=sum(category(t.name) in ATTN_V_LIKE for t in tensors))
    tied = not any(t.name == "output.weight" for t in tensors)
    patterns = [(compiled_pattern(p), to) for p, to in spec.overrides]
    out = []
    for t in tensors:
        if not may_quantize(t, spec):
            out.append(Choice(t.type, "kept: llama.cpp quantises no such tensor"))
            continue
        cat = category(t.name)
        out.append(_choose(t, cat, ft.default, ft_name, facts, counters, has_imatrix, tied, patterns, spec))
    return out


def _choose(
    t: TensorFact,
    cat: str,
    default: str,
    ft_name: str,
    facts: ModelFacts,
    counters: Counters,
    has_imatrix: bool,
    tied: bool,
    patterns: list[tuple[StdRegex, str]],
    spec: QuantSpec,
) -> Choice:
    """llama_tensor_get_type for a tensor that may be quantised."""
    if spec.token_embedding_type is not None and cat == TOKEN_EMBD:
        named = t.name == "per_layer_token_embd.weight" and any(p.search(t.name) for p, _ in patterns)
        if not named:
            return _with_need(t, spec.token_embedding_type, "--token-embedding-type", spec)
    if spec.output_tensor_type is not None and cat == OUTPUT:
        return _with_need(t, spec.output_tensor_type, "--output-tensor-type", spec)
    if BLOCK[default] == 1:  # F16, BF16, F32: no mix, no patterns, no fallback
        return _with_need(t, default, f"{spec.ftype}: every such tensor", spec)
    chosen, why = default, f"{spec.ftype}'s default"
    match = next(((p, to) for p, to in patterns if p.search(t.name)), None)
    if match is not None:
        chosen, why = match[1], f"--tensor-type {match[0].pattern}={match[1].lower()}"
    elif not spec.pure:
        c = Ctx(
            t.name, t.ne, cat, ft_name, default, facts, counters, has_imatrix, tied, spec.output_tensor_type
        )
        chosen, why = mix(c)
    else:
        why = f"{spec.ftype}: --pure"
    chosen, fell = fallback(t, chosen)
    return _with_need(t, chosen, why + fell, spec)


def _with_need(t: TensorFact, to: str, why: str, spec: QuantSpec) -> Choice:
    needs = t.name not in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight") and (
        to in NEEDS_IMATRIX or (to == "Q2_K" and spec.ftype == "Q2_K_S")
    )
    if to == t.type:
        why = f"{why} (already {to}: copied)"
    return Choice(to, why, needs)
