"""The plan: which source tensors feed which output tensor, in which output file, with type,
shape, bytes and transform, from config.json, the index and the safetensors headers alone.

Output file k is made from text source file k (shard k holds layer k-1; the last text shard
holds the embeddings and output tensors), so every output file is an independent unit of work.
Planning checks that every text source tensor is used by a rule and every rule finds its
sources, with the right dtypes and shapes: bad input fails here, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from gguf import GGMLQuantizationType

from .config import K3Config
from .errors import K3LabError
from .gguf_io import TensorInfo
from .rules import RULES, TEXT_PREFIX, Rule, expert_dims
from .safetensors_format import TensorEntry
from .transforms import TRANSFORMS, TransformError

OUTTYPES = ("auto", "bf16", "f16", "f32")
FLOAT_DTYPES = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}
OTHER_PREFIXES = ("vision_tower.", "mm_projector.")  # converted by `k3lab vision`
_LAYER = re.compile(r"^" + re.escape(TEXT_PREFIX) + r"model\.layers\.(\d+)\.")


class PlanError(K3LabError):
    """The checkpoint does not fit the rules (a missing, unused or malformed source tensor)."""


@dataclass(frozen=True)
class PlannedTensor:
    info: TensorInfo
    sources: tuple[str, ...]
    rule: Rule

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def transform(self) -> str:
        return self.rule.transform


@dataclass
class PlannedFile:
    number: int  # 1-based
    filename: str
    source_file: str
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def digest(self) -> str:
        """Identifies what this file will hold (a file from another conversion has another digest)."""
        items = [(t.name, t.info.type.name, t.info.shape, t.sources, t.transform) for t in self.tensors]
        return hashlib.sha256(json.dumps([self.number, self.filename, items]).encode()).hexdigest()


@dataclass
class Plan:
    cfg: K3Config
    outtype: str
    basename: str
    files: list[PlannedFile]
    source_files: dict[str, int]  # source file -> bytes

    @property
    def n_tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    @property
    def label(self) -> str:
        types = {t.info.type for f in self.files for t in f.tensors}
        if GGMLQuantizationType.MXFP4 in types:
            return "MXFP4"
        return self.outtype.upper() if self.outtype != "auto" else _dominant(types)

    @property
    def file_type(self) -> str:
        return "MXFP4_MOE" if self.label == "MXFP4" else self.label

    def file(self, number: int) -> PlannedFile:
        return self.files[number - 1]

    def to_json(self) -> dict[str, Any]:
        return {
            "basename": self.basename,
            "outtype": self.outtype,
            "n_files": len(self.files),
            "n_tensors": self.n_tensors,
            "bytes": sum(f.nbytes for f in self.files),
            "files": [
                {
                    "number": f.number,
                    "filename": f.filename,
                    "source_file": f.source_file,
                    "bytes": f.nbytes,
                    "tensors": [
                        {
                            "name": t.name,
                            "type": t.info.type.name,
                            "ne": list(t.info.ne),
                            "bytes": t.nbytes,
                            "transform": t.transform,
                            "sources": list(t.sources)
                            if len(t.sources) <= 4
                            else [*t.sources[:2], f"... {len(t.sources)} sources"],
                        }
                        for t in f.tensors
                    ],
                }
                for f in self.files
            ],
        }


def _dominant(types: set[GGMLQuantizationType]) -> str:
    for t in (GGMLQuantizationType.BF16, GGMLQuantizationType.F16, GGMLQuantizationType.F32):
        if t in types:
            return t.name
    return "F32"


def output_filename(basename: str, label: str, number: int, count: int) -> str:
    """llama.cpp's split naming: PREFIX-000NN-of-000MM.gguf."""
    return f"{basename}-{label}-{number:05d}-of-{count:05d}.gguf"


def _layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _output_type(rule: Rule, src_dtype: str, outtype: str, where: str) -> GGMLQuantizationType:
    if rule.dtype == "mxfp4":
        return GGMLQuantizationType.MXFP4
    if src_dtype not in FLOAT_DTYPES:
        raise PlanError(f"{where}: is {src_dtype}, expected a float tensor (BF16, F16 or F32)")
    if rule.dtype == "f32":
        return GGMLQuantizationType.F32
    return FLOAT_DTYPES[src_dtype] if outtype == "auto" else FLOAT_DTYPES[outtype.upper()]


