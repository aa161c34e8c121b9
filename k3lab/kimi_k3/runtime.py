"""Where llama.cpp's ``kimi-k3`` graph computes otherwise than Moonshot's forward: each a named switch
of the reference (``reference.Reference(..., runtime=...)``), with the lines of llama.cpp (the tree
llama-cpp-python 0.3.36 vendors) and of Moonshot's code that do it.

A GGUF carries one epsilon and ggml's kernels round as they round: no converter can close these.
``check-logits`` holds the GGUF to the reference *with* them (is it what llama.cpp needs?), holds the
reference *without* them to Moonshot's own forward (is k3lab's reading of the checkpoint Moonshot's?),
and says, stage by stage, how far they move llama.cpp's graph from Moonshot's forward and which one
does: a figure, never a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3lab.kimi_k3.keys import ARCH

MOONSHOT_EPS = 1e-6  # fla's l2norm_fwd default; KimiRMSNorm's default


@dataclass(frozen=True)
class Deviation:
    name: str
    what: str
    moonshot: str  # what Moonshot's forward does, and where
    runtime: str  # what llama.cpp's graph does, and where
    rounding: bool = False  # one of ggml's roundings (``mode="ggml"``), not a value a GGUF holds

    def line(self) -> str:
        return f"{self.what}: llama.cpp {self.runtime}; Moonshot {self.moonshot}"


KDA_L2_EPS = Deviation(
    "kda_l2norm_eps",
    "KDA q/k L2-norm epsilon",
    "1e-6 (fla's chunk_kda with use_qk_l2norm_in_kernel: l2norm's default eps)",
    "the model's rms_norm_eps (src/models/kimi-k3.cpp:455-457: build_gdn_l2_norm(ctx0, Qcur, "
    "hparams.f_norm_rms_eps))",
)
MLA_NORM_EPS = Deviation(
    "mla_norm_eps",
    "MLA q_a/kv_a RMSNorm epsilon",
    "1e-6 (KimiRMSNorm's default: modeling_kimi_linear.py:438 q_a_layernorm, :455 kv_a_layernorm)",
    "the model's rms_norm_eps (src/models/kimi-k3.cpp:496, 512: build_norm(..., LLM_NORM_RMS) with "
    "hparams.f_norm_rms_eps)",
)
BF16_INPUTS = Deviation(
    "bf16_inputs",
    "inputs of BF16 matmuls rounded to BF16",
    "float32",
    "BF16 (ggml/src/ggml-cpu/ggml-cpu.c:395-398: type_traits_cpu[GGML_TYPE_BF16].vec_dot_type = BF16)",
    rounding=True,
)
Q8_ACTIVATIONS = Deviation(
    "q8_activations",
    "inputs of MXFP4 matmuls quantised to Q8_0",
    "float32",
    "Q8_0 (ggml/src/ggml-cpu/ggml-cpu.c:287-290: type_traits_cpu[GGML_TYPE_MXFP4].vec_dot_type = Q8_0)",
    rounding=True,
)
DEVIATIONS = {d.name: d for d in (KDA_L2_EPS, MLA_NORM_EPS, BF16_INPUTS, Q8_ACTIVATIONS)}
EPSILONS = (KDA_L2_EPS.name, MLA_NORM_EPS.name)  # the runtime's values (a GGUF cannot carry Moonshot's)
ROUNDINGS = (BF16_INPUTS.name, Q8_ACTIVATIONS.name)  # ggml's kernels (the reference's ``ggml`` mode)


# --- what a context costs llama.cpp, beside the weights ----------------------------------------------

CELL_PAD = 256  # llama.cpp rounds a context's cells up to a multiple of this (n_ctx 1000 -> 1024)
F16, F32 = 2, 4  # the cache's default types: K (f16, --cache-type-k); the recurrent states (f32)


def context_bytes(kvs: dict[str, Any], n_ctx: int) -> int:
    """The bytes llama.cpp's ``kimi-k3`` allocates for a context of ``n_ctx`` tokens, one sequence, at
    its default cache types, from file 1's keys (``kvs``: name -> value), as the tree llama-cpp-python
    0.3.36 vendors allocates them (``src/llama-kv-cache.cpp``, ``src/llama-hparams.cpp``; its log's
    ``llama_kv_cache: size`` and ``llama_memory_recurrent: size`` lines):

    - each MLA layer (``attention.head_count_kv`` not 0) caches one K row of ``attention.key_length``
      (kv_lora_rank + the RoPE part) per token per KV head, in f16; no V (MLA reads V from the latent);
    - each KDA layer (``head_count_kv`` 0) keeps its recurrent state whatever the length: the short
      convolutions' last ``conv_kernel - 1`` inputs of Q, K and V and the ``head_dim x head_dim`` state
      of every head, in f32.

    Not counted: llama.cpp's compute buffer (it prints it: ``compute buffer size``; it grows with the
    batch and the context, tens of MiB on a small model, GiBs on Kimi-K3 at long contexts)."""
    a = f"{ARCH}."
    kv_heads = [int(x) for x in kvs[a + "attention.head_count_kv"]]
    cells = -(-max(1, n_ctx) // CELL_PAD) * CELL_PAD
    k_row = int(kvs[a + "attention.key_length"])
    heads, head_dim = int(kvs[a + "attention.head_count"]), int(kvs[a + "kda.head_dim"])
    conv = int(kvs[a + "ssm.conv_kernel"]) - 1
    kda_state = 3 * conv * heads * head_dim + head_dim * head_dim * heads
    mla = sum(k_row * h * cells * F16 for h in kv_heads if h)
    return mla + sum(kda_state * F32 for h in kv_heads if not h)
