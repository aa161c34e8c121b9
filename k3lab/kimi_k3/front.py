"""What the front needs of Kimi-K3 besides the pipeline's model: the source repo, the model card,
the rule tags in words, the chat-template note and the demo's synthetic checkpoint."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from k3lab.kimi_k3 import rules
from k3lab.kimi_k3.tokenizer import chat_template_choice
from k3lab.pipeline.model import Front

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


FRONT = Front(
    base_model="moonshotai/Kimi-K3",
    card_template=_card,
    rules_file="k3lab/kimi_k3/rules.py",
    tags=TAGS,
    chat_template=chat_template_choice,
    demo=_demo,
    vision_note=(
        "llama.cpp's multimodal tools read it as Kimi-K2.5's MoonViT projector (`clip.projector_type` "
        "`kimik25`), whose layout K3's tower follows; k3lab checks its bytes, not what a llama.cpp build "
        "answers about an image with the `kimi-k3` text model: treat image input as experimental."
    ),
)