def _check_experts(rule: Rule, cfg: K3Config, entries: list[TensorEntry], bid: int) -> None:
    rows, cols = expert_dims(cfg, rule.output)
    if rule.dtype == "mxfp4":
        want = {"weight_packed": ("U8", (rows, cols // 2)), "weight_scale": ("U8", (rows, cols // 32))}
    else:
        want = {"weight": (None, (rows, cols))}
    for e in entries:
        name = e.name
        dtype, shape = want[name.rsplit(".", 1)[1]]
        if (dtype and e.dtype != dtype) or e.shape != shape:
            raise PlanError(
                f"{e.file}: tensor {name}: {e.dtype} {list(e.shape)}, expected {dtype or 'float'} "
                f"{list(shape)} (layer {bid}, {rule.note or rule.output})"
            )


def plan_tensor(
    rule: Rule, cfg: K3Config, source: Any, bid: int | None, outtype: str, where: str
) -> PlannedTensor | None:
    """One rule at one layer (or none): its sources checked, output type and shape decided."""
    if not rule.applies(cfg, bid):
        return None
    names = rule.source_names(cfg, bid)
    missing = [n for n in names if n not in source.weight_map]
    if missing and rule.optional and len(missing) == len(names):
        return None
    if missing:
        raise PlanError(f"{where}: tensor {missing[0]} is missing ({rule.output_name(bid)} needs it)")
    entries = [source.entry(n) for n in names]
    if rule.per_expert:
        _check_experts(rule, cfg, entries, bid)
    try:
        if rule.dtype == "mxfp4":
            rows, cols = expert_dims(cfg, rule.output)
            shape = (cfg.n_expert, rows, cols)
        else:
            shape = TRANSFORMS[rule.transform].shape(*(e.shape for e in entries), cfg=cfg)
    except TransformError as err:
        raise PlanError(f"{entries[0].file}: tensor {entries[0].name}: {err}") from None
    gtype = _output_type(rule, entries[0].dtype, outtype, f"{entries[0].file}: tensor {entries[0].name}")
    return PlannedTensor(TensorInfo(rule.output_name(bid), gtype, shape), tuple(names), rule)


def build_plan(cfg: K3Config, source: Any, outtype: str = "auto", basename: str = "Kimi-K3") -> Plan:
    """Plan the text conversion. ``source`` is a LocalSource or HubSource (index + headers)."""
    if outtype not in OUTTYPES:
        raise PlanError(f"--outtype {outtype!r}: choose from {', '.join(OUTTYPES)}")
    weight_map: dict[str, str] = source.weight_map
    text_names = [n for n in weight_map if n.startswith(TEXT_PREFIX)]
    unknown = [n for n in weight_map if not n.startswith((TEXT_PREFIX, *OTHER_PREFIXES))]
    if unknown:
        raise PlanError(
            f"{weight_map[unknown[0]]}: tensor {unknown[0]} is neither text, vision nor projector"
        )
    by_layer: dict[int | None, list[str]] = {}
    for name in text_names:
        by_layer.setdefault(_layer_of(name), []).append(name)
    bad = sorted(b for b in by_layer if b is not None and not 0 <= b < cfg.n_layer)
    if bad:
        raise PlanError(
            f"{weight_map[by_layer[bad[0]][0]]}: tensor {by_layer[bad[0]][0]} is layer {bad[0]}, "
            f"but the config has {cfg.n_layer} layers"
        )
    units: list[int | None] = [*range(cfg.n_layer), None]  # layers in order, then the output tensors
    used: set[str] = set()
    planned: list[tuple[str, list[PlannedTensor]]] = []
    sizes: dict[str, int] = {}
    for bid in units:
        tensors: list[PlannedTensor] = []
        files: set[str] = set()
        home = {weight_map[n] for n in by_layer.get(bid, [])}
        where = next(iter(home)) if len(home) == 1 else str(source.index_path)
        for rule in RULES:
            pt = plan_tensor(rule, cfg, source, bid, outtype, where)
            if pt is not None:
                tensors.append(pt)
                used.update(pt.sources)
                files.update(weight_map[n] for n in pt.sources)
        if len(files) != 1:
            label = "the output tensors" if bid is None else f"layer {bid}"
            raise PlanError(
                f"{source.index_path}: {label} is spread over {len(files)} files ({', '.join(sorted(files))});"
                " k3lab converts one source shard per output file"
            )
        file = files.pop()
        planned.append((file, tensors))
        sizes[file] = sum(e.nbytes for e in source.header(file).values())
        source.release_header(
            file
        )  # one shard's header in memory at a time (the real ones are ~1 MB of JSON)
    unused = [n for n in text_names if n not in used]
    if unused:
        raise PlanError(
            f"{weight_map[unused[0]]}: tensor {unused[0]} is not used by any rule (k3lab never drops "
            "a tensor silently)"
        )
    sources = [f for f, _ in planned]
    if len(set(sources)) != len(sources):
        dup = next(f for f in sources if sources.count(f) > 1)
        raise PlanError(
            f"{dup}: holds tensors of two layers; k3lab converts one source shard per output file"
        )
    label_plan = Plan(cfg, outtype, basename, [], {})
    label_plan.files = [PlannedFile(i + 1, "", f, ts) for i, (f, ts) in enumerate(planned)]
    label = label_plan.label
    for f in label_plan.files:
        f.filename = output_filename(basename, label, f.number, len(planned))
    label_plan.source_files = sizes
    return label_plan


BASE_RSS = 160 * 1024 * 1024  # a worker's Python, numpy, numba and gguf before any tensor


def peak_piece_bytes(pt: PlannedTensor, cfg: K3Config) -> int:
    """The most tensor memory the converter holds at once for this tensor."""
    if pt.rule.dtype == "mxfp4":
        rows, cols = expert_dims(cfg, pt.name)
        return rows * cols // 2 + rows * cols // 32 + pt.nbytes // cfg.n_expert
    if pt.transform == "stack":
        return 2 * pt.nbytes // cfg.n_expert
    if pt.transform == "copy":
        from .convert import COPY_CHUNK  # (convert imports this module)

        return 3 * min(pt.nbytes, COPY_CHUNK)
    return 3 * pt.nbytes


def describe_plan(plan: Plan, jobs: int = 1, max_rows: int = 12) -> str:
    """The plan as the table `k3lab plan` prints: files, totals, disk and memory forecasts."""
    from .synth.report import human_bytes

    lines = [f"{'output file':<40} {'source shard':<36} {'tensors':>7} {'bytes':>12}  types"]
    n = len(plan.files)
    for i, f in enumerate(plan.files):
        if n > max_rows and max_rows // 2 <= i < n - max_rows // 2:
            if i == max_rows // 2:
                lines.append(f"{'...':<40} ({n - max_rows} more files)")
            continue
        types: dict[str, int] = {}
        for t in f.tensors:
            types[t.info.type.name] = types.get(t.info.type.name, 0) + 1
        lines.append(
            f"{f.filename:<40} {f.source_file:<36} {len(f.tensors):>7} {human_bytes(f.nbytes):>12}  "
            + ", ".join(f"{k}:{v}" for k, v in sorted(types.items()))
        )
    total = sum(f.nbytes for f in plan.files)
    src_total = sum(plan.source_files.values())
    largest = max(plan.source_files.values())
    peak = max(peak_piece_bytes(t, plan.cfg) for f in plan.files for t in f.tensors)
    vocab_mem = 400 * plan.cfg.n_vocab  # token and merge strings of file 1
    lines += [
        f"{n} output files (a llama.cpp split set), {plan.n_tensors} tensors, {human_bytes(total)} of tensor data "
        f"from {human_bytes(src_total)} of text source shards",
        f"disk: final {human_bytes(total)} plus headers; working space none beyond the files themselves "
        f"(each is written as .partial and renamed); streaming from the Hub adds up to {jobs} x 2 source shards "
        f"({human_bytes(2 * jobs * largest)})",
        f"memory: about {human_bytes(BASE_RSS + peak + vocab_mem)} per worker ({human_bytes(peak)} largest piece "
        f"held at once), {human_bytes(jobs * (BASE_RSS + peak + vocab_mem))} for --jobs {jobs}",
    ]
    return "\n".join(lines)
