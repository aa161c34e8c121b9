"""What the front needs of Kimi-K3 besides the pipeline's model: the source repo, the model card,
the rule tags in words, the chat-template note and the demo's synthetic checkpoint."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.kimi_k3 import chat, rules
from k3lab.kimi_k3.tokenizer import chat_template_choice
from k3lab.pipeline.model import Guide

TAGS = {
    rules.KDA: "KDA layers",
    rules.MLA: "MLA layers",
    rules.DENSE: "dense (leading) layers",
    rules.MOE: "MoE layers",
    rules.LATENT: "MoE layers (latent MoE)",
    rules.VISION: "mmproj",
    rules.VBLOCK: "every MoonViT block",
    rules.QUANTIZED: "MXFP4 checkpoints",
    rules.FLOAT: "unquantized checkpoints",
    rules.ATTN_RES: "attn_res_block_size > 0",
}


def _card() -> str:
    return resources.files("k3lab.kimi_k3").joinpath("card.md").read_text(encoding="utf-8")


def _demo(folder: Path, seed: int) -> Any:
    from k3lab.kimi_k3.synth import synthesize

    return synthesize("tiny", folder, seed=seed)


def _check_logits(
    source: Any,
    gguf: str,
    prompt: str | None,
    tokens: list[int] | None,
    threshold: float,
    mode: str,
    judge: str | None = None,
    generate: int = 0,
) -> tuple[Any, Any]:
    from k3lab.kimi_k3 import moonshot_forward
    from k3lab.kimi_k3.generation import check_generation
    from k3lab.kimi_k3.logits import check_logits, check_stages
    from k3lab.kimi_k3.moonshot_judge import judge_moonshot, runtime_effect

    if judge == "moonshot" and (why := moonshot_forward.missing()) is not None:
        raise K3LabError(f"check-logits --judge moonshot: {why}")  # (said before llama.cpp runs)
    report = check_logits(source, gguf, prompt, tokens, threshold, mode)
    stages = check_stages(source, gguf, report.tokens, mode)
    if judge == "moonshot":
        stages.moonshot = judge_moonshot(source, report.tokens)
        stages.runtime = runtime_effect(source, report.tokens, mode, list(stages.moonshot))
    if generate:
        lm = moonshot_forward.text_model(source) if judge == "moonshot" else None
        theirs = (lambda t: moonshot_forward.forward(lm, t)[0]) if lm is not None else None
        stages.generation = check_generation(gguf, report.tokens, generate, theirs)
    return report, stages


def _check_vision(source: Any, mmproj: str, image: str | None, threshold: float) -> Any:
    from k3lab.kimi_k3.check_vision import check_vision
    from k3lab.kimi_k3.config import K3Config

    return check_vision(source, K3Config.load(source.meta_dir), source.meta_dir, mmproj, image, threshold)


GUIDE = Guide(
    base_model="moonshotai/Kimi-K3",
    card_template=_card,
    rules_file="k3lab/kimi_k3/rules.py",
    tags=TAGS,
    chat_template=chat_template_choice,
    chat_template_words=chat.card_paragraph,
    demo=_demo,
    vision_note=(
        "The mmproj is in the `kimik3` convention (`clip.projector_type kimik3`), the one llama.cpp build "
        "that runs K3's tower reads (unsloth's fork, PR #70). Upstream llama.cpp does not support K3's "
        "vision yet (ggml-org/llama.cpp#28264): it refuses the projector type. The fork runs it with "
        "three numeric differences from Moonshot's forward: one RMSNorm eps for tower and projector (the "
        "projector's 1e-5, where the BF16 tower's is 2^-7), tanh GELU in the projector (Moonshot's is "
        "exact erf), and its own resize and pad (an image already a multiple of 28 pixels and within the "
        "patch limit sidesteps it). `k3lab check-vision` checks the file against Moonshot's forward."
    ),
    check_logits=_check_logits,
    check_vision=_check_vision,
    calibration_text=Path(__file__).with_name("data") / "calibration-v1.txt",
)
