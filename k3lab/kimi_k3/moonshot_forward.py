"""Moonshot's own Kimi-K3 text forward on CPU: a judge that cannot share k3lab's reading of the model.

The forward is Moonshot's ``modeling_kimi_linear.py`` (``KimiLinearForCausalLM``, the wheel's copy:
``moonshot.folder``), run in float32. Its KDA layers call flash-linear-attention's Triton kernels;
fla-core (``pip install k3lab[judge]``) ships torch references of them, which serve those calls here:
``fla.ops.kda.naive.naive_recurrent_kda`` and the gates ``naive_kda_gate`` and
``naive_kda_lowerbound_gate`` (read out of ``fla/ops/kda/gate.py`` by its syntax tree: the file imports
Triton beside them). The kernels' in-kernel options are composed around them as fla's ``chunk_kda``
applies them (q and k L2-normalised, beta through a sigmoid, the gate from the raw projection, its
lower-bound form when Moonshot passes one), and fla's two modules compute as their kernels do:
``ShortConvolution`` a causal depthwise conv1d then SiLU, ``FusedRMSNormGated(activation="sigmoid")``
an RMSNorm times its weight times the gate's sigmoid. The weights are the checkpoint's, MXFP4 experts
dequantised by compressed-tensors (``MXFP4PackedCompressor``, the scheme read from the checkpoint's
``quantization_config``), not by k3lab. Small checkpoints only: the whole text model is held in float32.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.numerics import bf16_bits_to_f32
from k3lab.kimi_k3 import moonshot

PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "einops": "einops",
    "compressed_tensors": "compressed-tensors",
}
PACKAGE = "llmcompressor.modeling.kimi_k3"
LM = "language_model."
ROUTED = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
MAX_PARAMETERS = 2_000_000_000  # float32 on CPU: 8 GB; Kimi-K3 itself is far past it


def missing() -> str | None:
    """What this machine lacks to run the judge, in one line, or None."""
    absent = [pip for name, pip in PACKAGES.items() if importlib.util.find_spec(name) is None]
    if _fla_root() is None:
        absent.append("fla-core")
    if absent:
        return f"the Moonshot judge needs {', '.join(absent)}: pip install 'k3lab[judge]'"
    if not moonshot.complete():
        return moonshot.missing().replace("encoding_k3.py", "modeling code")
    return None


def _fla_root() -> Path | None:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).parent
    return (
        root.parent
        if (root / "ops/kda/naive.py").is_file() and (root / "ops/kda/gate.py").is_file()
        else None
    )


def fla_references() -> types.SimpleNamespace:
    """fla's torch references, from its installed files (its package is never imported: Triton)."""
    import torch

    root = _fla_root()
    if root is None:
        raise K3LabError("fla-core is not installed: pip install 'k3lab[judge]'")
    spec = importlib.util.spec_from_file_location("k3lab_fla_kda_naive", root / "fla/ops/kda/naive.py")
    assert spec is not None and spec.loader is not None
    naive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive)
    gate_file = root / "fla/ops/kda/gate.py"
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    body = [
        n
        for n in ast.parse(gate_file.read_text()).body
        if isinstance(n, ast.FunctionDef) and n.name in wanted
    ]
    gates: dict[str, Any] = {"torch": torch, "F": torch.nn.functional}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(gate_file), "exec"), gates)  # noqa: S102 (fla's own code)
    return types.SimpleNamespace(
        recurrent=naive.naive_recurrent_kda,
        gate=gates["naive_kda_gate"],
        lower_gate=gates["naive_kda_lowerbound_gate"],
    )


