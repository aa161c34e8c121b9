"""The vision tower block by block, an image on its way in, and the tokenizer token by token
(notebook 04)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from k3lab.formats.numerics import bf16_bits_to_f32
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.rules import vision_block_prefix
from k3lab.kimi_k3.tokenizer import build_vocabulary, read_tiktoken
from k3lab.pipeline.sources.base import Source


def weight_stats(source: Source, names: list[str], sample_rows: int | None = None) -> list[dict[str, Any]]:
    """mean, std and max |x| of float tensors (BF16 widened exactly); of their first ``sample_rows``
    rows only when given (what a Hub source then fetches)."""
    rows = []
    for n in names:
        e = source.entry(n)
        a = np.asarray(source.rows(n, 0, sample_rows))
        v = bf16_bits_to_f32(a) if e.dtype == "BF16" else a.astype(np.float32)
        rows.append(
            {
                "tensor": n,
                "shape": list(e.shape),
                "mean": float(v.mean()),
                "std": float(v.std()),
                "max |x|": float(np.abs(v).max()),
            }
        )
    return rows


def vision_blocks(cfg: K3Config, source: Source, sample_rows: int | None = None) -> list[dict[str, Any]]:
    """The MoonViT tower block by block: parameter count and weight spread of each block (the spread
    of the first ``sample_rows`` rows of each tensor when given)."""
    rows = []
    for i in range(int(cfg.vision["vt_num_hidden_layers"])):
        names = sorted(n for n in source.weight_map if n.startswith(vision_block_prefix(i)))
        stats = weight_stats(source, names, sample_rows)
        rows.append(
            {
                "block": i,
                "tensors": len(names),
                "parameters": int(sum(np.prod(s["shape"]) for s in stats)),
                **{s["tensor"].rsplit(".", 2)[-2]: round(s["std"], 5) for s in stats},
            }
        )
    return rows


def image_way_in(cfg: K3Config, meta: str | Path, image: Any = None) -> dict[str, Any]:
    """What the tower makes of ``image`` (default: the package's sample) before any weight: the
    image as Moonshot's processor resizes and pads it, its patch grid, the merged tokens and the
    prompt it becomes (the text, and the positions the model sees)."""
    from k3lab.kimi_k3.check_vision import SAMPLE_IMAGE, image_prompt, tower
    from k3lab.kimi_k3.vision_ref import preprocess

    t = tower(cfg, meta)
    img = preprocess(image if image is not None else SAMPLE_IMAGE, t)
    (w, h), (rw, rh), (pw, ph) = img.original, img.resized, img.padded
    gh, gw = img.grid
    steps = [
        {"step": "given", "size": f"{w} x {h}", "why": ""},
        {
            "step": "resized",
            "size": f"{rw} x {rh}",
            "why": f"at most {t.in_patch_limit} patches of {t.patch} px",
        },
        {
            "step": "padded",
            "size": f"{pw} x {ph}",
            "why": f"black, to multiples of {t.patch * t.merge[0]} px",
        },
        {"step": "patches", "size": f"{gw} x {gh}", "why": f"{gw * gh} patches of {t.patch} x {t.patch}"},
        {
            "step": "merged tokens",
            "size": f"{gw // t.merge[1]} x {gh // t.merge[0]}",
            "why": f"{img.tokens} tokens",
        },
    ]
    head = f"<|media_begin|>image {w}x{h}<|media_content|>"
    return {
        "image": img,
        "tower": t,
        "steps": steps,
        "prompt": image_prompt(img),
        "sequence": f"{head} + {img.tokens} x <|media_pad|> + <|media_end|>",
    }


def tokenize_with_merges(meta: str | Path, text: str) -> dict[str, Any]:
    """Tokenize ``text`` with tiktoken (Kimi's split pattern) and list the merges each token used."""
    import tiktoken

    from k3lab.formats.bpe_merges import bpe_merges
    from k3lab.kimi_k3.tokenizer import KIMI_PAT_STR

    ranked = read_tiktoken(Path(meta) / "tiktoken.model")
    enc = tiktoken.Encoding(
        "k3", pat_str=KIMI_PAT_STR, mergeable_ranks={t: r for r, t in enumerate(ranked)}, special_tokens={}
    )
    ids = enc.encode(text)
    merge_of = {a + b: (a, b) for a, b in bpe_merges(ranked)}

    def tree(tok: bytes) -> list[str]:
        if tok not in merge_of:
            return []
        a, b = merge_of[tok]
        return [*tree(a), *tree(b), f"{a!r} + {b!r}"]

    vocab = build_vocabulary(meta)
    return {
        "ids": ids,
        "pieces": [ranked[i] for i in ids],
        "gguf tokens": [vocab.tokens[i] for i in ids],
        "merges": {ranked[i]: tree(ranked[i]) for i in ids},
        "n_merges": len(vocab.merges),
        "bytes per token": len(text.encode()) / max(1, len(ids)),
    }
