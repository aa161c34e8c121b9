"""Structurally faithful synthetic Kimi-K3 checkpoints (real names, layout, dtypes; small sizes)."""

from __future__ import annotations

from .generate import SynthResult, synthesize, tensor_values
from .presets import PRESETS

__all__ = ["PRESETS", "SynthResult", "synthesize", "tensor_values"]
