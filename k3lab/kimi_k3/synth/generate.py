"""Write a synthetic Kimi-K3 checkpoint: config, index, safetensors shards, tokenizer files.

Values are drawn per tensor from a seed and the tensor's name, so any shard can be written
alone and the same seed always gives the same bytes. ``draw`` says how:

  trained    (the default) to look like a trained model's: norms near one, fan-in scaled linears
             whose gain varies by layer and projection, MXFP4 experts whose E8M0 scales wander by
             layer, projection, expert and row, with rare outlier blocks, and whose FP4 codes follow
             a bell-shaped histogram; routers with a clear expert preference per layer
  normal     a fresh initialisation: every matrix N(0, 0.02), norms 1, biases and router bias 0
  fan-in     every matrix N(0, 1/sqrt(fan_in)), embeddings N(0, 1), norms 1, router bias 0
  near-ties  as normal, with routers so flat (N(0, 1e-5)) that expert choices nearly tie

In the last three the MXFP4 experts are float weights of the same law quantised by compressed-tensors'
own definition (``mxfp4.quantize_compressed_tensors``), not a synthetic code histogram: checks that
hold on ``trained`` must hold on these too.
"""

from __future__ import annotations

import base64
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats import mxfp4
from k3lab.formats.numerics import f32_to_bf16_bits
from k3lab.formats.safetensors import (
    DTYPE_SIZE,
    INDEX_NAME,
    NUMPY_DTYPE,
    SINGLE_NAME,
    build_header,
    data_size,
)
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.layout import TensorSpec, checkpoint_layout, save_order, shard_filename

from . import bpe
from .presets import N_SPECIAL, PRESET_LAYOUT, PRESETS, preprocessor_config

# how often each E2M1 magnitude index 0..7 appears in a quantised Gaussian block (out of 256)
_CODE_WEIGHTS = np.array([40, 62, 52, 36, 26, 22, 12, 6])
_NIBBLE_LUT = np.repeat(np.arange(8, dtype=np.uint8), _CODE_WEIGHTS)
_PROJ_GAIN = {
    "q": 1.0,
    "k": 0.9,
    "v": 1.1,
    "o": 0.8,
    "g": 1.2,
    "gate": 1.0,
    "up": 0.9,
    "down": 0.7,
    "w1": 1.0,
    "w2": 0.75,
    "w3": 0.9,
}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _layer_of(name: str) -> int:
    m = re.search(r"\.layers\.(\d+)\.|blocks\.(\d+)\.", name)
    return int(next(g for g in m.groups() if g is not None)) if m else 0


# The MoE adds a small update to the residual stream, as in a trained model. (A random MoE whose
# output rivals the stream turns the runtime's Q8_0 activation rounding into large logit noise.)
_MOE_OUT_GAIN = {"routed_expert_up_proj": 0.04, "shared_experts.down_proj": 0.04}


def _gain(name: str) -> float:
    layer = _layer_of(name)
    for key, gain in _MOE_OUT_GAIN.items():
        if key in name:
            return gain
    proj = next((p for p in _PROJ_GAIN if re.search(rf"[._]{p}[._]", name)), "o")
    return _PROJ_GAIN[proj] * (0.75 + 0.5 * (0.5 + 0.5 * np.sin(0.9 * layer + 1.3)))


