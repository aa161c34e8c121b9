"""The plan's data model: which source tensors feed which output tensor, in which output file, with
type, shape, bytes, transform and peak memory, and the digests that say what each file holds.

A plan is made by ``planner`` (from config.json, the index, the tokenizer files and the safetensors
headers alone), forecast by ``forecast``, shown by ``plan_table``, and saved by the output folder's
owner (``pipeline.state``), keyed by a digest of everything it was made from; every later task loads it and
reads at most the headers of the source files its output file reads. Each file's digest covers
exactly what decides that file's bytes, so a changed input redoes exactly the files it affects.

An output file is whole units of the model (layers, then the output tensors: ``split``), whatever
the source's files are; it lists the source files it reads (``sources``) and each of its tensors
which of those hold its source tensors (``files``), so every output file is an independent unit of
work that acquires exactly its own inputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gguf import GGMLQuantizationType

from k3lab.errors import K3LabError
from k3lab.formats.gguf_stream import KV, TensorInfo, kvs_to_json
from k3lab.formats.safetensors import TensorEntry
from k3lab.pipeline.model import Model, Rule
from k3lab.pipeline.planning.split import Split
from k3lab.pipeline.sources.base import SourceFile
from k3lab.pipeline.streams import TensorJob, Transform

PLAN_FORMAT = "k3lab-plan/3"
OUTPUT_FORMAT = 2  # raised whenever k3lab would write other bytes from the same inputs

OUTTYPES = ("auto", "bf16", "f16", "f32")
FLOAT_DTYPES = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}


class PlanError(K3LabError):
    """The checkpoint does not fit the rules (a missing, unused or malformed source tensor)."""


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: its GGUF info, and the rule (at a unit) that names its sources."""

    info: TensorInfo
    rule: Rule
    layer: int | None
    cfg: Any = field(repr=False, compare=False)  # the model's config
    transform_fn: Transform = field(repr=False, compare=False)
    files: tuple[int, ...] = ()  # which of its output file's ``sources`` hold its source tensors
    read: int = 0  # source bytes its stream reads

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
        return self.rule.source_names(self.cfg, self.layer)

    def job(self, entries: Sequence[TensorEntry], read: Any = None, buffer: Any = None) -> TensorJob:
        """What the transform's stream needs to produce this tensor from its source entries (``buffer``:
        the writer's, for pieces made in place)."""
        return TensorJob(
            self.transform_fn, entries, self.info.type, self.info.shape, self.nbytes, self.cfg, read, buffer
        )


@dataclass
class PlannedFile:
    number: int  # 1-based
    filename: str
    sources: list[SourceFile]  # the source files it reads, in the order its tensors first need them
    tensors: list[PlannedTensor] = field(default_factory=list)
    units: list[int | None] = field(default_factory=list)  # the model's units it holds (layers, None)
    digest: str = ""  # of everything that decides this file's bytes
    memory: int = 0  # forecast peak RSS of the process converting it

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def source_bytes(self) -> int:
        """The source bytes converting it reads (what a run's bar counts)."""
        return sum(t.read for t in self.tensors)

    @property
    def source_names(self) -> list[str]:
        return [s.file for s in self.sources]

    def last_use(self) -> dict[int, int]:
        """Source index -> the position of the last tensor reading it (then it can go)."""
        return {i: k for k, t in enumerate(self.tensors) for i in t.files}


