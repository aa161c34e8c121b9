"""Moonshot's own Kimi-K3 modeling code as a judge: checkpoints built by its classes and saved by
transformers' ``save_pretrained``, in the layouts found in the wild.

The code comes from PyPI's ``llmcompressor==0.14.0.1`` wheel, which ships Moonshot's files unchanged
but for weight init (``llmcompressor/modeling/kimi_k3/``). The wheel is fetched once with ``pip
download`` into ``~/.cache/k3lab/`` and its ``kimi_k3`` files (and the one ``moe/context.py`` they
import) are imported from there, under stand-in parent packages, so that the package's own
``__init__`` (which pulls in its training stack) never runs. The KDA layers construct two modules
of flash-linear-attention (GPU only); stand-ins hold the same parameters (``ShortConvolution``: a
``weight`` [C, 1, K], ``FusedRMSNormGated``: a ``weight`` [head_dim]) and are never run. Nothing of
this is copied into k3lab.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

from k3lab.kimi_k3 import moonshot as found  # (where k3lab looks for these files: the same place)

WHEEL = found.WHEEL
CACHE = found.cache()
PACKAGE = "llmcompressor.modeling.kimi_k3"


def _unpacked() -> Path:
    """The wheel's kimi_k3 files, unpacked once (``pip download`` fetches the wheel)."""
    root = CACHE / "src"
    if (root / "llmcompressor/modeling/kimi_k3/modeling_kimi_k3.py").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob("llmcompressor-0.14.0.1-*.whl"))
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE), WHEEL],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wheels = sorted(CACHE.glob("llmcompressor-0.14.0.1-*.whl"))
        if done.returncode or not wheels:
            pytest.skip(f"cannot fetch {WHEEL} (Moonshot's modeling code): {done.stderr.strip()[-200:]}")
    tmp = CACHE / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheels[0]) as z:
        for name in z.namelist():
            if name.startswith(("llmcompressor/modeling/kimi_k3/", "llmcompressor/modeling/moe/context.py")):
                z.extract(name, tmp)
    os.replace(tmp, root)
    return root


def _stand_ins(root: Path, packages: tuple[str, ...]) -> None:
    """The judge's stand-in parent packages over the unpacked files (its ``__init__`` never runs)."""
    from k3lab.kimi_k3.moonshot_forward import stand_in_parents

    stand_in_parents(root, packages)


def modeling() -> types.SimpleNamespace:
    """Moonshot's modules (``config``, ``text``, ``model``, ``vision_processing``), as k3lab's Moonshot
    judge loads them (``k3lab.kimi_k3.moonshot_forward.modules``: fla's modules and calls served by
    fla-core's references where it is installed), from the wheel's files unpacked here."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("einops")
    _unpacked()
    from k3lab.kimi_k3 import moonshot_forward

    return moonshot_forward.modules()


def build(raw: dict[str, Any], seed: int = 0, dtype: str = "bfloat16", init: str = "fan-in") -> Any:
    """A ``KimiK3ForConditionalGeneration`` made from config.json's dict by Moonshot's classes, its
    weights drawn from ``seed``, in ``dtype``; the vision tower's attention set to eager (its only CPU
    path). ``init``: ``fan-in`` (norms near one, matrices N(0, 1/sqrt(fan_in)), the KDA log-decays as
    Moonshot initialises them), or ``transformers`` (the classes' own initialisation, untouched: small
    matrices, so the KDA q/k and the MLA latents have small norms and an epsilon shows), or ``large``
    (fan-in, the q/k/latent projections scaled up 30x: large norms, an epsilon vanishes)."""
    import torch

    m = modeling()
    raw = json.loads(json.dumps(raw))
    cfg = m.config.KimiK3Config(**raw)
    torch.manual_seed(seed)
    with torch.no_grad():
        net = m.model.KimiK3ForConditionalGeneration(cfg)
        for name, p in net.named_parameters() if init == "transformers" else ():
            # transformers' own scale (Moonshot's _init_weights, which llmcompressor's copy skips): every
            # matrix N(0, initializer_range), the conv kernels too; norms one, A_log as the class draws
            # it, every other vector (dt_bias, the router's bias) zero
            if p.dim() >= 2:
                p.normal_(0.0, float(raw["text_config"].get("initializer_range", 0.02)))
            elif not name.endswith(("norm.weight", "norm0.weight", "norm1.weight", "A_log")):
                p.zero_()
        for name, p in net.named_parameters() if init != "transformers" else ():
            if name.endswith(
                ("norm.weight", "norm0.weight", "norm1.weight", "layernorm.weight", "o_norm.weight")
            ):
                p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16)))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p, dtype=torch.float32))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn_like(p, dtype=torch.float32) / fan_in**0.5)
            if init == "large" and name.endswith(("q_proj.weight", "k_proj.weight", "kv_a_proj_with_mqa.weight",
                                                  "q_a_proj.weight")):  # fmt: skip
                p.mul_(30.0)
    net = net.to(getattr(torch, dtype))
    for layer in net.vision_tower.encoder.blocks:
        layer.attn_implementation = "eager"
    return net.eval()


def save(net: Any, out: Path, layout: str, tokenizer_from: Path | None = None) -> Path:
    """``net`` saved as transformers saves it: ``one-file`` (``save_pretrained`` below its shard
    size: one model.safetensors, no index), ``by-size:BYTES`` (its size-based shards, a layer's
    tensors across files), or ``per-layer`` (Moonshot's layout: ``save_pretrained``'s tensors
    regrouped a layer per file with the safetensors library). ``tokenizer_from``: a folder whose
    tokenizer files are copied beside it (the classes make no tokenizer)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    if layout.startswith("by-size:"):
        net.save_pretrained(out, max_shard_size=int(layout.split(":")[1]))
    else:
        net.save_pretrained(out, max_shard_size=1 << 40)
    if layout == "per-layer":
        tensors = load_file(out / "model.safetensors")
        (out / "model.safetensors").unlink()

        def unit(name: str) -> str:
            if ".layers." in name:
                return f"{int(name.split('.layers.')[1].split('.')[0]):05d}"
            return "99998" if name.startswith("language_model.") else "99999-" + name.split(".")[0]

        units = sorted({unit(n) for n in tensors})
        weight_map = {}
        for k, u in enumerate(units, start=1):
            file = f"model-{k:05d}-of-{len(units):06d}.safetensors"
            save_file(
                {n: t for n, t in tensors.items() if unit(n) == u}, out / file, metadata={"format": "pt"}
            )
            weight_map |= {n: file for n in tensors if unit(n) == u}
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = dict(sorted(weight_map.items()))
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer_from is not None:
        for name in ("tiktoken.model", "tokenizer_config.json", "preprocessor_config.json"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, out / name)
    return out


