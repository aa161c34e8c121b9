"""Looking inside: the data behind the notebooks, as plain functions returning plain values.

Every function reads a checkpoint (or a converted set) and returns rows, arrays or dicts; the
plots live in ``plots.py`` and the story in ``notebooks/``. The rule table decides what each
source tensor becomes, so a row here and a line of TENSOR_MAP.md always agree.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.formats import mxfp4
from k3lab.formats.manifest import MANIFEST_NAME
from k3lab.formats.numerics import bf16_bits_to_f32
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.tokenizer import build_vocabulary, read_tiktoken
from k3lab.pipeline.plan import Plan, build_plan
from k3lab.pipeline.sources import LocalSource, SourceSpec
from k3lab.pipeline.vision import plan_vision

OUTLIER_LOW, OUTLIER_HIGH = 0, 250  # E8M0 bytes worth a look: an all-zero block, or ~2**123


def open_conversion(meta: str | Path, src: str | Path, out_dir: str | Path) -> tuple[Plan, LocalSource]:
    """The saved plan of converting ``src`` into ``out_dir`` (made and saved now when missing or
    stale, as ``k3lab convert`` would) and the source it reads."""
    from k3lab.pipeline.runner import prepare

    spec = SourceSpec(str(meta), src_dir=str(src))
    return prepare(spec, out_dir)[0], spec.open_fresh()  # type: ignore[return-value]


def convert(
    meta: str | Path,
    src: str | Path,
    out_dir: str | Path,
    shards: list[int] | None = None,
    force: bool = False,
    run_token: str | None = None,
) -> list[Any]:
    """Convert output files ``shards`` (default: all) exactly as ``k3lab convert`` does (as part of
    the run holding ``run_token`` when `k3lab batch` runs this)."""
    from k3lab.pipeline.runner import RunOptions, convert_shards

    spec = SourceSpec(str(meta), src_dir=str(src))
    return convert_shards(
        spec, out_dir, shards, quiet=True, options=RunOptions(force=force), run_token=run_token
    )


def open_checkpoint(src: str | Path, meta: str | Path | None = None) -> tuple[K3Config, LocalSource]:
    meta = meta or src
    return K3Config.load(meta), LocalSource(src, meta)


def _planned_by_source(plan: Plan) -> dict[str, Any]:
    out = {}
    for f in plan.files:
        for t in f.tensors:
            for s in t.sources:
                out[s] = (f, t)
    return out


def shard_rows(cfg: K3Config, source: LocalSource, shard: int) -> list[dict[str, Any]]:
    """One row per tensor of source shard ``shard`` (1-based): where it is, and what it becomes."""
    files = source.files()
    fname = files[shard - 1]
    entries = sorted(source.header(fname).values(), key=lambda e: e.start)
    mapped = _planned_by_source(build_plan(cfg, source))
    if not mapped.keys() & {e.name for e in entries}:
        try:
            mapped = {s: (None, t) for t in plan_vision(cfg, source) for s in t.sources}
        except Exception:  # not a vision shard either
            mapped = {}
    rows = []
    for e in entries:
        f, t = mapped.get(e.name, (None, None))
        rows.append(
            {
                "tensor": e.name,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "offset": e.start,
                "bytes": e.nbytes,
                "gguf": t.name if t else "",
                "gguf type": t.info.type.name if t else "",
                "gguf ne": list(t.info.ne) if t else [],
                "transform": t.transform if t else "",
                "file": f.filename if f else ("mmproj" if t else ""),
            }
        )
    return rows


def layer_of(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def expert_scales(source: LocalSource, layer: int, proj: str) -> np.ndarray:
    """E8M0 scale bytes of every routed expert of one projection: uint8 [n_expert, rows, blocks]."""
    pat = re.compile(
        rf"language_model\.model\.layers\.{layer}\.block_sparse_moe\.experts\.(\d+)\.{proj}\.weight_scale$"
    )
    names = sorted((int(m.group(1)), n) for n in source.weight_map if (m := pat.match(n)))
    return np.stack([np.asarray(source.array(n)) for _, n in names])


def expert_codes(source: LocalSource, layer: int, proj: str, expert: int = 0) -> np.ndarray:
    """The FP4 codes (0..15) of one expert matrix."""
    name = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight_packed"
    return mxfp4.unpack_codes(np.asarray(source.array(name)))


def scale_summary(source: LocalSource, cfg: K3Config) -> list[dict[str, Any]]:
    """Per MoE layer and projection: mean, spread and extremes of the E8M0 exponents."""
    rows = []
    for layer in range(cfg.n_layer):
        if not cfg.is_moe(layer):
            continue
        for proj in ("w1", "w2", "w3"):
            s = expert_scales(source, layer, proj).astype(np.int32)
            rows.append(
                {
                    "layer": layer,
                    "proj": proj,
                    "mean exponent": float(s.mean() - 127),
                    "std": float(s.std()),
                    "min byte": int(s.min()),
                    "max byte": int(s.max()),
                    "blocks": int(s.size),
                }
            )
    return rows


def scale_outliers(source: LocalSource, cfg: K3Config, limit: int = 50) -> list[dict[str, Any]]:
    """Blocks whose scale byte is 0 (an all-zero block) or >= 250 (a value near 2**123)."""
    out = []
    for layer in range(cfg.n_layer):
        if not cfg.is_moe(layer):
            continue
        for proj in ("w1", "w2", "w3"):
            s = expert_scales(source, layer, proj)
            for e, r, b in zip(*np.nonzero((s == OUTLIER_LOW) | (s >= OUTLIER_HIGH))):
                out.append(
                    {
                        "layer": layer,
                        "proj": proj,
                        "expert": int(e),
                        "row": int(r),
                        "block": int(b),
                        "byte": int(s[e, r, b]),
                    }
                )
                if len(out) >= limit:
                    return out
    return out


def first_block(
    source: LocalSource, layer: int, proj: str, expert: int = 0, row: int = 0, block: int = 0
) -> dict[str, Any]:
    """One 32-value block before and after the repack: the 16 + 1 source bytes and the 17 ggml bytes."""
    base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}."
    packed = np.asarray(source.array(base + "weight_packed"))[row : row + 1, block * 16 : block * 16 + 16]
    scale = np.asarray(source.array(base + "weight_scale"))[row : row + 1, block : block + 1]
    ggml = mxfp4.repack(packed, scale)
    return {
        "tensor": base + "weight_packed",
        "row": row,
        "block": block,
        "scale byte": int(scale[0, 0]),
        "source bytes": packed[0].tobytes().hex(" "),
        "ggml bytes": ggml[0].tobytes().hex(" "),
        "codes": mxfp4.unpack_codes(packed)[0].tolist(),
        "values": mxfp4.decode_compressed_tensors(packed, scale)[0].tolist(),
        "values from ggml bytes": mxfp4.decode_ggml(ggml, 32)[0].tolist(),
    }


def weight_stats(source: LocalSource, names: list[str]) -> list[dict[str, Any]]:
    """mean, std and max |x| of float tensors (BF16 widened exactly)."""
    rows = []
    for n in names:
        e = source.entry(n)
        a = np.asarray(source.array(n))
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


def vision_blocks(cfg: K3Config, source: LocalSource) -> list[dict[str, Any]]:
    """The MoonViT tower block by block: parameter count and weight spread of each block."""
    rows = []
    for i in range(int(cfg.vision["vt_num_hidden_layers"])):
        names = sorted(n for n in source.weight_map if n.startswith(f"vision_tower.encoder.blocks.{i}."))
        stats = weight_stats(source, names)
        rows.append(
            {
                "block": i,
                "tensors": len(names),
                "parameters": int(sum(np.prod(s["shape"]) for s in stats)),
                **{s["tensor"].rsplit(".", 2)[-2]: round(s["std"], 5) for s in stats},
            }
        )
    return rows


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


def manifest_summary(out_dir: str | Path) -> list[dict[str, Any]]:
    """Per output file of a converted set: tensors, bytes, types, and where the tensors came from."""
    man = json.loads((Path(out_dir) / MANIFEST_NAME).read_text())
    rows = []
    for rec in man["files"]:
        types = Counter(t["type"] for t in rec["tensors"])
        sources = {s["file"] for t in rec["tensors"] for s in t["sources"]}
        rows.append(
            {
                "file": rec["file"],
                "kind": rec.get("kind", "text"),
                "tensors": len(rec["tensors"]),
                "bytes": rec["size"],
                "types": dict(sorted(types.items())),
                "from": sorted(sources),
                "on disk": (Path(out_dir) / rec["file"]).exists(),
            }
        )
    return rows


def html_table(rows: list[dict[str, Any]], max_rows: int = 60) -> str:
    """Rows as an HTML table for a notebook (no pandas needed)."""
    if not rows:
        return "<p><i>(no rows)</i></p>"
    cols = list(rows[0])
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{r.get(c, '')}</td>" for c in cols) + "</tr>" for r in rows[:max_rows]
    )
    more = f"<p><i>{len(rows) - max_rows} more rows</i></p>" if len(rows) > max_rows else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"
