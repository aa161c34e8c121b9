"""Notebook 05's last view: the text model three ways, layer by layer. Moonshot's own forward
(``moonshot_forward``: its modeling code, fla's references), k3lab's reference (``reference``, float32,
Moonshot's semantics) and llama.cpp on the converted GGUF, each layer's attention and FFN output compared
by NMSE with Moonshot's. The reference's column is the proof that k3lab reads the model as its authors do;
llama.cpp's shows what the runtime adds; and a third line, the reference computing as llama.cpp's graph
does (its two epsilons, its rounding of matmul inputs: ``runtime``), shows that the runtime's own choices
are all there is to it: the conversion adds nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.kimi_k3.config import K3Config


@dataclass
class Forwards:
    tokens: list[int] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per layer stage
    missing: str | None = None  # why the comparison could not run here (one line)


def _nmse(want: np.ndarray, have: np.ndarray) -> float:
    want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
    return float(((want - have) ** 2).sum() / max(float((want**2).sum()), 1e-30))


def three_forwards(source: Any, gguf: str | Path, prompt: str | None = None) -> Forwards:
    """Each layer's attention and FFN output: the reference and llama.cpp against Moonshot's forward,
    on ``prompt`` (default: check-logits' own) as llama.cpp tokenizes it."""
    from k3lab.kimi_k3 import moonshot_forward
    from k3lab.kimi_k3.logits import DEFAULT_PROMPT, llama_tokenize
    from k3lab.kimi_k3.reference import Reference
    from k3lab.kimi_k3.runtime import EPSILONS

    if (why := moonshot_forward.missing()) is not None:
        return Forwards(missing=why)
    try:
        from k3lab.kimi_k3.llama_trace import trace
    except ImportError:
        return Forwards(missing="llama.cpp's side needs llama-cpp-python (`make test` installs it)")
    tokens = llama_tokenize(gguf, prompt or DEFAULT_PROMPT)
    _, theirs = moonshot_forward.forward(moonshot_forward.text_model(source), tokens)
    mine: dict[str, np.ndarray] = {}
    cfg = K3Config.load(source.meta_dir)
    Reference(cfg, source, "f32", runtime=()).logits(tokens, mine)
    choices: dict[str, np.ndarray] = {}
    Reference(cfg, source, "ggml", runtime=EPSILONS).logits(tokens, choices)
    runtime = trace(gguf, tokens, set(theirs))
    rows = []
    for name in sorted(theirs, key=lambda n: (int(n.rsplit("-", 1)[1]), n.startswith("ffn"))):
        rows.append(
            {
                "stage": name,
                "reference vs Moonshot": _nmse(theirs[name], mine[name]),
                "llama.cpp's own choices vs Moonshot": _nmse(theirs[name], choices[name]),
                # (llama.cpp names a block's first attention output otherwise: none there)
                "llama.cpp vs Moonshot": _nmse(theirs[name], runtime[name][0]) if name in runtime else None,
            }
        )
    return Forwards(tokens=tokens, rows=rows)
