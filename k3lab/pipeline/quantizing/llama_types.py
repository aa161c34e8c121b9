"""Which ggml type each tensor of a variant gets: llama.cpp's own choice (``src/llama-quant.cpp`` of
the tree llama-cpp-python 0.3.36 vendors), written as data and plain functions, keyed by GGUF tensor
names as llama.cpp keys them. They are llama.cpp's rules, not a model's: nothing here knows Kimi-K3.

How ``llama-quantize`` decides a tensor's type, in its order (``choose_types`` follows it):

1. Whether the tensor may be quantised at all (``may_quantize``): 2-D or more (trailing 1s of its
   ``ne`` do not count), a name ending in ``weight``, not a norm, not one of ``NEVER_QUANTIZED``;
   otherwise it keeps its type (copied byte for byte).
2. ``--token-embedding-type`` for the token embeddings, ``--output-tensor-type`` for ``output.weight``.
3. With a quantised default type (every ftype but F16, BF16, F32): the first ``--tensor-type``
   pattern that matches (a regex searched in the name) wins; else, unless ``--pure``, the ftype's
   built-in mix (``llama_mix.MIX``: one arm per tensor category, each a list of picks); then the
   fallback when the row width is not a multiple of the type's block (``FALLBACK``).

The built-in mix depends on facts of the whole model (``ModelFacts``: layer count, expert count, the
GQA ratio of layer 0, whether an ``output.weight`` exists) and on counters that run over the WHOLE
model in llama-quantize's tensor order (attention-v tensors seen, ffn_down tensors seen...). The
order is the set's files then offsets with ``--keep-split``, else llama.cpp's by-layer order
(``llama_order``). So the types of one file can only be decided with the whole model's tensor list
in hand (``llama_mix.choose_types``): the variant's plan does it once, and every task reads its
file's types from there. This module holds the tables and facts; ``llama_mix`` the cascade.

Architectures for which llama.cpp's mix has exceptions of its own (Falcon, LLaMA-70B, GLM5-next,
BailingMoE3) are refused (``UNSUPPORTED_ARCHS``): their rules are not written here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from k3lab.errors import K3LabError
from k3lab.formats.ggml import QUANTIZE_TARGETS, TYPE_IDS
from k3lab.pipeline.quantizing.std_regex import StdRegex


class TypeChoiceError(K3LabError):
    """A variant llama-quantize would refuse (an imatrix missing, a layer it cannot place)."""


# --- the ftypes llama-quantize offers (tools/quantize/quantize.cpp: QUANT_OPTIONS), with llama.cpp's
# file type number and default tensor type (llama_ftype_get_default_type); but Q2_0 (ggml type 42),
# which gguf-py 0.19, k3lab's reader of GGUF files, does not know; and COPY (no quantising at all) -----
@dataclass(frozen=True)
class FType:
    name: str  # as llama-quantize prints it
    number: int  # general.file_type (llama_ftype)
    default: str  # the ggml type a quantisable tensor gets before the mix


FTYPES: dict[str, FType] = {
    f.name: f
    for f in (
        FType("Q1_0", 40, "Q1_0"),
        FType("Q4_0", 2, "Q4_0"), FType("Q4_1", 3, "Q4_1"), FType("MXFP4_MOE", 38, "MXFP4"),
        FType("Q5_0", 8, "Q5_0"), FType("Q5_1", 9, "Q5_1"),
        FType("IQ2_XXS", 19, "IQ2_XXS"), FType("IQ2_XS", 20, "IQ2_XS"), FType("IQ2_S", 28, "IQ2_XS"),
        FType("IQ2_M", 29, "IQ2_S"), FType("IQ1_S", 24, "IQ1_S"), FType("IQ1_M", 31, "IQ1_M"),
        FType("TQ1_0", 36, "TQ1_0"), FType("TQ2_0", 37, "TQ2_0"),
        FType("Q2_K", 10, "Q2_K"), FType("Q2_K_S", 21, "Q2_K"),
        FType("IQ3_XXS", 23, "IQ3_XXS"), FType("IQ3_S", 26, "IQ3_S"), FType("IQ3_M", 27, "IQ3_S"),
        FType("Q3_K", 12, "Q3_K"), FType("IQ3_XS", 22, "IQ3_S"),
        FType("Q3_K_S", 11, "Q3_K"), FType("Q3_K_M", 12, "Q3_K"), FType("Q3_K_L", 13, "Q3_K"),
        FType("IQ4_NL", 25, "IQ4_NL"), FType("IQ4_XS", 30, "IQ4_XS"),
        FType("Q4_K", 15, "Q4_K"), FType("Q4_K_S", 14, "Q4_K"), FType("Q4_K_M", 15, "Q4_K"),
        FType("Q5_K", 17, "Q5_K"), FType("Q5_K_S", 16, "Q5_K"), FType("Q5_K_M", 17, "Q5_K"),
        FType("Q6_K", 18, "Q6_K"), FType("Q8_0", 7, "Q8_0"),
        FType("F16", 1, "F16"), FType("BF16", 32, "BF16"), FType("F32", 0, "F32"),
    )
}  # fmt: skip
# the rules test the llama_ftype: an alias is the ftype it names
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}


def ftype(name: str) -> FType:
    """An ftype as llama-quantize parses one (any case)."""
    found = FTYPES.get(name.upper())
    if found is None:
        raise K3LabError(f"--type {name!r}: not a type llama-quantize makes (one of {', '.join(FTYPES)})")
    return found


# --- what llama.cpp never quantises (tensor_allows_quantization) --------------------------------------
NEVER_QUANTIZED = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)  # fmt: skip  (substrings)
NEVER_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")
UNSUPPORTED_ARCHS = ("falcon", "llama", "glm5-next", "bailingmoe3")

# a 256-value type whose block does not divide the row falls back to a 32-value one
# (tensor_type_fallback); any other type of a larger block has no fallback in llama.cpp
FALLBACK = {
    "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
    "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL",
    "Q2_0": "Q4_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}  # fmt: skip
# block sizes (ggml's type traits): the fallback test needs them without loading ggml
BLOCK = {
    "F32": 1, "F16": 1, "BF16": 1, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
    "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ2_XXS": 256, "IQ2_XS": 256,
    "IQ3_XXS": 256, "IQ1_S": 256, "IQ4_NL": 32, "IQ3_S": 256, "IQ2_S": 256, "IQ4_XS": 256,
    "IQ1_M": 256, "TQ1_0": 256, "TQ2_0": 256, "MXFP4": 32, "NVFP4": 64, "Q1_0": 128, "Q2_0": 64,
}  # fmt: skip
# the types whose quantisation llama.cpp refuses without an imatrix (tensor_requires_imatrix)
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S")

# --- tensor categories (tensor_get_category): by name, first match ---------------------------------
OUTPUT, TOKEN_EMBD, ATTN_QKV, ATTN_KV_B, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT = (
    "output", "token_embd", "attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q", "attn_output",
)  # fmt: skip
FFN_UP, FFN_GATE, FFN_DOWN, OTHER = "ffn_up", "ffn_gate", "ffn_down", "other"
CATEGORY_BY_SUBSTRING = (
    ("attn_qkv.weight", ATTN_QKV), ("attn_kv_b.weight", ATTN_KV_B), ("attn_v.weight", ATTN_V),
    ("attn_k.weight", ATTN_K), ("attn_q.weight", ATTN_Q), ("attn_output.weight", ATTN_OUTPUT),
    ("ffn_up", FFN_UP), ("ffn_gate", FFN_GATE), ("ffn_down", FFN_DOWN),
)  # fmt: skip
ATTN_V_LIKE = (ATTN_V, ATTN_QKV, ATTN_KV_B)  # category_is_attn_v: more sensitive to quantisation


def category(name: str) -> str:
    if name == "output.weight":
        return OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return TOKEN_EMBD
    return next((cat for sub, cat in CATEGORY_BY_SUBSTRING if sub in name), OTHER)


# --- the facts and options the choice depends on -------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's loader knows of the model when it quantises (from file 1's metadata)."""

    arch: str
    n_layer: int  # {arch}.block_count
    n_expert: int  # {arch}.expert_count (0: none)
    n_gqa: int  # head_count / head_count_kv of layer 0 (0 when head_count_kv is 0: a recurrent layer)

    @classmethod
    def from_kvs(cls, kvs: dict[str, object]) -> ModelFacts:
        arch = kvs.get("general.architecture")
        if not isinstance(arch, str):
            raise K3LabError("file 1 has no general.architecture")

        def first(key: str, default: int) -> int:
            value = kvs.get(f"{arch}.{key}", default)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else default
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise K3LabError(f"file 1: {arch}.{key} is {value!r}, not a count")
            return value

        n_layer = first("block_count", -1) if f"{arch}.block_count" in kvs else 0
        if not 0 < n_layer <= 4096:  # (LLAMA_MAX_LAYERS 512 in llama.cpp; a bound either way)
            raise K3LabError(f"file 1: {arch}.block_count is {kvs.get(f'{arch}.block_count')!r}")
        n_head = first("attention.head_count", 0)
        n_head_kv = first("attention.head_count_kv", n_head)
        return cls(arch, n_layer, first("expert_count", 0), n_head // n_head_kv if n_head_kv else 0)


@dataclass(frozen=True)
class QuantSpec:
    """A variant as llama-quantize's flags say it: the ftype, ``--tensor-type`` patterns in order
    (lowercased, as llama-quantize lowers them), ``--output-tensor-type``, ``--token-embedding-type``,
    ``--pure`` and ``--leave-output-tensor``."""

    ftype: str
    overrides: tuple[tuple[str, str], ...] = ()
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    pure: bool = False
    leave_output_tensor: bool = False
    type_file: str | None = None  # the --tensor-type-file the overrides were read from (the command says it)
    kv_overrides: tuple[
        tuple[str, str, str], ...
    ] = ()  # --override-kv KEY=TYPE:VALUE, as given (key, type, value)

    def __post_init__(self) -> None:
        ftype(self.ftype)
        for what, name in (("--output-tensor-type", self.output_tensor_type),
                           ("--token-embedding-type", self.token_embedding_type),
                           *(("--tensor-type", t) for _, t in self.overrides)):  # fmt: skip
            if name is not None and TYPE_IDS.get(name, -1) not in QUANTIZE_TARGETS:
                raise K3LabError(f"{what} {name!r}: not a type ggml quantises to")
        for pattern, _ in self.overrides:
            compiled_pattern(pattern)

    @property
    def file_type(self) -> FType:
        return FTYPES[self.ftype]

    def to_json(self) -> dict[str, object]:
        return {
            "ftype": self.ftype,
            "overrides": [list(o) for o in self.overrides],
            "output_tensor_type": self.output_tensor_type,
            "token_embedding_type": self.token_embedding_type,
            "pure": self.pure,
            "leave_output_tensor": self.leave_output_tensor,
            **({"type_file": self.type_file} if self.type_file else {}),
            **({"kv_overrides": [list(o) for o in self.kv_overrides]} if self.kv_overrides else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> QuantSpec:
        return cls(
            str(data["ftype"]),
            tuple((str(p), str(t)) for p, t in data["overrides"]),
            data.get("output_tensor_type"),
            data.get("token_embedding_type"),
            bool(data.get("pure", False)),
            bool(data.get("leave_output_tensor", False)),
            data.get("type_file") or None,
            tuple((str(k), str(t), str(v)) for k, t, v in data.get("kv_overrides", ())),
        )


def compiled_pattern(pattern: str) -> StdRegex:
    """A ``--tensor-type`` pattern as llama-quantize reads it: a ``std::regex`` searched in the tensor
    name (``std_regex``: read as libstdc++ reads it, or refused in one line)."""
    return StdRegex(pattern)


# --- one tensor, and the whole model ---------------------------------------------------------------
@dataclass(frozen=True)
class TensorFact:
    """A tensor of the lossless set as llama-quantize reads it: name, ggml type, ``ne``."""

    name: str
    type: str
    ne: tuple[int, ...]

    @property
    def n_dims(self) -> int:
        """ggml_n_dims: trailing 1s of ``ne`` do not count."""
        dims = len(self.ne)
        while dims > 1 and self.ne[dims - 1] == 1:
            dims -= 1
        return dims


@dataclass(frozen=True)
class Choice:
    type: str
    why: str
    needs_imatrix: bool = False  # llama-quantize refuses to make this tensor without one


def may_quantize(t: TensorFact, spec: QuantSpec) -> bool:
    """tensor_allows_quantization."""
    if t.n_dims < 2 or not t.name.endswith("weight"):
        return False
    if spec.leave_output_tensor and t.name == "output.weight":
        return False
    if t.name in NEVER_QUANTIZED_NAMES:
        return False
    return not any(s in t.name for s in NEVER_QUANTIZED)


def fallback(t: TensorFact, to: str) -> tuple[str, str]:
    """tensor_type_fallback: a type whose block does not divide the row width gives way (the second
    value says so, or is empty)."""
    block = BLOCK[to]
    if t.ne[0] % block == 0:
        return to, ""
    if to in FALLBACK:
        back = FALLBACK[to]
    elif block <= 32:
        back = to
    else:
        raise TypeChoiceError(f"{t.name}: {to} has no fallback for rows of {t.ne[0]} (llama.cpp refuses too)")
    if t.ne[0] % BLOCK[back]:
        back = "F16"
    return back, f"; rows of {t.ne[0]} are not a multiple of {to}'s {block}: {back}"


LAYER = re.compile(r"blk\.\s*([+-]?\d+)")  # what sscanf(name, "blk.%d.") reads


def llama_order(names: Sequence[str]) -> list[int]:
    """The order llama.cpp's loader keeps tensors in (weight_name_comparer), which llama-quantize
    follows without ``--keep-split``: by layer (tensors of no layer first), then by name."""

    def key(i: int) -> tuple[int, bytes]:
        m = LAYER.match(names[i])
        return (int(m.group(1)) if m else -1), names[i].encode()

    return sorted(range(len(names)), key=key)
