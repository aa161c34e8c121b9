"""A second architecture, to keep the model interface honest: a two-layer dense model whose feed-forward
is one MXFP4 expert stack, with a transform of its own. It uses only the pipeline and the formats
(nothing of Kimi-K3), and ``write_checkpoint`` makes a checkpoint of it from any seed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from k3lab.errors import K3LabError
from k3lab.formats.files import read_json
from k3lab.formats.gguf_stream import KV
from k3lab.formats.safetensors import build_header
from k3lab.pipeline.model import ALL, OUTPUT, Guide, Model, Rule, TensorSpec
from k3lab.pipeline.streams import GENERIC, Shape, Transform

ARCH = "toy"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ToyConfig:
    raw: dict[str, Any]
    path: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "config.json") -> ToyConfig:
        for key in ("hidden", "layers", "ffn", "experts", "vocab"):
            if not isinstance(raw.get(key), int) or raw[key] < 1:
                raise K3LabError(f"{path}: {key} must be a positive integer")
        return cls(raw, path)

    @classmethod
    def load(cls, meta_dir: str | Path) -> ToyConfig:
        path = Path(meta_dir) / "config.json"
        return cls.from_dict(read_json(path, 1 << 20, "config"), str(path))

    @property
    def n_layer(self) -> int:
        return self.raw["layers"]

    @property
    def n_expert(self) -> int:
        return self.raw["experts"]


def negate(x: np.ndarray, cfg: Any = None) -> np.ndarray:
    """The toy's own transform: its gate is stored negated (values, so it runs on float32)."""
    return -x


def _same(s: Shape, cfg: Any = None) -> Shape:
    return s


TRANSFORMS = GENERIC | {"negate": Transform("negate", negate, _same, "-x", on_values=True, inverse=negate)}

RULES = (
    Rule("token_embd.weight", ("embed.weight",), layers=OUTPUT),
    Rule("output_norm.weight", ("norm.weight",), dtype="f32", layers=OUTPUT),
    Rule("blk.{bid}.attn_norm.weight", ("layers.{bid}.norm.weight",), dtype="f32"),
    Rule("blk.{bid}.attn_qkv.weight", ("layers.{bid}.qkv.weight",)),
    Rule("blk.{bid}.ffn_gate.weight", ("layers.{bid}.gate",), "negate", "f32"),
    Rule(
        "blk.{bid}.ffn_up_exps.weight",
        ("layers.{bid}.experts.{e}.weight_packed", "layers.{bid}.experts.{e}.weight_scale"),
        "mxfp4_stack",
        "mxfp4",
    ),
)


def layout(cfg: ToyConfig, bid: int | None) -> dict[str, TensorSpec]:
    h, ff = cfg.raw["hidden"], cfg.raw["ffn"]
    if bid is None:
        specs = [
            TensorSpec("embed.weight", "BF16", (cfg.raw["vocab"], h)),
            TensorSpec("norm.weight", "F32", (h,)),
        ]
    else:
        p = f"layers.{bid}."
        specs = [
            TensorSpec(p + "norm.weight", "F32", (h,)),
            TensorSpec(p + "qkv.weight", "BF16", (3 * h, h)),
            TensorSpec(p + "gate", "F32", (h,)),
        ]
        for e in range(cfg.n_expert):
            specs += [
                TensorSpec(f"{p}experts.{e}.weight_packed", "U8", (ff, h // 2)),
                TensorSpec(f"{p}experts.{e}.weight_scale", "U8", (ff, h // 32)),
            ]
    return {s.name: s for s in specs}


def unit_of(name: str) -> int | None:
    m = re.match(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def file_kvs(
    cfg: ToyConfig, meta_dir: Path, name: str, file_type: str, template: Any, tensors: Any
) -> list[KV]:
    u32, s = GGUFValueType.UINT32, GGUFValueType.STRING
    return [
        KV("general.architecture", ARCH, s),
        KV("general.name", name, s),
        KV(f"{ARCH}.block_count", cfg.n_layer, u32),
        KV(f"{ARCH}.embedding_length", cfg.raw["hidden"], u32),
        KV(f"{ARCH}.expert_count", cfg.n_expert, u32),
    ]


CARD = """$front_matter

# $basename GGUF ($label): a toy

$n_files files, $total_size, $n_tensors tensors, made by k3lab $version from $provenance:

```bash
$command
```

$files_table

```bash
$download_verify
k3lab verify --model toy_model $local
```
"""

GUIDE = Guide(
    base_model="k3lab-test/Toy",
    card_template=lambda: CARD,
    rules_file="tests/toy_model.py",
    tags={},
    chat_template=lambda meta, flag: (None, "chat template: none (a toy)"),
    demo=lambda folder, seed: write_checkpoint(Path(folder), seed=seed),
)

MODEL = Model(
    name=ARCH,
    module=__name__,
    default_basename="Toy",
    text_prefix="",
    meta_files=("config.json", INDEX),
    optional_meta=(),
    rules=RULES,
    transforms=TRANSFORMS,
    load_config=ToyConfig.load,
    config_from_dict=ToyConfig.from_dict,
    unit_of=unit_of,
    unit_tags=lambda cfg, bid: frozenset({OUTPUT} if bid is None else {ALL}),
    config_tags=lambda cfg: frozenset(),
    layout=layout,
    file_kvs=file_kvs,
    guide=GUIDE,
)


FILE = "toy-weights.safetensors"


def write_checkpoint(out: Path, seed: int = 0, hidden: int = 64, experts: int = 3) -> ToyConfig:
    """A toy checkpoint laid out unlike Kimi-K3's: ONE file holding every layer, the embeddings and
    final norm first, and an index naming it (a name no transformers writes). Values are plain
    random draws (MXFP4 bytes uniformly random, scales around 2^0)."""
    rng = np.random.default_rng(seed)
    cfg = ToyConfig.from_dict({"hidden": hidden, "layers": 2, "ffn": 96, "experts": experts, "vocab": 40})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.raw))
    specs = [s for bid in (None, 0, 1) for s in layout(cfg, bid).values()]
    blobs = []
    for s in specs:
        n = int(np.prod(s.shape))
        if s.dtype == "U8":
            hi = 256 if "packed" in s.name else 1
            blobs.append(
                rng.integers(0, hi, n, dtype=np.uint8)
                + (0 if hi == 256 else 120 + rng.integers(0, 15, n, dtype=np.uint8))
            )
        elif s.dtype == "F32":
            blobs.append(rng.normal(size=n).astype(np.float32))
        else:
            blobs.append((rng.normal(size=n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    header = build_header([(s.name, s.dtype, s.shape) for s in specs])
    (out / FILE).write_bytes(header + b"".join(b.tobytes() for b in blobs))
    (out / INDEX).write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys((s.name for s in specs), FILE)})
    )
    return cfg