def vision_forward(net: Any, meta_dir: Path, image: Any) -> tuple[Any, Any, Any]:
    """Moonshot's own way from an image to its embeddings: its processor (``preprocessor_config.json``'s
    ``media_proc_cfg``) makes the patches and the grid, ``vision_tower`` the merged tokens and
    ``mm_projector`` the embeddings. Returns (patches [N, 3, 14, 14], grid (h, w), embeddings), as
    float32 NumPy arrays."""
    import torch

    m = modeling()
    raw = json.loads((meta_dir / "preprocessor_config.json").read_text())
    processor = m.vision_processing.KimiK3VisionProcessor(raw.get("media_proc_cfg", raw))
    batch = processor.preprocess([{"type": "image", "image": image}], return_tensors="pt")
    dtype = net.vision_tower.patch_embed.proj.weight.dtype
    with torch.no_grad():
        merged = net.vision_tower(batch["pixel_values"].to(dtype), batch["grid_thws"])
        (embeddings,) = net.mm_projector(merged)
    _, h, w = (int(x) for x in batch["grid_thws"][0])
    return batch["pixel_values"].float().numpy(), (h, w), embeddings.float().numpy()


def chat() -> types.SimpleNamespace:
    """Moonshot's chat format: ``encoding_k3`` (``build_chat_segments``) and ``tokenization_kimi``
    (``TikTokenTokenizer``, whose ``apply_chat_template`` encodes the segments one by one)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tiktoken")
    _stand_ins(_unpacked(), ("llmcompressor", "llmcompressor.modeling"))
    encoding = importlib.import_module(f"{PACKAGE}.encoding_k3")
    tokenization = importlib.import_module(f"{PACKAGE}.tokenization_kimi")
    return types.SimpleNamespace(encoding=encoding, tokenization=tokenization)


def tokenizer(meta: Path) -> Any:
    """Moonshot's ``TikTokenTokenizer`` on a checkpoint's ``tiktoken.model`` and ``tokenizer_config.json``
    (made as ``from_pretrained`` makes it: the config's special tokens as ``AddedToken`` objects)."""
    from tokenizers import AddedToken

    cfg = json.loads((meta / "tokenizer_config.json").read_text())
    decoder = {
        int(i): AddedToken(t["content"], special=True, normalized=False)
        for i, t in cfg["added_tokens_decoder"].items()
    }
    return chat().tokenization.TikTokenTokenizer(
        str(meta / "tiktoken.model"),
        bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"],
        unk_token=cfg["unk_token"],
        pad_token=cfg["pad_token"],
        added_tokens_decoder=decoder,
    )