def _mxfp4_scale(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    rows, nblk = spec.shape
    cols = nblk * 32
    # amax of a block of 32 Gaussian weights with std gain/sqrt(fan_in) is ~2.5 std
    centre = 127 + np.log2(2.5 * _gain(spec.name) / np.sqrt(cols)) - 2
    expert = int(re.search(r"experts\.(\d+)\.", spec.name).group(1))
    centre += 0.6 * np.sin(expert * 2.1)  # experts differ
    row = rng.normal(0.0, 0.7, size=(rows, 1))  # rows differ
    e = np.rint(centre + row + rng.normal(0.0, 0.45, size=(rows, nblk)))
    # rare blocks far below the rest (byte 0: an all-zero block) and a few a little above; never the
    # huge upward outliers a corrupt checkpoint could have (the notebooks flag bytes 0 and >= 250)
    outliers = rng.random((rows, nblk)) < 2e-4
    e = np.where(outliers, e + rng.choice([-255, -40, -12, 3], size=(rows, nblk)), e)
    return np.clip(e, 0, 254).astype(np.uint8)


def _mxfp4_packed(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(spec.shape))
    lo = _NIBBLE_LUT[rng.integers(0, 256, size=n, dtype=np.uint8)] | (
        rng.integers(0, 2, n, dtype=np.uint8) << 3
    )
    hi = _NIBBLE_LUT[rng.integers(0, 256, size=n, dtype=np.uint8)] | (
        rng.integers(0, 2, n, dtype=np.uint8) << 3
    )
    return (lo | (hi << 4)).reshape(spec.shape)


DRAWS = ("trained", "normal", "fan-in", "near-ties")


def _plain_values(spec: TensorSpec, seed: int, draw: str) -> np.ndarray:
    """The float32 values (or MXFP4 parts) of the plain draws: no conditioning at all."""
    if spec.kind in ("mxfp4_packed", "mxfp4_scale"):
        base = spec.name.rsplit(".", 1)[0]  # both halves quantise the same float weights
        rows = spec.shape[0]
        cols = spec.shape[1] * (2 if spec.kind == "mxfp4_packed" else mxfp4.QK)
        std = 0.02 if draw != "fan-in" else 1 / np.sqrt(cols)
        packed, scale = mxfp4.quantize_compressed_tensors(_rng(seed, base).normal(0.0, std, (rows, cols)))
        return packed if spec.kind == "mxfp4_packed" else scale
    rng = _rng(seed, spec.name)
    shape = spec.shape
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    if spec.kind in ("norm",):
        return np.ones(shape, np.float32)
    if spec.kind in ("bias", "router_bias"):
        return np.zeros(shape, np.float32)
    if spec.kind == "a_log":
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if spec.kind == "dt_bias":
        return rng.normal(0.0, 0.02 if draw != "fan-in" else 1.0, size=shape).astype(np.float32)
    if draw == "near-ties" and spec.name.endswith("block_sparse_moe.gate.weight"):
        return rng.normal(0.0, 1e-5, size=shape).astype(np.float32)
    if draw == "fan-in":
        std = 1.0 if spec.kind == "embed" else 1 / np.sqrt(fan_in)
    else:
        std = 0.02
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def tensor_values(spec: TensorSpec, seed: int, draw: str = "trained") -> np.ndarray:
    """The synthetic tensor, in its safetensors holding dtype (BF16 as uint16 bits)."""
    if draw != "trained":
        x = _plain_values(spec, seed, draw)
        if spec.kind in ("mxfp4_packed", "mxfp4_scale"):
            return x
        return f32_to_bf16_bits(x) if spec.dtype == "BF16" else x.astype(NUMPY_DTYPE[spec.dtype])
    rng = _rng(seed, spec.name)
    if spec.kind == "mxfp4_packed":
        return _mxfp4_packed(spec, rng)
    if spec.kind == "mxfp4_scale":
        return _mxfp4_scale(spec, rng)
    shape = spec.shape
    layer = _layer_of(spec.name)
    if spec.kind == "linear":
        fan_in = int(np.prod(shape[1:]))
        x = rng.standard_normal(shape) * (_gain(spec.name) / np.sqrt(fan_in))
    elif spec.kind == "norm":
        x = 1.0 + 0.05 * layer / 8 + 0.08 * rng.standard_normal(shape)
    elif spec.kind == "embed":
        x = 0.5 * rng.standard_normal(shape)
    elif spec.kind == "lm_head":
        # Row v is mostly the embedding of token perm[v]: the last token's embedding, which AttnRes
        # carries to the output, makes one next token stand out, as a trained model's logits do
        # (a flat random softmax would make top-1 a coin toss between near-equal logits).
        embed = 0.5 * _rng(seed, spec.name.replace("lm_head", "model.embed_tokens")).standard_normal(shape)
        x = 2.0 * embed[rng.permutation(shape[0])] + 0.1 * rng.standard_normal(shape)
    elif spec.kind == "res_proj":  # small: AttnRes scores of order one, as in a trained model
        x = 0.02 * rng.standard_normal(shape)
    elif spec.kind == "conv":
        x = rng.standard_normal(shape) * 0.4
    elif spec.kind == "a_log":
        x = np.log(rng.uniform(1.0, 16.0, size=shape))
    elif spec.kind == "dt_bias":
        x = rng.normal(-1.0, 0.5, size=shape)
    elif spec.kind == "router_bias":
        # Spaced wider than sigmoid's range: each layer's experts have a fixed preference order, so
        # which experts a token gets never hangs on a near-tie (a tie would make two correct
        # implementations differ by rounding alone); the routing weights still follow the token.
        x = 2.0 * rng.permutation(shape[0]) + rng.normal(0.0, 0.02, size=shape)
    elif spec.kind == "bias":
        x = rng.normal(0.0, 0.02, size=shape)
    elif spec.kind in ("patch", "pos"):
        x = rng.standard_normal(shape) * 0.02
    else:  # pragma: no cover - a layout bug
        raise ValueError(f"unknown tensor kind {spec.kind!r} for {spec.name}")
    x = x.astype(np.float32)
    if spec.dtype == "BF16":
        return f32_to_bf16_bits(x)
    return x.astype(NUMPY_DTYPE[spec.dtype])


# --- tokenizer files ---------------------------------------------------------------------------

SPECIAL_NAMES = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "<|im_system|>",
    7: "<|im_user|>",
    8: "<|im_assistant|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}


def special_tokens(first_id: int) -> dict[int, str]:
    """The 256 special tokens at the top of the vocabulary, by id."""
    return {first_id + k: SPECIAL_NAMES.get(k, f"<|reserved_token_{k}|>") for k in range(N_SPECIAL)}


def extend_vocab(vocab: list[bytes], n_ranks: int, seed: int) -> list[bytes]:
    """Grow a BPE vocabulary to n_ranks by merging random pairs of existing tokens.

    Every new token is the concatenation of two earlier ones, so the vocabulary stays a valid BPE
    vocabulary of the real size (for the full preset and the tokenizer benchmark).
    """
    rng = np.random.default_rng(seed)
    out, seen = list(vocab), set(vocab)
    base = len(vocab)
    while len(out) < n_ranks:
        for a, b in zip(
            rng.integers(0, len(out), size=8192).tolist(), rng.integers(0, base, size=8192).tolist()
        ):
            tok = out[a] + out[b]
            if len(tok) <= 16 and tok not in seen:
                seen.add(tok)
                out.append(tok)
                if len(out) == n_ranks:
                    break
    return out


def write_tokenizer_files(out: Path, cfg: K3Config, seed: int) -> None:
    n_ranks = cfg.n_vocab - N_SPECIAL
    vocab = [base64.b64decode(line.split()[0]) for line in bpe.shipped_tiktoken().splitlines()]
    if n_ranks > len(vocab):
        vocab = extend_vocab(vocab, n_ranks, seed)
    (out / "tiktoken.model").write_text(bpe.format_tiktoken(vocab[:n_ranks]), encoding="ascii")
    specials = special_tokens(n_ranks)
    tok_cfg = {
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, s in specials.items()
        },
        "bos_token": specials[n_ranks],
        "eos_token": specials[n_ranks + 1],
        "pad_token": specials[n_ranks + 255],
        "unk_token": specials[n_ranks + 254],
        "model_max_length": cfg["max_position_embeddings"],
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")


# --- checkpoint -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SynthResult:
    out: Path
    preset: str
    n_shards: int
    n_tensors: int
    data_bytes: int  # logical size of all tensor data
    disk_bytes: int  # real blocks used (sparse for the full preset)
    layout: str = "moonshot"
    files: tuple[str, ...] = ()


def _disk_usage(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


LAYOUTS = ("moonshot", "one-file", "by-size:BYTES")


def parse_layout(layout: str) -> tuple[str, int]:
    """``moonshot``, ``one-file`` or ``by-size:BYTES`` (``by-size:5000000000``: transformers'
    default shard size, 5 GB); the size is 0 for the first two."""
    if layout in ("moonshot", "one-file"):
        return layout, 0
    kind, _, size = layout.partition(":")
    if kind == "by-size" and size.isascii() and size.isdigit() and 0 < int(size) <= 10**15:
        return kind, int(size)
    raise K3LabError(
        f"--layout {layout!r}: give moonshot, one-file or by-size:BYTES (e.g. by-size:5000000000)"
    )


def file_groups(cfg: K3Config, layout: str) -> list[tuple[str, list[TensorSpec]]]:
    """The checkpoint's files and the tensors each holds, in data order, as the layout writes them:
    Moonshot's (a layer per shard, six-digit counts), transformers' ``save_pretrained`` whole (one
    ``model.safetensors``), or in size-based shards (module order, a new shard when the next tensor
    would pass the size; a tensor larger than it alone), each file's data in the safetensors
    library's order (by dtype size, then name): so a layer spreads over files, as it does in a re-save."""
    kind, size = parse_layout(layout)
    if kind == "moonshot":
        shards = checkpoint_layout(cfg)
        return [(shard_filename(k, len(shards), moonshot=True), specs) for k, specs in enumerate(shards, 1)]
    order = save_order(cfg)
    if kind == "one-file":
        return [(SINGLE_NAME, _safetensors_order(order))]
    groups: list[list[TensorSpec]] = []
    used = 0
    for spec in order:
        n = int(np.prod(spec.shape)) * DTYPE_SIZE[spec.dtype]
        if not groups or (used + n > size and groups[-1]):
            groups.append([])
            used = 0
        groups[-1].append(spec)
        used += n
    return [(shard_filename(k, len(groups)), _safetensors_order(g)) for k, g in enumerate(groups, 1)]


def _safetensors_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The data order the safetensors library writes a file in: larger dtypes first, then by name."""
    return sorted(specs, key=lambda s: (-DTYPE_SIZE[s.dtype], s.name))


def synthesize(
    preset: str,
    out: str | os.PathLike,
    seed: int = 0,
    experts: int | None = None,
    draw: str = "trained",
    layout: str | None = None,
) -> SynthResult:
    """Write the `preset` checkpoint to `out`, values drawn as `draw` says, its files as ``layout``
    says (``LAYOUTS``; default: the preset's, ``PRESET_LAYOUT``). The `full` preset writes headers and
    leaves data as holes."""
    layout = layout or PRESET_LAYOUT.get(preset, "moonshot")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if draw not in DRAWS:
        raise ValueError(f"unknown draw {draw!r}; choose from {', '.join(DRAWS)}")
    raw = PRESETS[preset]()
    if experts:
        t = raw["text_config"]
        t["num_experts"] = experts
        t["num_experts_per_token"] = min(t["num_experts_per_token"], experts)
    cfg = K3Config.from_dict(raw)
    groups = file_groups(cfg, layout)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    sparse = preset == "full"
    weight_map: dict[str, str] = {}
    total = 0
    for fname, specs in groups:
        entries = [(s.name, s.dtype, s.shape) for s in specs]
        header = build_header(entries)
        size = data_size(entries)
        with open(out / fname, "wb") as fh:
            fh.write(header)
            if sparse:
                fh.truncate(len(header) + size)
            else:
                for spec in specs:
                    fh.write(np.ascontiguousarray(tensor_values(spec, seed, draw)).tobytes())
        weight_map.update({s.name: fname for s in specs})
        total += size
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    write_tokenizer_files(out, cfg, seed)
    if cfg.vision:
        pre = preprocessor_config(cfg.vision)
        (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n", encoding="utf-8")
    files = tuple(f for f, _ in groups)
    return SynthResult(out, preset, len(groups), len(weight_map), total, _disk_usage(out), layout, files)
