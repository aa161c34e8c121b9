"""Named recipes: the "dynamic" mixes publishers make of giant MoEs (unsloth's UD-Q2_K_XL and kin),
as data. The routed experts, nearly all of the weights, go low; what every token passes through goes
high: attention, the shared experts, the latent projections, the dense first layer, and the experts
of the boundary layers (the first and last MoE layers), one step above the rest.

Where a recipe keeps experts at 4 bits or more it names MXFP4: Kimi-K3's experts are MXFP4 already,
so they are copied exactly (Q4_K would be larger, 4.5 bits, and lossy). A recipe is ``llama-quantize``
flags and nothing else: an ftype, ``--tensor-type`` patterns (llama.cpp
searches them in order, the first that matches wins) and the embedding and output types. Its patterns
name the boundary layers by number, so they are made for a model (``spec``): each variant's plan
records the concrete flags, and ``command`` writes them out as the ``llama-quantize`` command that
makes the same bytes. Nothing here knows Kimi-K3 beyond the GGUF names llama.cpp gives a MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3lab.errors import K3LabError
from k3lab.pipeline.quantizing.llama_types import BLOCK, FALLBACK, NEEDS_IMATRIX, ModelFacts, QuantSpec


@dataclass(frozen=True)
class Recipe:
    name: str
    about: str
    ftype: str
    experts: str  # routed experts' gate and up projections
    down: str  # routed experts' down projection (more sensitive)
    boundary: str  # every routed expert of the boundary layers
    attention: str  # attn_* and ssm_* (KDA and MLA alike)
    shared: str  # shared experts and the latent projections (ffn_routed_*)
    dense: str  # the dense FFN of the leading dense layers
    embedding: str
    output: str

    @property
    def needs_imatrix(self) -> bool:
        return any(t in NEEDS_IMATRIX for t in (self.experts, self.down, self.boundary))

    def spec(self, facts: ModelFacts, dense_layers: int, width: int) -> QuantSpec:
        """The flags for a model of ``facts`` (its first MoE layer after ``dense_layers`` dense ones;
        embeddings ``width`` wide: a type whose block does not divide it gives way as llama.cpp's
        fallback would, since llama-quantize applies none to these two flags)."""
        first = min(dense_layers, facts.n_layer - 1)
        edge = max(1, facts.n_layer // 32)  # Kimi-K3 (93 layers): 1, 2 and 91, 92
        layers = sorted(
            {*range(first, min(first + edge, facts.n_layer)), *range(facts.n_layer - edge, facts.n_layer)}
        )
        overrides = (
            (rf"blk\.({'|'.join(map(str, layers))})\.ffn_(gate|up|down)_exps", self.boundary),
            ("ffn_down_exps", self.down),
            ("ffn_(gate|up)_exps", self.experts),
            ("_shexp|ffn_routed_", self.shared),
            (r"ffn_(gate|up|down)\.", self.dense),
            ("attn_|ssm_", self.attention),
        )
        return QuantSpec(
            self.ftype,
            tuple((p, t) for p, t in overrides),
            output_tensor_type=_fits(self.output, width),
            token_embedding_type=_fits(self.embedding, width),
        )


def _fits(to: str, width: int) -> str:
    while width % BLOCK[to] and to in FALLBACK:
        to = FALLBACK[to]
    return to if width % BLOCK[to] == 0 else "F16"


RECIPES = {
    r.name: r
    for r in (
        Recipe("MoE-IQ1_S", "experts at 1.56 bits (IQ1_S), the rest at 5-8: the smallest that still talks",
               "IQ1_S", "IQ1_S", "IQ2_XXS", "IQ2_XXS", "Q5_K", "Q6_K", "Q6_K", "Q4_K", "Q6_K"),
        Recipe("MoE-IQ2_XXS", "experts at 2.06 bits (IQ2_XXS), down projections 2.31, the rest at 6-8",
               "IQ2_XXS", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "Q6_K", "Q8_0", "Q8_0", "Q4_K", "Q6_K"),
        Recipe("MoE-Q2_K", "experts Q2_K, down projections Q3_K, the boundary layers' experts MXFP4, the rest "
               "Q6_K-Q8_0", "Q2_K", "Q2_K", "Q3_K", "MXFP4", "Q6_K", "Q8_0", "Q8_0", "Q4_K", "Q6_K"),
        Recipe("MoE-Q3_K", "experts Q3_K, down projections and the boundary layers' experts MXFP4, the rest "
               "Q6_K-Q8_0", "Q3_K_M", "Q3_K", "MXFP4", "MXFP4", "Q6_K", "Q8_0", "Q8_0", "Q6_K", "Q6_K"),
        Recipe("MXFP4-Q8_0", "the experts as they are (MXFP4), everything else Q8_0",
               "Q8_0", "MXFP4", "MXFP4", "MXFP4", "Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0"),
    )
}  # fmt: skip


def recipe(name: str) -> Recipe:
    found = RECIPES.get(name)
    if found is None:
        raise K3LabError(f"--recipe {name!r}: not a recipe (one of {', '.join(RECIPES)})")
    return found


def command(
    spec: QuantSpec, first: str, out: str, imatrix: str | None, keep_split: bool, weights: tuple = ((), ())
) -> str:
    """The ``llama-quantize`` command (of the tree llama-cpp-python 0.3.36 vendors) that makes the
    same bytes: ``first`` the set's (first) file, ``out`` the output name."""
    import shlex

    flags = ["--keep-split"] if keep_split else []
    flags.append("--allow-requantize")
    if imatrix:
        flags += ["--imatrix", imatrix]
        flags += [x for name in weights[0] for x in ("--include-weights", name)]
        flags += [x for name in weights[1] for x in ("--exclude-weights", name)]
    if spec.type_file:  # (every override from one file: the file, as given)
        flags += ["--tensor-type-file", spec.type_file]
    else:
        for pattern, to in spec.overrides:
            flags += ["--tensor-type", f"{pattern}={to.lower()}"]
    if spec.output_tensor_type:
        flags += ["--output-tensor-type", spec.output_tensor_type.lower()]
    if spec.token_embedding_type:
        flags += ["--token-embedding-type", spec.token_embedding_type.lower()]
    flags += [x for k, t, v in spec.kv_overrides for x in ("--override-kv", f"{k}={t}:{v}")]
    flags += ["--pure"] if spec.pure else []
    flags += ["--leave-output-tensor"] if spec.leave_output_tensor else []
    return shlex.join(["llama-quantize", *flags, first, out, spec.ftype])
