"""Looking inside: the data behind the notebooks, as plain functions returning plain values.

Every function reads a checkpoint (or a converted set) and returns rows, arrays or dicts; the
plots live in ``plots.py`` and the story in ``notebooks/``. The rule table decides what each
source tensor becomes, so a row here and a line of TENSOR_MAP.md always agree.
"""

from __future__ import annotations

import html
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats import mxfp4
from k3lab.formats.numerics import bf16_bits_to_f32
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.model import MODEL
from k3lab.kimi_k3.rules import expert_of, expert_tensor, vision_block_prefix
from k3lab.kimi_k3.tokenizer import build_vocabulary, read_tiktoken
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import Source, SourceSpec
from k3lab.pipeline.writing.folder import OutputFolder
from k3lab.pipeline.writing.single import plan_single

OUTLIER_LOW, OUTLIER_HIGH = 0, 250  # E8M0 bytes worth a look: an all-zero block, or ~2**123
HOME_ENV = "K3LAB_HOME"  # set by `k3lab lab`: where the notebooks' relative paths start


def home() -> Path:
    """Where a notebook's relative paths (``k3-demo/src``) start, whatever the kernel's working
    folder: $K3LAB_HOME (`k3lab lab` sets it), else the repository this k3lab is installed from, else
    the working folder."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parent.parent
    return repo if (repo / "notebooks").is_dir() and (repo / "pyproject.toml").is_file() else Path.cwd()


def resolve(path: str | Path) -> Path:
    """A notebook parameter as a path: absolute as given, relative from ``home()``."""
    path = Path(path)
    return path if path.is_absolute() else home() / path


def save_result(result: dict[str, Any], path: str | Path | None) -> None:
    """What a notebook computed, for tests and batch runs, into a file (never printed on the page)."""
    if path:
        Path(path).write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")


def source_spec(
    meta: str | Path, src: str | Path | None = None, repo: str | None = None, revision: str | None = None
) -> SourceSpec:
    """The checkpoint, as the command line names it: a local folder (``src``, default ``meta``) or a
    Hub repo (``repo`` at ``revision``; ``HF_TOKEN`` and ``HF_ENDPOINT`` from the environment)."""
    if repo is None:
        return SourceSpec.local(meta, src)
    from k3lab.pipeline.sources.hub import hub_spec

    return hub_spec(
        meta,
        repo,
        revision,
        endpoint=os.environ.get("HF_ENDPOINT"),
        token=os.environ.get("HF_TOKEN"),
        meta_files=MODEL.meta_files,
        optional_meta=MODEL.optional_meta,
    )


def _spec(meta: str | Path, src: str | Path | SourceSpec | None) -> SourceSpec:
    return src if isinstance(src, SourceSpec) else source_spec(meta, src)


def open_conversion(
    meta: str | Path, src: str | Path | SourceSpec, out_dir: str | Path
) -> tuple[Plan, Source]:
    """The saved plan of converting the checkpoint (a folder, or any ``SourceSpec``) into
    ``out_dir`` (made and saved now when missing or stale, as ``k3lab convert`` would) and the source
    it reads."""
    from k3lab.pipeline.running.runner import prepare

    spec = _spec(meta, src)
    source = open_source(spec, fresh=True)
    source.fetch_meta()
    return prepare(MODEL, spec, out_dir)[0], source


def convert(
    meta: str | Path,
    src: str | Path | SourceSpec,
    out_dir: str | Path,
    shards: list[int] | None = None,
    force: bool = False,
    run_token: str | None = None,
    progress: bool = False,
) -> list[Any]:
    """Convert output files ``shards`` (default: all) exactly as ``k3lab convert`` does (as part of
    the run holding ``run_token`` when `k3lab batch` runs this), with a progress bar if asked."""
    from k3lab.pipeline.running.runner import RunOptions, convert_shards

    quiet = None if progress else True  # None: a bar even where the output is no terminal (a notebook)
    return convert_shards(
        MODEL,
        _spec(meta, src),
        out_dir,
        shards,
        quiet=quiet,
        options=RunOptions(force=force),
        run_token=run_token,
    )


def open_checkpoint(src: str | Path | SourceSpec, meta: str | Path | None = None) -> tuple[K3Config, Source]:
    """The config and the source of a checkpoint (a folder, or any ``SourceSpec``)."""
    spec = src if isinstance(src, SourceSpec) else source_spec(meta or src, src)
    source = open_source(spec, fresh=True)
    source.fetch_meta()
    return K3Config.load(spec.meta_dir), source


def planned_by_source(plan: Plan) -> dict[str, list[tuple[Any, Any]]]:
    """Source tensor -> every (file, output tensor) it feeds: ``kv_b_proj`` feeds both ``attn_k_b``
    and ``attn_v_b``, and a row must show both."""
    out: dict[str, list[tuple[Any, Any]]] = {}
    for f in plan.files:
        for t in f.tensors:
            for s in t.sources:
                out.setdefault(s, []).append((f, t))
    return out


def shard_rows(plan: Plan, source: Source, shard: int, by_source: dict | None = None) -> list[dict[str, Any]]:
    """One row per tensor of source shard ``shard`` (1-based): where it is, and what it becomes. Reads
    that shard's header only (the plan is made once: ``open_conversion``)."""
    files = source.files()
    fname = files[shard - 1]
    entries = sorted(source.header(fname).values(), key=lambda e: e.start)
    mapped = by_source if by_source is not None else planned_by_source(plan)
    if not mapped.keys() & {e.name for e in entries}:
        try:
            mapped = {s: [(None, t)] for t in plan_single(MODEL, plan.cfg, source) for s in t.sources}
        except K3LabError:  # not a vision shard either
            mapped = {}
    rows = []
    for e in entries:
        targets = mapped.get(e.name, [])
        rows.append(
            {
                "tensor": e.name,
                "dtype": e.dtype,
                "shape": e.shape,
                "offset": e.start,
                "bytes": e.nbytes,
                "gguf": " + ".join(t.name for _, t in targets),
                "gguf type": " + ".join(t.info.type.name for _, t in targets),
                "gguf ne": " + ".join(str(list(t.info.ne)) for _, t in targets),
                "transform": " + ".join(t.transform for _, t in targets),
                "file": targets[0][0].filename
                if targets and targets[0][0]
                else ("mmproj" if targets else ""),
            }
        )
    return rows


