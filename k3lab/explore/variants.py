"""What a variant does to the model (notebook 06, and the tests' figures): each variant's size and bits
per weight, the types its recipe chose layer by layer, the error of every quantised tensor against
the lossless one (per expert for a stack: each dequantised by gguf-py, a judge k3lab did not write),
the whole model's size per variant forecast from a plan (the real model's, from its headers), and
where llama.cpp runs the model, the KL divergence of each variant's next-token distribution from the
lossless set's."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError


def open_variants(
    meta: str | Path,
    src: str | Path | None,
    out_dir: str | Path,
    types: list[str],
    imatrix: str | None = None,
    repo: str | None = None,
    revision: str | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """The plan of converting the checkpoint into ``out_dir`` (as ``k3lab convert`` would use it;
    nothing written), the source, and each of ``types`` (types or recipes) planned over it as
    ``k3lab quantize --dry-run`` plans it (by label): for the real model, from its headers alone.
    ``imatrix`` None: the set's own (``set_imatrix``)."""
    from k3lab.explore.opening import _request
    from k3lab.pipeline.quantizing.start import plan_variants
    from k3lab.pipeline.running.start import prepare
    from k3lab.pipeline.state import OutputFolder
    from k3lab.request import opened
    from k3lab.variants import VariantRequest

    req = _request(meta, src, repo, revision, out_dir=str(out_dir))
    options, _ = req.run_options()
    spec = req.output_source()
    source = opened(req, spec)
    plan, kvs = prepare(req.load_model(), spec, str(out_dir), options, source=source)
    kvs = kvs if kvs is not None else OutputFolder(out_dir).plans.kvs(plan)
    asked = VariantRequest(
        ",".join(types), imatrix=set_imatrix(out_dir, imatrix) if repo is None else imatrix
    ).build()
    return plan, source, {vp.label: vp for vp in plan_variants(plan, kvs, asked, forecast=True)}


def set_imatrix(out_dir: str | Path, imatrix: str | None) -> str | None:
    """The imatrix given, else the set's own (``OUT_DIR/imatrix.gguf``, what ``k3lab imatrix`` and the
    demo make), else none."""
    own = Path(out_dir) / "imatrix.gguf"
    return imatrix if imatrix is not None else (str(own) if own.is_file() else None)


def make_variants(out_dir: str | Path, types: list[str], imatrix: str | None = None) -> list[Any]:
    """The variants of the finished set in ``out_dir``, made as ``k3lab quantize`` makes them (with
    ``imatrix``, else the set's own): a label holding a variant made as another request is refused."""
    from k3lab.request import Request
    from k3lab.variants import VariantRequest, quantize

    asked = VariantRequest(",".join(types), imatrix=set_imatrix(out_dir, imatrix))
    return quantize(Request(out_dir=str(out_dir), quiet=True), asked)


def variant_plans(set_dir: str | Path) -> dict[str, Any]:
    """Every variant of the set in ``set_dir`` that has a plan, by label."""
    from k3lab.pipeline.state import OutputFolder

    folder = OutputFolder(set_dir)
    found = {}
    for sub in sorted(p for p in Path(set_dir).iterdir() if p.is_dir() and not p.name.startswith(".")):
        vp = folder.variant(sub.name).variant_plan.load()
        if vp is not None:
            found[sub.name] = vp
    return found