@dataclass
class Plan:
    model: Model
    cfg: Any
    outtype: str
    basename: str
    files: list[PlannedFile]
    kvs_digest: str = ""  # of file 1's metadata (hyperparameters, vocabulary, chat template)
    inputs: dict[str, Any] = field(default_factory=dict)  # the fingerprints it was made from
    inputs_digest: str = ""
    split: Split = field(default_factory=Split)
    # what a later run takes as read while it is unchanged: source and metadata files' identities
    # beside what was read of them (``planner.proven_inputs``); never part of the inputs' digest
    proven: dict[str, Any] = field(default_factory=dict)

    @property
    def split_keys(self) -> bool:
        """Whether the files carry llama.cpp's split keys (a set of one file has none)."""
        return len(self.files) > 1

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
    def source_files(self) -> list[SourceFile]:
        """Every source file the set reads, once."""
        seen: dict[str, SourceFile] = {}
        for f in self.files:
            for s in f.sources:
                seen.setdefault(s.file, s)
        return list(seen.values())

    def readers_of(self, file: str) -> list[int]:
        """The output files (numbers) that read source file ``file``."""
        return [f.number for f in self.files if file in f.source_names]

    def file(self, number: int) -> PlannedFile:
        return self.files[number - 1]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "model": self.model.name,
            "rules_digest": self.model.rules_digest,
            "inputs_digest": self.inputs_digest,
            "inputs": self.inputs,
            "proven": self.proven,
            "basename": self.basename,
            "outtype": self.outtype,
            "config": self.cfg.raw,
            "config_path": self.cfg.path,
            "kvs_digest": self.kvs_digest,
            "split": self.split.to_json(),
            "n_files": len(self.files),
            "n_tensors": self.n_tensors,
            "bytes": sum(f.nbytes for f in self.files),
            "files": [
                {
                    "number": f.number,
                    "filename": f.filename,
                    "sources": [s.to_json() for s in f.sources],
                    "units": f.units,
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
                            "rule": self.model.rules.index(t.rule),
                            "layer": t.layer,
                            "files": list(t.files),
                            "read": t.read,
                        }
                        for t in f.tensors
                    ],
                }
                for f in self.files
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], model: Model) -> Plan:
        """The plan ``to_json`` wrote for ``model``. Anything else raises (KeyError, TypeError,
        ValueError ...): the folder's owner treats such a plan as absent."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a {PLAN_FORMAT} plan")
        if data.get("model") != model.name or data.get("rules_digest") != model.rules_digest:
            raise PlanError(f"a plan of another model or rule table ({data.get('model')})")
        cfg = model.config_from_dict(data["config"], data.get("config_path", "config.json"))
        files = []
        for f in data["files"]:
            sources = [SourceFile.from_json(s) for s in f["sources"]]
            tensors = [
                PlannedTensor(
                    TensorInfo(t["name"], GGMLQuantizationType[t["type"]], tuple(t["shape"])),
                    model.rules[t["rule"]],
                    t["layer"],
                    cfg,
                    model.transforms[model.rules[t["rule"]].transform],
                    tuple(int(i) for i in t["files"]),
                    int(t["read"]),
                )
                for t in f["tensors"]
            ]
            if any(not 0 <= i < len(sources) for t in tensors for i in t.files):
                raise PlanError(f"output file {f['number']}: a tensor reads a file the plan does not list")
            files.append(
                PlannedFile(
                    f["number"], f["filename"], sources, tensors, f["units"], f["digest"], f["memory"]
                )
            )
        return cls(
            model,
            cfg,
            data["outtype"],
            data["basename"],
            files,
            data["kvs_digest"],
            data["inputs"],
            data["inputs_digest"],
            Split.from_json(data["split"]),
            _proven(data.get("proven", {})),
        )


def _proven(data: Any) -> dict[str, Any]:
    """A saved plan's ``proven`` in the shape ``planner.proven_inputs`` writes, else nothing proven
    (the files are then read again: a damaged entry costs time, never trust)."""
    ok: dict[str, Any] = {"files": {}, "meta": {}}
    if not isinstance(data, dict):
        return ok
    for kind, needs in (
        ("files", ("identity", "fingerprint", "header_sha256")),
        ("meta", ("identity", "sha256")),
    ):
        entries = data.get(kind)
        if isinstance(entries, dict):
            ok[kind] = {
                k: v
                for k, v in entries.items()
                if isinstance(v, dict) and all(n in v for n in needs) and isinstance(v["identity"], dict)
            }
    return ok


def _dominant(types: set[GGMLQuantizationType]) -> str:
    for t in (GGMLQuantizationType.BF16, GGMLQuantizationType.F16, GGMLQuantizationType.F32):
        if t in types:
            return t.name
    return "F32"


def output_filename(basename: str, label: str, number: int, count: int, size_label: str = "") -> str:
    """A set of one file as upstream's converter names it (``Kimi-K3-0.40B-F16.gguf``: name, size
    label, type); a split set as llama.cpp's split naming (``Kimi-K3-MXFP4-00001-of-00094.gguf``,
    k3lab's names since its first release, kept so that published sets stay valid)."""
    if count == 1:
        return f"{basename}-{size_label}-{label}.gguf" if size_label else f"{basename}-{label}.gguf"
    return f"{basename}-{label}-{number:05d}-of-{count:05d}.gguf"


_SIZE_LABEL = re.compile(r"(?:[0-9]{1,4}x)?[0-9]{1,6}(?:\.[0-9]{1,4})?[KMBT]")


def size_label(plan: Plan, kvs: list[KV], source_name: str = "") -> str:
    """The size label of a one-file set's name, as upstream's converter finds it: a label the
    checkpoint's own name carries (``Kimi-K3-0.40B``, the repo or folder), else file 1's
    ``general.size_label`` (gguf-py's parameter class of the planned tensors: ``8x1.9M``)."""
    hint = [part for part in source_name.split("-") if _SIZE_LABEL.fullmatch(part)]
    if hint:
        return hint[-1]
    found = next((kv.value for kv in kvs if kv.key == "general.size_label"), None)
    if isinstance(found, str) and _SIZE_LABEL.fullmatch(found):
        return found
    from gguf import model_weight_count_rounded_notation

    total = sum(math.prod(t.info.shape) for f in plan.files for t in f.tensors)
    return model_weight_count_rounded_notation(total, min_digits=2)


def kvs_digest(kvs: list[KV]) -> str:
    return hashlib.sha256(json.dumps(kvs_to_json(kvs), sort_keys=True).encode()).hexdigest()


def file_digest(plan: Plan, pf: PlannedFile) -> str:
    """Identifies what file ``pf`` will hold: a file from other inputs has another digest. Changing
    file 1's metadata changes file 1's digest only; a changed shard changes its own file's."""
    items = [
        (t.name, t.info.type.name, t.info.shape, t.transform, t.rule.sources, t.layer) for t in pf.tensors
    ]
    # a file read from one source file keys on its fingerprint alone, as k3lab always has (so a set
    # converted before files could read several is still complete); otherwise on each file's, by name
    sources: Any = pf.sources[0].fingerprint() if len(pf.sources) == 1 else [s.to_json() for s in pf.sources]
    key = [
        OUTPUT_FORMAT,
        pf.number,
        pf.filename,
        len(plan.files),
        plan.n_tensors,
        sources,  # (the Hub: their SHA-256 too, so a changed source file redoes the files that read it)
        items,
        plan.kvs_digest if pf.number == 1 else None,
    ]
    return hashlib.sha256(json.dumps(key, default=list, sort_keys=True).encode()).hexdigest()
