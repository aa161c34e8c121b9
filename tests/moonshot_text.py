"""Moonshot's own text forward on CPU, as a judge of k3lab's reference forward (and so of the transforms
both read the checkpoint through).

``modeling_kimi_linear.py`` (the llmcompressor wheel's copy of Moonshot's file, ``moonshot.modeling``)
runs its KDA layers through flash-linear-attention's Triton kernels. fla (``fla-core`` on PyPI, a
pure-Python wheel, fetched once with ``pip download`` into ``~/.cache/k3lab/``) ships torch references
for them: ``fla.ops.kda.naive.naive_recurrent_kda`` and the gates ``naive_kda_gate`` and
``naive_kda_lowerbound_gate`` (in ``fla/ops/kda/gate.py``, beside Triton kernels: the two functions are
taken out of the file by their syntax tree, so Triton is never imported). The kernels' in-kernel
options are composed around them as ``fla/ops/kda/chunk.py`` applies them: q and k L2-normalised, beta
through a sigmoid, the gate from the raw projection (the lower-bound form when Moonshot asks for
``safe_gate``). fla's two modules run as their kernels compute: ``ShortConvolution`` a causal depthwise
conv1d then SiLU, ``FusedRMSNormGated`` with ``activation="sigmoid"`` an RMSNorm times its weight times
sigmoid of the gate. Nothing of k3lab is used, and nothing here is copied into k3lab.

An MXFP4 checkpoint (``mxfp4_experts``): each routed expert's weight is quantised (k3lab's helper
makes the data: any quantiser's output is an MXFP4 checkpoint), then dequantised by compressed-tensors
(``MXFP4PackedCompressor.decompress``, the scheme read from the checkpoint's own
``quantization_config``), and Moonshot's module is given those values; the file stores the packed
codes and E8M0 scales, as Moonshot's shards do.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from moonshot import CACHE, modeling, save

FLA = "fla-core==0.6.0"


def _fla_files() -> Path:
    """fla-core's files: the installed package's (the test extra installs it), else its wheel unpacked
    once. Found, never imported (``fla/__init__.py`` imports Triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is not None and spec.origin and (Path(spec.origin).parent / "ops/kda/naive.py").exists():
        return Path(spec.origin).parent.parent
    root = CACHE.parent / "fla-core-0.6.0"
    if (root / "fla/ops/kda/naive.py").exists():
        return root
    wheels = root.with_name(root.name + ".wheel")
    wheels.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), FLA],
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = sorted(wheels.glob("fla_core-*.whl"))
    if got.returncode or not found:
        pytest.skip(f"fla-core's wheel could not be fetched ({got.stderr.strip()[-200:]})")
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(tmp)
    os.replace(tmp, root)
    return root


def fla_references() -> types.SimpleNamespace:
    """fla's torch references: ``naive_recurrent_kda`` and the two gate functions."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("einops")
    root = _fla_files()
    spec = importlib.util.spec_from_file_location("fla_kda_naive", root / "fla/ops/kda/naive.py")
    naive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive)
    tree = ast.parse((root / "fla/ops/kda/gate.py").read_text())
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    gates: dict[str, Any] = {"torch": torch, "F": torch.nn.functional}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(root / "fla/ops/kda/gate.py"), "exec"), gates)
    return types.SimpleNamespace(
        recurrent=naive.naive_recurrent_kda,
        gate=gates["naive_kda_gate"],
        lower_gate=gates["naive_kda_lowerbound_gate"],
    )


def _l2norm(x: Any, eps: float = 1e-6) -> Any:  # (fla's l2norm_fwd: x / sqrt(sum x^2 + eps), in float32)
    import torch

    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _kda(fla: types.SimpleNamespace):
    def kda(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=False, **kw):  # noqa: N803
        if kw.get("cu_seqlens") is not None:
            raise NotImplementedError("the judge runs unpadded batches of one")
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


def text_model(net: Any) -> Any:
    """Moonshot's ``KimiLinearForCausalLM`` of ``net`` (a ``KimiK3ForConditionalGeneration``), in
    float32, its fla calls served as above."""
    import torch

    m = modeling()
    fla = fla_references()

    class ShortConvolution(torch.nn.Module):
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

    lm = net.language_model.float()
    for layer in lm.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_conv1d"):
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                old = getattr(attn, name)
                new = ShortConvolution(old.weight.shape[0], old.weight.shape[-1], activation="silu")
                new.weight = old.weight
                setattr(attn, name, new)
            old = attn.o_norm
            new = FusedRMSNormGated(old.weight.shape[0], eps=lm.config.rms_norm_eps, activation="sigmoid")
            new.weight = old.weight
            attn.o_norm = new
    m.text.chunk_kda = m.text.fused_recurrent_kda = _kda(fla)

    def rearrange(x, pattern, **sizes):
        import einops

        return einops.rearrange(x, pattern, **sizes)

    m.text.rearrange = rearrange
    return lm.eval()


def forward(lm: Any, tokens: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Moonshot's logits for ``tokens`` and, by forward hooks, each layer's attention and FFN output
    under llama.cpp's callback names (``kda_out-3``, ``mla_out-7``, ``ffn_out-3``)."""
    import torch

    trace: dict[str, np.ndarray] = {}
    hooks = []
    for il, layer in enumerate(lm.model.layers):
        kind = "kda" if hasattr(layer.self_attn, "q_conv1d") else "mla"
        ffn = getattr(layer, "block_sparse_moe", None) or layer.mlp

        def keep(name: str):
            def hook(_mod, _inp, out):
                value = out[0] if isinstance(out, tuple) else out
                trace[name] = value.detach().float()[0].numpy()

            return hook

        hooks.append(layer.self_attn.register_forward_hook(keep(f"{kind}_out-{il}")))
        hooks.append(ffn.register_forward_hook(keep(f"ffn_out-{il}")))
    try:
        with torch.no_grad():
            out = lm(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float().numpy(), trace


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