def sizes(plans: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per variant: files, bytes, bits per weight over every weight, and how it was made."""
    rows = []
    for label, vp in plans.items():
        weights = sum(math.prod(t.ne) for f in vp.files for t in f.tensors)
        rows.append(
            {
                "variant": label,
                "files": len(vp.files),
                "bytes": vp.nbytes,
                "bits per weight": round(8 * vp.nbytes / max(weights, 1), 3),
                "made as": vp.command(),
            }
        )
    return rows


def forecast(
    set_dir: str | Path, types: list[str], imatrix: str | None = None, model: str = "kimi-k3"
) -> list[dict]:
    """The size of the whole set per variant, from its saved plan alone (nothing is read of its files:
    ``k3lab plan --out-dir`` of the real model's headers is enough)."""
    from k3lab.pipeline.quantizing.start import plan_variants
    from k3lab.pipeline.state import OutputFolder
    from k3lab.request import Request
    from k3lab.variants import VariantRequest

    folder = OutputFolder(set_dir)
    plan = folder.plans.require(Request(model=model).load_model())
    variants = VariantRequest(",".join(types), imatrix=imatrix).build()
    return sizes({vp.label: vp for vp in plan_variants(plan, folder.plans.kvs(plan), variants)})


_LAYER = re.compile(r"blk\.(\d+)\.(.+)\.weight")


def choices(plan: Any) -> dict[str, dict[int, str]]:
    """The type each tensor kind has in each layer (``attn_q``: {0: "Q4_K", ...}): a recipe drawn."""
    out: dict[str, dict[int, str]] = {}
    for f in plan.files:
        for t in f.tensors:
            m = _LAYER.fullmatch(t.name)
            if m and t.quantized:
                out.setdefault(m[2], {})[int(m[1])] = t.type
    return out


@dataclass
class TensorError:
    name: str
    source_type: str
    type: str
    bits: float  # bits per weight of the variant's tensor
    rel_rmse: float  # sqrt(sum (q - x)^2 / sum x^2) over the whole tensor
    per_expert: list[float]  # the same, expert by expert (a stack)


def tensor_errors(set_dir: str | Path, label: str, pattern: str = "") -> list[TensorError]:
    """Each quantised tensor whose name matches ``pattern`` (a regex searched; all when empty) against
    the lossless one: both dequantised by gguf-py, read from the files at the offsets their records
    give (one tensor in memory at a time)."""
    from k3lab.pipeline.state import OutputFolder

    folder = OutputFolder(set_dir)
    vp = folder.variant(label).variant_plan.load()
    if vp is None:
        raise K3LabError(f"{Path(set_dir) / label}: no variant here (k3lab quantize makes one)")
    wanted = re.compile(pattern) if pattern else None
    out = []
    for f in vp.files:
        chosen = [t for t in f.tensors if t.quantized and (wanted is None or wanted.search(t.name))]
        if not chosen:
            continue
        src = {
            t.name: t for t in (folder.records.text(f.source_number) or _missing(set_dir, f.source)).tensors
        }
        var_rec = folder.variant(label).records.text(f.number) or _missing(set_dir, f"{label}/{f.filename}")
        mine = {t.name: t for t in var_rec.tensors}
        for t in chosen:
            x = _dequantised(folder.output(f.source), src[t.name])
            q = _dequantised(folder.variant(label).output(f.filename), mine[t.name])
            per = [_rel(q[e], x[e]) for e in range(x.shape[0])] if x.ndim == 3 else []
            out.append(
                TensorError(t.name, t.source_type, t.type, 8 * t.nbytes / math.prod(t.ne), _rel(q, x), per)
            )
    return out


def _missing(set_dir: str | Path, name: str) -> Any:
    raise K3LabError(f"{Path(set_dir) / name}: no record (not made yet?)")


def _rel(q: np.ndarray, x: np.ndarray) -> float:
    den = float(np.sum(np.square(x, dtype=np.float64)))
    return float(np.sqrt(np.sum(np.square(q.astype(np.float64) - x)) / den)) if den else 0.0


def _dequantised(path: Path, rec: Any) -> np.ndarray:
    """A tensor as float32 (numpy order), its bytes read where the record says, dequantised by gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    with open(path, "rb") as fh:
        fh.seek(rec.offset)
        raw = np.frombuffer(fh.read(rec.nbytes), dtype=np.uint8)
    qtype = GGMLQuantizationType[rec.type]
    shape = tuple(reversed(rec.ne))
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    rows = raw.reshape(-1, raw.size // math.prod(shape[:-1]))
    return dequantize(rows, qtype).astype(np.float32).reshape(shape)


def layer_errors(
    plan: Any,
    source: Any,
    variants: dict[str, Any],
    layer: int,
    experts: tuple[int, ...] = (0, 1),
    max_bytes: int = 64 << 20,
) -> list[dict[str, Any]]:
    """What each variant does to each tensor of ``layer``, from the source alone (no set needed: a
    Hub source reads exactly the bytes shown): the lossless tensor made by the converter's own stream
    (of a stack, only ``experts``; of a larger matrix, its first ``max_bytes`` of rows), quantised by
    ggml as the variant's plan says, dequantised by gguf-py, and compared. A row per tensor and variant."""
    from k3lab.formats.ggml import TYPE_IDS, ggml
    from k3lab.pipeline.writing.convert import tensor_pieces, tensor_reader

    lib = ggml()
    pf = next((f for f in plan.files if layer in f.units), None)
    if pf is None:
        raise K3LabError(f"layer {layer}: not a layer of this model (0..{plan.cfg.n_layer - 1})")
    chosen = {label: {t.name: t for t in vp.file(pf.number).tensors} for label, vp in variants.items()}
    rows = []
    for pt in pf.tensors:
        kinds = {label: c[pt.name] for label, c in chosen.items() if c[pt.name].quantized}
        if not kinds:
            continue
        stack = len(pt.info.ne) > 2
        taken, got = [], 0
        pieces = tensor_pieces(pt, tensor_reader(source, pf, pt))
        for k, piece in enumerate(pieces):  # (a stack: one expert a piece)
            if stack and k in experts:
                taken.append((k, np.ascontiguousarray(piece).view(np.uint8).ravel().copy()))
            if not stack:
                taken.append((0, np.ascontiguousarray(piece).view(np.uint8).ravel().copy()))
                got += taken[-1][1].nbytes
            if (stack and k >= max(experts)) or (not stack and got >= max_bytes):
                break
        pieces.close()  # (nothing more is read)
        n = pt.info.ne[0]
        src_id = TYPE_IDS[pt.info.type.name]
        row = lib.traits(src_id).row_bytes(n)
        for label, vt in kinds.items():
            errs = []
            for e, raw in taken:
                x = np.empty((raw.nbytes // row, n), dtype=np.float32)
                lib.to_float(src_id, raw[: x.shape[0] * row], x)
                q = _roundtrip(lib, vt.type, x, _imatrix_of(variants[label], vt, e))
                errs.append((e, _rel(q, x), x.shape[0]))
            rows.append({
                "tensor": pt.name, "variant": label, "type": vt.type, "bits": round(8 * lib.traits(TYPE_IDS[vt.type]).row_bytes(n) / n, 3),
                "rel_rmse": float(np.mean([r for _, r, _ in errs])),
                "per_expert": {e: r for e, r, _ in errs} if stack else {},
                "rows": f"{errs[0][2]} of {math.prod(pt.info.ne[1:2])}" if not stack else f"experts {list(experts)}",
                "why": vt.why,
            })  # fmt: skip
    return rows


def _imatrix_of(vp: Any, vt: Any, expert: int) -> np.ndarray | None:
    from k3lab.pipeline.quantizing.quantize import imatrix_rows

    rows = imatrix_rows(vp, vt)
    return None if rows is None else rows[expert * vt.ne[0] : (expert + 1) * vt.ne[0]].copy()


def _roundtrip(lib: Any, to: str, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """``x`` quantised by ggml to ``to`` and dequantised by gguf-py (a judge k3lab did not write)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from k3lab.formats.ggml import TYPE_IDS

    tid = TYPE_IDS[to]
    out = np.empty(x.shape[0] * lib.traits(tid).row_bytes(x.shape[1]), dtype=np.uint8)
    lib.quantize(tid, x, out, imatrix)
    return dequantize(out.reshape(x.shape[0], -1), GGMLQuantizationType(tid)).reshape(x.shape)


@dataclass
class Divergence:
    """KL(lossless || variant) of the next-token distributions at each position of a prompt, as
    ``llama-perplexity --kl-divergence`` defines it, and how often both pick the same top token."""

    label: str
    tokens: int
    mean: float
    median: float
    max: float
    same_top: float

    def line(self) -> str:
        return (
            f"{self.label}: KL mean {self.mean:.5f}, median {self.median:.5f}, max {self.max:.5f} over "
            f"{self.tokens} positions; same top token {100 * self.same_top:.1f}%"
        )


def kl_divergence(base: str | Path, variant: str | Path, label: str, prompt: str | None = None) -> Divergence:
    """llama.cpp (llama-cpp-python) runs the lossless set (its first file ``base``) and the variant's
    (``variant``) on the same tokens; per position KL = sum p log(p / q) over the whole vocabulary,
    in float64."""
    from k3lab.kimi_k3.logits import DEFAULT_PROMPT, llama_logits

    tokens, p_logits = llama_logits(base, prompt=prompt or DEFAULT_PROMPT)
    _, q_logits = llama_logits(variant, tokens=tokens)
    lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    same = float(np.mean(p_logits.argmax(-1) == q_logits.argmax(-1)))
    return Divergence(label, len(tokens), float(kl.mean()), float(np.median(kl)), float(kl.max()), same)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
