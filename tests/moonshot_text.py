"""Moonshot's own text forward on CPU as a judge of k3lab's reference: the test side.

The forward is ``k3lab.kimi_k3.moonshot_forward`` (Moonshot's ``modeling_kimi_linear.py`` with fla-core's
torch references serving its KDA kernels: see that module). Here: the models the tests build with
Moonshot's classes (``moonshot.build``) run through it, and an MXFP4 checkpoint of one (``mxfp4_experts``):
each routed expert's weight is quantised (k3lab's helper makes the data: any quantiser's output is an
MXFP4 checkpoint), then dequantised by compressed-tensors (``MXFP4PackedCompressor.decompress``, the
scheme read from the checkpoint's own ``quantization_config``), and Moonshot's module is given those
values; the file stores the packed codes and E8M0 scales, as Moonshot's shards do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from moonshot import save


def text_model(net: Any) -> Any:
    """Moonshot's ``KimiLinearForCausalLM`` of ``net`` (a ``KimiK3ForConditionalGeneration`` built by
    ``moonshot.build``: its modules are the judge's), in float32; skipped without fla-core."""
    from k3lab.kimi_k3 import moonshot_forward

    if (why := moonshot_forward.missing()) is not None:
        pytest.skip(why)
    return net.language_model.float().eval()


def forward(lm: Any, tokens: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    from k3lab.kimi_k3 import moonshot_forward

    return moonshot_forward.forward(lm, tokens)


ROUTED = re.compile(r".*\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def mxfp4_experts(net: Any, quantization_config: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every routed expert's weight of ``net`` made MXFP4: packed, then dequantised by compressed-tensors
    and set back into the module. Returns the packed (codes, scales) by parameter name."""
    import torch

    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from k3lab.formats import mxfp4

    scheme = next(iter(QuantizationConfig.model_validate(quantization_config).config_groups.values()))
    packed: dict[str, tuple[Any, Any]] = {}
    params = dict(net.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if not ROUTED.match(name):
                continue
            codes, scales = (
                torch.from_numpy(a) for a in mxfp4.quantize_compressed_tensors(p.float().numpy())
            )
            out = MXFP4PackedCompressor.decompress({"weight_packed": codes, "weight_scale": scales}, scheme)
            p.copy_(out["weight"].to(p.dtype))
            packed[name] = (codes, scales)
    return packed


def save_mxfp4(net: Any, out: Path, packed: dict[str, tuple[Any, Any]]) -> Path:
    """``net`` saved by ``save_pretrained`` in one file, its routed experts stored packed
    (``weight_packed`` uint8 [rows, cols/2], ``weight_scale`` uint8 [rows, cols/32])."""
    from safetensors.torch import load_file, save_file

    save(net, out, "one-file")
    tensors = load_file(out / "model.safetensors")
    for name, (codes, scales) in packed.items():
        del tensors[name]
        tensors[name + "_packed"], tensors[name + "_scale"] = codes.contiguous(), scales.contiguous()
    save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})
    return out
