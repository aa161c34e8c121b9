"""The plan: which source tensors feed which output tensor, in which output file, with type,
shape, bytes, transform and peak memory, plus file 1's metadata, from config.json, the index, the
tokenizer files and the safetensors headers alone.

Output file k is made from text source file k (shard k holds layer k-1; the last text shard
holds the embeddings and output tensors), so every output file is an independent unit of work.
Planning checks that every text source tensor is used by a rule and every rule finds its
sources, with the right dtypes and shapes: bad input fails here, before anything is written.

Every source tensor's dtype and shape is checked against what the config implies
(``kimi_k3.layout``), so a header that disagrees with the config can never convert, nor verify.

A plan is made once per output folder and saved there by the folder's owner (``pipeline.folder``),
keyed by a digest of everything it was made from; every later task loads it and reads at most the
header of the shard it converts. Each file's digest covers exactly what
decides that file's bytes, so a changed input redoes exactly the files it affects.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from k3lab.errors import K3LabError
from k3lab.formats.gguf_stream import KV, TensorInfo, kvs_to_json
from k3lab.formats.safetensors import TensorEntry
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.keys import model_kvs, size_label
from k3lab.kimi_k3.layout import TensorSpec, unit_layout
from k3lab.kimi_k3.rules import RULES, RULES_DIGEST, TEXT_PREFIX, Rule, layer_of
from k3lab.kimi_k3.transforms import TRANSFORMS, TensorJob, TransformError, job_memory
from k3lab.pipeline.sources import meta_fingerprint
from k3lab.util import human_bytes

PLAN_FORMAT = "k3lab-plan/1"
OUTPUT_FORMAT = 2  # raised whenever k3lab would write other bytes from the same inputs

OUTTYPES = ("auto", "bf16", "f16", "f32")
FLOAT_DTYPES = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}
OTHER_PREFIXES = ("vision_tower.", "mm_projector.")  # converted by `k3lab vision`


class PlanError(K3LabError):
    """The checkpoint does not fit the rules (a missing, unused or malformed source tensor)."""


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: its GGUF info, and the rule (at a layer) that names its sources."""

    info: TensorInfo
    rule: Rule
    layer: int | None
    cfg: K3Config = field(repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def transform(self) -> str:
        return self.rule.transform

    @property
    def sources(self) -> tuple[str, ...]:
        """The source tensor names, from the rule (not stored: an expert stack has 1,792)."""
        return tuple(self.rule.source_names(self.cfg, self.layer))

    def job(self, entries: Sequence[TensorEntry], read: Any = None) -> TensorJob:
        """What the transform's stream needs to produce this tensor from its source entries."""
        return TensorJob(
            TRANSFORMS[self.transform], entries, self.info.type, self.info.shape, self.nbytes, self.cfg, read
        )


@dataclass
class PlannedFile:
    number: int  # 1-based
    filename: str
    source_file: str
    shard: dict[str, Any]  # what identifies the source shard: size, header_sha256 (and the Hub's etag)
    tensors: list[PlannedTensor] = field(default_factory=list)
    digest: str = ""  # of everything that decides this file's bytes
    memory: int = 0  # forecast peak RSS of the process converting it

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def source_bytes(self) -> int:
        return int(self.shard.get("data_bytes", 0))


@dataclass
class Plan:
    cfg: K3Config
    outtype: str
    basename: str
    files: list[PlannedFile]
    kvs_digest: str = ""  # of file 1's metadata (hyperparameters, vocabulary, chat template)
    inputs: dict[str, Any] = field(default_factory=dict)  # the fingerprints it was made from
    inputs_digest: str = ""

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

    @property
    def source_files(self) -> dict[str, int]:
        return {f.source_file: f.source_bytes for f in self.files}

    def file(self, number: int) -> PlannedFile:
        return self.files[number - 1]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "inputs_digest": self.inputs_digest,
            "inputs": self.inputs,
            "basename": self.basename,
            "outtype": self.outtype,
            "config": self.cfg.raw,
            "config_path": self.cfg.path,
            "kvs_digest": self.kvs_digest,
            "n_files": len(self.files),
            "n_tensors": self.n_tensors,
            "bytes": sum(f.nbytes for f in self.files),
            "files": [
                {
                    "number": f.number,
                    "filename": f.filename,
                    "source_file": f.source_file,
                    "shard": f.shard,
                    "digest": f.digest,
                    "bytes": f.nbytes,
                    "memory": f.memory,
                    "tensors": [
                        {
                            "name": t.name,
                            "type": t.info.type.name,
                            "shape": list(t.info.shape),
                            "ne": list(t.info.ne),
                            "bytes": t.nbytes,
                            "transform": t.transform,
                            "rule": RULES.index(t.rule),
                            "layer": t.layer,
                        }
                        for t in f.tensors
                    ],
                }
                for f in self.files
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The plan ``to_json`` wrote. Anything else raises (KeyError, TypeError, ValueError ...):
        the folder's owner treats such a plan as absent."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a {PLAN_FORMAT} plan")
        cfg = K3Config.from_dict(data["config"], data.get("config_path", "config.json"))
        files = [
            PlannedFile(
                f["number"],
                f["filename"],
                f["source_file"],
                f["shard"],
                [
                    PlannedTensor(
                        TensorInfo(t["name"], GGMLQuantizationType[t["type"]], tuple(t["shape"])),
                        RULES[t["rule"]],
                        t["layer"],
                        cfg,
                    )
                    for t in f["tensors"]
                ],
                f["digest"],
                f["memory"],
            )
            for f in data["files"]
        ]
        return cls(
            cfg,
            data["outtype"],
            data["basename"],
            files,
            data["kvs_digest"],
            data["inputs"],
            data["inputs_digest"],
        )


def _dominant(types: set[GGMLQuantizationType]) -> str:
    for t in (GGMLQuantizationType.BF16, GGMLQuantizationType.F16, GGMLQuantizationType.F32):
        if t in types:
            return t.name
    return "F32"


def output_filename(basename: str, label: str, number: int, count: int) -> str:
    """llama.cpp's split naming: PREFIX-000NN-of-000MM.gguf."""
    return f"{basename}-{label}-{number:05d}-of-{count:05d}.gguf"


def _output_type(rule: Rule, src_dtype: str, outtype: str, where: str) -> GGMLQuantizationType:
    if rule.dtype == "mxfp4":
        return GGMLQuantizationType.MXFP4
    if src_dtype not in FLOAT_DTYPES:
        raise PlanError(f"{where}: is {src_dtype}, expected a float tensor (BF16, F16 or F32)")
    if rule.dtype == "f32":
        return GGMLQuantizationType.F32
    return FLOAT_DTYPES[src_dtype] if outtype == "auto" else FLOAT_DTYPES[outtype.upper()]


FLOAT_SOURCE = ("BF16", "F16", "F32")


def check_entry(e: TensorEntry, spec: TensorSpec | None, bid: int | None, rule: Rule) -> None:
    """A source tensor against what the config says it is: its shape exactly, and its dtype (packed
    MXFP4 bytes are U8; any float type may hold a float tensor)."""
    if spec is None:
        return  # an optional tensor the layout does not list (a vision bias): its rule checks it
    dtype_ok = e.dtype == spec.dtype if spec.dtype == "U8" else e.dtype in FLOAT_SOURCE
    if not dtype_ok or e.shape != spec.shape:
        want = spec.dtype if spec.dtype == "U8" else "float"
        where = f"layer {bid}" if bid is not None else "output tensors"
        raise PlanError(
            f"{e.file}: tensor {e.name}: {e.dtype} {list(e.shape)}, expected {want} {list(spec.shape)} "
            f"(from config.json; {where}, {rule.note or rule.output_name(bid)})"
        )


def plan_tensor(
    rule: Rule,
    cfg: K3Config,
    source: Any,
    bid: int | None,
    outtype: str,
    where: str,
    expected: dict[str, TensorSpec],
) -> PlannedTensor | None:
    """One rule at one layer (or none): its sources checked against ``expected`` (what the config
    says each source tensor is), output type and shape decided."""
    if not rule.applies(cfg, bid):
        return None
    names = rule.source_names(cfg, bid)
    weight_map = source.weight_map
    missing = [n for n in names if n not in weight_map]
    if missing and rule.optional and len(missing) == len(names):
        return None
    if missing:
        raise PlanError(f"{where}: tensor {missing[0]} is missing ({rule.output_name(bid)} needs it)")
    entries = [source.entry(n) for n in names]
    for e in entries:
        check_entry(e, expected.get(e.name), bid, rule)
    try:
        shape = TRANSFORMS[rule.transform].shape(*(e.shape for e in entries), cfg=cfg)
    except TransformError as err:
        raise PlanError(f"{entries[0].file}: tensor {entries[0].name}: {err}") from None
    gtype = _output_type(rule, entries[0].dtype, outtype, f"{entries[0].file}: tensor {entries[0].name}")
    try:
        info = TensorInfo(rule.output_name(bid), gtype, tuple(shape))
        info.nbytes  # noqa: B018 - raises when the last dimension does not fill the type's blocks
    except ValueError as err:
        raise PlanError(f"{entries[0].file}: tensor {entries[0].name}: {err}") from None
    return PlannedTensor(info, rule, bid, cfg)


def build_plan(
    cfg: K3Config,
    source: Any,
    outtype: str = "auto",
    basename: str = "Kimi-K3",
    chat_template: str | None = None,
) -> Plan:
    """Plan the text conversion from config, index and every shard's header (one in memory at a
    time), checking every source tensor is used by a rule and every rule finds its sources."""
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
        by_layer.setdefault(layer_of(name), []).append(name)
    bad = sorted(b for b in by_layer if b is not None and not 0 <= b < cfg.n_layer)
    if bad:
        raise PlanError(
            f"{weight_map[by_layer[bad[0]][0]]}: tensor {by_layer[bad[0]][0]} is layer {bad[0]}, "
            f"but the config has {cfg.n_layer} layers"
        )
    units: list[int | None] = [*range(cfg.n_layer), None]  # layers in order, then the output tensors
    used: set[str] = set()
    files: list[PlannedFile] = []
    for bid in units:
        tensors: list[PlannedTensor] = []
        homes: set[str] = set()
        home = {weight_map[n] for n in by_layer.get(bid, [])}
        where = next(iter(home)) if len(home) == 1 else str(source.index_path)
        expected = unit_layout(cfg, bid)
        for rule in RULES:
            pt = plan_tensor(rule, cfg, source, bid, outtype, where, expected)
            if pt is not None:
                tensors.append(pt)
                names = pt.sources
                used.update(names)
                homes.update(weight_map[n] for n in names)
        if len(homes) != 1:
            label = "the output tensors" if bid is None else f"layer {bid}"
            raise PlanError(
                f"{source.index_path}: {label} is spread over {len(homes)} files ({', '.join(sorted(homes))});"
                " k3lab converts one source shard per output file"
            )
        file = homes.pop()
        pf = PlannedFile(len(files) + 1, "", file, source.planned_shard(file), tensors)
        pf.memory = file_memory(pf, [source.entry(n) for t in tensors for n in t.sources])
        files.append(pf)
        source.release_header(file)  # one shard's header in memory at a time (the real ones are ~1 MB)
    unused = [n for n in text_names if n not in used]
    if unused:
        raise PlanError(
            f"{weight_map[unused[0]]}: tensor {unused[0]} is not used by any rule (k3lab never drops "
            "a tensor silently)"
        )
    sources = [f.source_file for f in files]
    if len(set(sources)) != len(sources):
        dup = next(f for f in sources if sources.count(f) > 1)
        raise PlanError(
            f"{dup}: holds tensors of two layers; k3lab converts one source shard per output file"
        )
    plan = Plan(cfg, outtype, basename, files)
    for f in files:
        f.filename = output_filename(basename, plan.label, f.number, len(files))
    kvs = plan_kvs(plan, source.meta_dir, chat_template)
    plan.kvs_digest = kvs_digest(kvs)
    files[0].memory += vocab_memory(kvs)
    for f in files:
        f.digest = file_digest(plan, f)
    return plan


def plan_kvs(plan: Plan, meta_dir: str | Path, chat_template: str | None = None) -> list[KV]:
    """File 1's metadata, besides the split keys."""
    size = size_label([(t.name, t.info.shape) for f in plan.files for t in f.tensors])
    return model_kvs(plan.cfg, meta_dir, f"{plan.basename} {plan.label}", plan.file_type, chat_template, size)


def kvs_digest(kvs: list[KV]) -> str:
    return hashlib.sha256(json.dumps(kvs_to_json(kvs), sort_keys=True).encode()).hexdigest()


def file_digest(plan: Plan, pf: PlannedFile) -> str:
    """Identifies what file ``pf`` will hold: a file from other inputs has another digest. Changing
    file 1's metadata changes file 1's digest only; a changed shard changes its own file's."""
    items = [
        (t.name, t.info.type.name, t.info.shape, t.transform, t.rule.sources, t.layer) for t in pf.tensors
    ]
    key = [
        OUTPUT_FORMAT,
        pf.number,
        pf.filename,
        len(plan.files),
        plan.n_tensors,
        {k: v for k, v in pf.shard.items() if k != "etag"},
        items,
        plan.kvs_digest if pf.number == 1 else None,
    ]
    return hashlib.sha256(json.dumps(key, default=list, sort_keys=True).encode()).hexdigest()


# --- what a plan is made from ------------------------------------------------------------------------


def inputs_fingerprint(source: Any, shards: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """What the plan depends on, read cheaply: every metadata file's SHA-256, each shard's size and
    header SHA-256 (the Hub: its ETag), the options, k3lab's output format and rule table."""
    return {
        "k3lab": [PLAN_FORMAT, OUTPUT_FORMAT, RULES_DIGEST],
        "options": options,
        "meta": meta_fingerprint(source.meta_dir),
        "shards": source.shard_fingerprint(shards),
    }


def inputs_digest(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def make_plan(
    source: Any, outtype: str = "auto", basename: str = "Kimi-K3", chat_template: str | None = None
) -> tuple[Plan, list[KV]]:
    """A new plan of converting ``source``, with its inputs' fingerprint, and file 1's KVs."""
    options = plan_options(outtype, basename, chat_template)
    cfg = K3Config.load(source.meta_dir)
    plan = build_plan(cfg, source, outtype, basename, chat_template)
    plan.inputs = inputs_fingerprint(source, [f.source_file for f in plan.files], options)
    plan.inputs_digest = inputs_digest(plan.inputs)
    return plan, plan_kvs(plan, source.meta_dir, chat_template)


def plan_options(outtype: str, basename: str, chat_template: str | None) -> dict[str, Any]:
    return {"outtype": outtype, "basename": basename, "chat_template": chat_template}


def still_current(saved: Plan, source: Any, options: dict[str, Any]) -> bool:
    """Whether a saved plan was made from these very inputs (cheap: hashes of the metadata files and
    shard headers); a shard gone missing reads as changed (planning again says which)."""
    try:
        inputs = inputs_fingerprint(source, sorted(saved.inputs.get("shards", {})), options)
        # the config the plan carries must be the one on disk (a plan's own digest can be forged)
        same_config = K3Config.load(source.meta_dir).raw == saved.cfg.raw
    except K3LabError:
        return False
    return same_config and inputs_digest(inputs) == saved.inputs_digest


# --- memory ------------------------------------------------------------------------------------------

# a converting process's Python, numpy, gguf, huggingface_hub and the plan before any tensor
# (104 MiB measured converting a tiny shard without experts; `benchmarks/run.py fullscale`)
BASE_RSS = 104 * 1024 * 1024


def file_memory(pf: PlannedFile, entries: list[TensorEntry]) -> int:
    """Forecast peak RSS of the process converting ``pf`` (file 1 adds its vocabulary later)."""
    by_name = {e.name: e for e in entries}
    jobs = [t.job([by_name[n] for n in t.sources]) for t in pf.tensors]
    return BASE_RSS + job_memory(jobs)


def vocab_memory(kvs: list[KV]) -> int:
    """What file 1's metadata costs while it is written (the strings and gguf-py's packed copy)."""
    strings = sum(len(v) for kv in kvs if isinstance(kv.value, list) for v in kv.value if isinstance(v, str))
    items = sum(len(kv.value) for kv in kvs if isinstance(kv.value, list))
    return 3 * strings + 120 * items


def describe_plan(plan: Plan, jobs: int = 1, max_rows: int = 12) -> str:
    """The plan as the table `k3lab plan` prints: files, totals, disk and memory forecasts."""
    lines = [f"{'output file':<40} {'source shard':<36} {'tensors':>7} {'bytes':>12} {'memory':>10}  types"]
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
            f"{f.filename:<40} {f.source_file:<36} {len(f.tensors):>7} {human_bytes(f.nbytes):>12} "
            f"{human_bytes(f.memory):>10}  " + ", ".join(f"{k}:{v}" for k, v in sorted(types.items()))
        )
    total = sum(f.nbytes for f in plan.files)
    src_total = sum(f.source_bytes for f in plan.files)
    largest = max(f.source_bytes for f in plan.files)
    peak = max(f.memory for f in plan.files)
    lines += [
        f"{n} output files (a llama.cpp split set), {plan.n_tensors} tensors, {human_bytes(total)} of tensor data "
        f"from {human_bytes(src_total)} of text source shards",
        f"disk: final {human_bytes(total)} plus headers; working space none beyond the files themselves "
        f"(each is written as .partial and renamed); streaming from the Hub adds up to {jobs} x 2 source shards "
        f"({human_bytes(2 * jobs * largest)})",
        f"memory: at most {human_bytes(peak)} per converting process (peak RSS, file-backed pages included), "
        f"{human_bytes(jobs * peak)} for --jobs {jobs}",
    ]
    return "\n".join(lines)
