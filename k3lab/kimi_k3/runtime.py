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