def _expert_names(source: Source, layer: int, proj: str, part: str = "weight_scale") -> list[tuple[int, str]]:
    found = ((expert_of(n, layer, proj, part), n) for n in source.weight_map)
    return sorted((e, n) for e, n in found if e is not None)


@dataclass
class ScaleStats:
    """One projection of one MoE layer, every expert: how often each scale byte occurs, the mean
    exponent per expert and block column, and the outlier blocks (byte 0, or >= 250)."""

    layer: int
    proj: str
    counts: np.ndarray  # int64 [256]: blocks per scale byte
    means: np.ndarray  # float32 [n_expert, blocks per row]: mean exponent over rows
    outliers: list[dict[str, int]]

    def summary(self) -> dict[str, Any]:
        byte = np.arange(256)
        valid = self.counts.copy()
        valid[255] = 0  # E8M0's NaN, not a scale
        n = int(valid.sum())
        mean = float((valid * byte).sum() / max(n, 1))
        std = float(np.sqrt((valid * (byte - mean) ** 2).sum() / max(n, 1)))
        present = np.nonzero(valid)[0]
        return {
            "layer": self.layer,
            "proj": PROJ_NAMES.get(self.proj, self.proj),
            "mean exponent": round(mean - 127, 2),
            "std": round(std, 2),
            "min exponent": int(present.min()) - 127 if present.size else None,
            "max exponent": int(present.max()) - 127 if present.size else None,
            "blocks": n,
        }


PROJ_NAMES = {"w1": "gate (w1)", "w2": "down (w2)", "w3": "up (w3)"}