def _l2norm(x: Any, eps: float = 1e-6) -> Any:
    """fla's ``l2norm_fwd``: x / sqrt(sum(x^2) + eps), in float32."""
    import torch

    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _kda_call(fla: types.SimpleNamespace) -> Any:
    """``chunk_kda`` / ``fused_recurrent_kda`` as Moonshot calls them, on fla's references."""

    def kda(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=False, **kw):  # noqa: N803
        if kw.get("cu_seqlens") is not None:
            raise K3LabError("the Moonshot judge runs one unpadded sequence")
        if kw.get("use_qk_l2norm_in_kernel"):
            q, k = _l2norm(q), _l2norm(k)
        if kw.get("use_beta_sigmoid_in_kernel"):
            beta = beta.float().sigmoid()
        if kw.get("use_gate_in_kernel"):
            bound = kw.get("lower_bound")
            g = fla.lower_gate(g, A_log, dt_bias, bound) if bound is not None else fla.gate(g, A_log, dt_bias)
        o, state = fla.recurrent(
            q.float(), k.float(), v.float(), g.float(), beta.float(), None, initial_state, True
        )
        return o.to(v.dtype), state

    return kda


def _fla_modules() -> tuple[type, type]:
    import torch

    class ShortConvolution(torch.nn.Module):
        """fla's module as its kernel computes: a causal depthwise conv1d, then the activation."""

        def __init__(self, hidden_size: int, kernel_size: int, activation: str | None = None, **_: Any):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
            self.activation = activation

        def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None, **_: Any):
            k = self.weight.shape[-1]
            y = torch.nn.functional.conv1d(x.transpose(1, 2), self.weight, padding=k - 1, groups=x.shape[-1])
            y = y[..., : x.shape[1]].transpose(1, 2)
            return (torch.nn.functional.silu(y) if self.activation in ("silu", "swish") else y), None

    class FusedRMSNormGated(torch.nn.Module):
        """fla's module as its kernel computes: RMSNorm * weight * act(gate)."""

        def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "swish", **_: Any):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.eps, self.activation = eps, activation

        def forward(self, x, g, **_: Any):
            x32 = x.float()
            y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
            gate = (
                g.float().sigmoid() if self.activation == "sigmoid" else torch.nn.functional.silu(g.float())
            )
            return (y * gate).to(x.dtype)

    return ShortConvolution, FusedRMSNormGated


def stand_in_parents(root: Path, packages: tuple[str, ...]) -> None:
    """Empty parent packages over the wheel's files under ``root`` (each with a spec, as an import
    would give it), so that the package's own ``__init__`` (a training stack) never runs."""
    for name in packages:
        if name not in sys.modules:
            stand_in = types.ModuleType(name)
            stand_in.__path__ = [str(root / name.replace(".", "/"))]
            stand_in.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            stand_in.__spec__.submodule_search_locations = stand_in.__path__
            sys.modules[name] = stand_in


def modules() -> types.SimpleNamespace:
    """Moonshot's modules (``config``, ``text``, ``model``, ``vision_processing``), importable here:
    the wheel's files under stand-in parent packages (its ``__init__`` pulls in a training stack), fla's
    calls served as above. Loaded once per process."""
    import torch

    folder = moonshot.folder()
    if folder is None:
        raise K3LabError(moonshot.missing())
    stand_in_parents(
        folder.parents[2], ("llmcompressor", "llmcompressor.modeling", "llmcompressor.modeling.moe")
    )
    # its "install fla" warning: fla is served here (its own import would need Triton)
    logging.getLogger(f"{PACKAGE}.modeling_kimi_linear").setLevel(logging.ERROR)
    with contextlib.redirect_stderr(open(os.devnull, "w")):
        text = importlib.import_module(f"{PACKAGE}.modeling_kimi_linear")
        model = importlib.import_module(f"{PACKAGE}.modeling_kimi_k3")
    if not getattr(text, "_k3lab_judge", False):
        text.ShortConvolution, text.FusedRMSNormGated = _fla_modules()
        if importlib.util.find_spec("einops") is not None:
            import einops

            text.rearrange = einops.rearrange
        if _fla_root() is not None:
            text.chunk_kda = text.fused_recurrent_kda = _kda_call(fla_references())
        text._k3lab_judge = True
    torch._dynamo.config.disable = True  # (its vision resize is torch.compile'd; run eagerly)
    return types.SimpleNamespace(
        config=importlib.import_module(f"{PACKAGE}.configuration_kimi_k3"),
        text=text,
        model=model,
        vision_processing=importlib.import_module(f"{PACKAGE}.kimi_k3_vision_processing"),
    )


