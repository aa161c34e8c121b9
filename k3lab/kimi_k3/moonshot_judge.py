"""``check-logits --judge moonshot``: Moonshot's own forward as a judge of k3lab's reference, and what
llama.cpp's graph's own choices (``runtime``) do to Moonshot's forward, stage by stage.

- ``judge_moonshot``: the reference with Moonshot's semantics (its epsilons, float32) against
  Moonshot's forward (``moonshot_forward``) on the same tokens, per layer's attention and FFN output
  and the logits: they must agree within ``JUDGE_THRESHOLD`` (only accumulation order parts them). A
  stage past it means k3lab reads the checkpoint otherwise than Moonshot does: a failure.
- ``runtime_effect``: the reference as llama.cpp runs it (its epsilons; in ``ggml`` mode its
  roundings too) against the reference with Moonshot's semantics, per stage, and which deviation
  moves it (each run alone): information, never a failure (a GGUF cannot carry Moonshot's epsilons).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.reference import Reference
from k3lab.kimi_k3.runtime import DEVIATIONS, EPSILONS, ROUNDINGS

# Moonshot's forward and the reference both in float32, on the same weights and semantics: only
# accumulation order parts them (3.5e-13 measured at transformers' init, 2e-10 on trained-like
# draws); a misreading moves whole rows (1e-2 and up)
JUDGE_THRESHOLD = 1e-6
NAMED = 1e-12  # a deviation moving a stage by less than this is not named as its cause


def nmse(want: np.ndarray, have: np.ndarray) -> float:
    """The largest over positions of sum((have - want)^2) / sum(want^2) (float64)."""
    want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
    if want.shape != have.shape:
        return float("inf")
    return float((((have - want) ** 2).sum(-1) / np.maximum((want**2).sum(-1), 1e-30)).max())


def _trace(cfg: K3Config, source: Any, tokens: list[int], mode: str, runtime: tuple[str, ...]) -> dict:
    """Every stage of the reference (llama.cpp's callback names) and its logits (``result_output``)."""
    trace: dict[str, np.ndarray] = {}
    trace["result_output"] = Reference(cfg, source, mode, runtime=runtime).logits(tokens, trace)
    return trace


def judge_moonshot(source: Any, tokens: list[int]) -> dict[str, float]:
    """Per stage (each layer's attention and FFN output, and ``result_output``): NMSE of the reference
    with Moonshot's semantics (float32, Moonshot's epsilons) against Moonshot's own forward."""
    from k3lab.kimi_k3 import moonshot_forward

    if (why := moonshot_forward.missing()) is not None:
        raise K3LabError(f"check-logits --judge moonshot: {why}")
    theirs, trace_theirs = moonshot_forward.forward(moonshot_forward.text_model(source), tokens)
    mine = _trace(K3Config.load(source.meta_dir), source, tokens, "f32", ())
    out = {name: nmse(trace_theirs[name], mine[name]) for name in trace_theirs if name in mine}
    out["result_output"] = nmse(theirs, mine["result_output"])
    return out


@dataclass
class RuntimeEffect:
    """What llama.cpp's own choices do to Moonshot's forward: per stage (all of them at once, and the
    deviations that move it most), and per deviation run alone (stage, NMSE) in stage order."""

    stages: dict[str, tuple[float, str]] = field(default_factory=dict)
    alone: dict[str, list[tuple[str, float]]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [
            "llama.cpp's graph differs from Moonshot's forward by choices of its own (information, not a failure):"
        ]
        for name, moved in self.alone.items():
            hit = [(s, v) for s, v in moved if v >= NAMED]
            if hit:
                most = max(hit, key=lambda x: x[1])
                where = f"first moves {hit[0][0]} ({hit[0][1]:.2e}), the most {most[0]} ({most[1]:.2e})"
            else:
                where = "moves no stage here"
            out.append(f"  runtime: {'; '.join(DEVIATIONS[n].line() for n in name.split(' and '))}: {where}")
        return out


def runtime_effect(source: Any, tokens: list[int], mode: str, stages: list[str]) -> RuntimeEffect:
    """Per stage: (NMSE of the reference as llama.cpp runs it against it with Moonshot's semantics,
    the deviations that move it: each run alone, those within a decade of the largest, named); and
    each deviation alone, stage by stage."""
    cfg = K3Config.load(source.meta_dir)
    moonshot = _trace(cfg, source, tokens, "f32", ())
    runtime = _trace(cfg, source, tokens, mode, EPSILONS)
    alone = {name: _trace(cfg, source, tokens, "f32", (name,)) for name in EPSILONS}
    if mode == "ggml":
        alone[" and ".join(ROUNDINGS)] = _trace(cfg, source, tokens, "ggml", ())
    out = RuntimeEffect(alone={name: [] for name in alone})
    for stage in stages:
        if stage not in moonshot:
            continue
        effects = {name: nmse(moonshot[stage], t[stage]) for name, t in alone.items()}
        for name, v in effects.items():
            out.alone[name].append((stage, v))
        top = max(effects.values(), default=0.0)
        causes = [n for n, v in sorted(effects.items(), key=lambda kv: -kv[1]) if v >= max(NAMED, top / 10)]
        out.stages[stage] = (
            nmse(moonshot[stage], runtime[stage]),
            ", ".join(_words(n) for n in causes) or "none",
        )
    return out


def _words(name: str) -> str:
    return " and ".join(DEVIATIONS[n].what for n in name.split(" and "))