def scale_stats(source: Source, layer: int, proj: str, outlier_limit: int = 50) -> ScaleStats:
    """Streams the experts one at a time (memory: one expert's scales), counting with bincount on
    the uint8 bytes as they are: no copy of a whole stack, no float64 of it."""
    counts = np.zeros(256, dtype=np.int64)
    rows_means: list[np.ndarray] = []
    outliers: list[dict[str, int]] = []
    for e, name in _expert_names(source, layer, proj):
        sc = np.asarray(source.array(name))
        counts += np.bincount(sc.ravel(), minlength=256)
        rows_means.append(sc.mean(axis=0, dtype=np.float32) - 127)
        if len(outliers) < outlier_limit:
            for r, b in zip(*np.nonzero((sc == OUTLIER_LOW) | (sc >= OUTLIER_HIGH))):
                outliers.append(
                    {
                        "layer": layer,
                        "proj": proj,
                        "expert": e,
                        "row": int(r),
                        "block": int(b),
                        "byte": int(sc[r, b]),
                    }
                )
                if len(outliers) >= outlier_limit:
                    break
    means = np.stack(rows_means) if rows_means else np.zeros((0, 0), np.float32)
    return ScaleStats(layer, proj, counts, means, outliers)


def expert_codes(source: Source, layer: int, proj: str, expert: int = 0) -> np.ndarray:
    """The FP4 codes (0..15) of one expert matrix."""
    name = expert_tensor(layer, expert, proj, "weight_packed")
    return mxfp4.unpack_codes(np.asarray(source.array(name)))


def first_block(
    source: Source, layer: int, proj: str, expert: int = 0, row: int = 0, block: int = 0
) -> dict[str, Any]:
    """One 32-value block before and after the repack: the 16 + 1 source bytes and the 17 ggml bytes."""
    base = expert_tensor(layer, expert, proj, "")
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


def weight_stats(source: Source, names: list[str]) -> list[dict[str, Any]]:
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


def vision_blocks(cfg: K3Config, source: Source) -> list[dict[str, Any]]:
    """The MoonViT tower block by block: parameter count and weight spread of each block."""
    rows = []
    for i in range(int(cfg.vision["vt_num_hidden_layers"])):
        names = sorted(n for n in source.weight_map if n.startswith(vision_block_prefix(i)))
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
    """Per output file of a converted set: status, tensors, bytes, types and the source shard; files the
    saved plan has but the manifest does not are listed as not converted."""
    folder = OutputFolder(out_dir)
    rows = []
    for rec in folder.read_manifest().records:
        types = Counter(t.type for t in rec.tensors)
        sources = sorted({src.file for t in rec.tensors for src in t.sources})
        on_disk = folder.output(rec.file).exists()
        rows.append(
            {
                "file": rec.file,
                "kind": rec.kind,
                "status": "converted" if on_disk else "missing",
                "tensors": len(rec.tensors),
                "bytes": rec.size,
                "types": ", ".join(f"{k} {v}" for k, v in sorted(types.items())),
                "from": ", ".join(sources[:2]) + (f" (+{len(sources) - 2})" if len(sources) > 2 else ""),
            }
        )
    plan = folder.load_plan(MODEL)
    if plan is None:
        return rows
    listed = {r["file"] for r in rows}
    for f in plan.files:
        if f.filename not in listed:
            types = Counter(t.info.type.name for t in f.tensors)
            rows.append(
                {
                    "file": f.filename,
                    "kind": "text",
                    "status": "not converted",
                    "tensors": len(f.tensors),
                    "bytes": f.nbytes,
                    "types": ", ".join(f"{k} {v}" for k, v in sorted(types.items())),
                    "from": f.source_file,
                }
            )
    return sorted(rows, key=lambda r: (r["kind"] != "text", r["file"]))


def _cell(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in v.items())
    return html.escape(str(v))


def html_table(rows: list[dict[str, Any]], max_height: int = 420) -> str:
    """Rows as an HTML table for a notebook (no pandas needed): numbers readable (thousands
    separators, 4 significant digits), every row there, in a box that scrolls both ways instead of
    running off the page."""
    if not rows:
        return "<p><i>(no rows)</i></p>"
    cols = list(rows[0])
    head = "".join(
        f"<th style='position:sticky;top:0;background:var(--jp-layout-color1,#fff)'>{c}</th>" for c in cols
    )
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return (
        f"<div style='max-height:{max_height}px;overflow:auto;max-width:100%'>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        f"<p style='font-size:smaller'>{len(rows):,} rows</p>"
    )