def text_model(source: Any) -> Any:
    """Moonshot's ``KimiLinearForCausalLM`` for the source's config, in float32, with its weights."""
    import torch

    if (why := missing()) is not None:
        raise K3LabError(why)
    m = modules()
    raw = json.loads((Path(source.meta_dir) / "config.json").read_text())
    cfg = m.config.KimiK3Config(**raw).text_config
    cfg._attn_implementation = "eager"
    n = _parameters(source)
    if n > MAX_PARAMETERS:
        raise K3LabError(f"the Moonshot judge holds the text model in float32: {n:,} parameters is too many")
    lm = m.text.KimiLinearForCausalLM(cfg).float()
    scheme = _scheme(raw)
    state = {}
    for name, p in lm.state_dict().items():
        state[name] = torch.from_numpy(_weight(source, name, scheme)).reshape(p.shape)
    lm.load_state_dict(state, strict=True)
    return lm.eval()


def _parameters(source: Any) -> int:
    """The text model's parameter count, from the checkpoint's headers (before anything is built)."""
    total = 0
    for name in source.weight_map:
        if name.startswith(LM):
            total += int(np.prod(source.entry(name).shape, dtype=np.int64))
    return total


def _scheme(raw: dict[str, Any]) -> Any:
    q = raw.get("text_config", {}).get("quantization_config") or raw.get("quantization_config")
    if not q:
        return None
    from compressed_tensors.quantization import QuantizationConfig

    return next(iter(QuantizationConfig.model_validate(q).config_groups.values()))


def _weight(source: Any, name: str, scheme: Any) -> np.ndarray:
    """One parameter of the text model as float32, from the checkpoint (MXFP4 by compressed-tensors)."""
    full = LM + name
    if ROUTED.search(name) and full + "_packed" in source.weight_map:
        import torch
        from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

        if scheme is None:
            raise K3LabError(f"{full}_packed: packed experts, but config.json has no quantization_config")
        parts = {
            "weight_packed": torch.from_numpy(np.array(source.array(full + "_packed"))),
            "weight_scale": torch.from_numpy(np.array(source.array(full + "_scale"))),
        }
        return MXFP4PackedCompressor.decompress(parts, scheme)["weight"].float().numpy()
    e = source.entry(full)
    a = source.array(full)
    return (
        bf16_bits_to_f32(a) if e.dtype == "BF16" else np.array(a, dtype=np.float32)
    )  # (a copy: torch writes)


def forward(lm: Any, tokens: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Moonshot's logits for ``tokens`` and, by forward hooks, each layer's attention and FFN output
    under llama.cpp's callback names (``kda_out-3``, ``mla_out-7``, ``ffn_out-3``)."""
    import torch

    trace: dict[str, np.ndarray] = {}
    hooks = []

    def keep(name: str) -> Any:
        def hook(_mod: Any, _inp: Any, out: Any) -> None:
            value = out[0] if isinstance(out, tuple) else out
            trace[name] = value.detach().float()[0].numpy()

        return hook

    for il, layer in enumerate(lm.model.layers):
        kind = "kda" if hasattr(layer.self_attn, "q_conv1d") else "mla"
        ffn = getattr(layer, "block_sparse_moe", None) or layer.mlp
        hooks.append(layer.self_attn.register_forward_hook(keep(f"{kind}_out-{il}")))
        hooks.append(ffn.register_forward_hook(keep(f"ffn_out-{il}")))
    try:
        with torch.no_grad():
            out = lm(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float().numpy(), trace
