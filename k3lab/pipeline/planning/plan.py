"""The plan's data model: which source tensors feed which output tensor, in which output file, with
type, shape, bytes, transform and peak memory, and the digests that say what each file holds.

A plan is made by ``planner`` (from config.json, the index, the tokenizer files and the safetensors
headers alone), forecast by ``forecast``, shown by ``plan_table``, and saved by the output folder's
owner (``folder``), keyed by a digest of everything it was made from; every later task loads it and
reads at most the header of the shard it converts. Each file's digest covers exactly what decides
that file's bytes, so a changed input redoes exactly the files it affects.

Output file k is made from source shard k (shard k holds unit k-1: a layer, or the output tensors),
so every output file is an independent unit of work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gguf import GGMLQuantizationType

from k3lab.errors import K3LabError
from k3lab.formats.gguf_stream import KV, TensorInfo, kvs_to_json
from k3lab.formats.safetensors import TensorEntry
from k3lab.pipeline.model import Model, Rule
from k3lab.pipeline.streams import TensorJob, Transform

PLAN_FORMAT = "k3lab-plan/2"
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
    source_file: str
    shard: dict[str, Any]  # what identifies the source shard: size, header_sha256 (and the Hub's SHA-256)
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
    model: Model
    cfg: Any
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
            "model": self.model.name,
            "rules_digest": self.model.rules_digest,
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
                            "rule": self.model.rules.index(t.rule),
                            "layer": t.layer,
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
        files = [
            PlannedFile(
                f["number"],
                f["filename"],
                f["source_file"],
                f["shard"],
                [
                    PlannedTensor(
                        TensorInfo(t["name"], GGMLQuantizationType[t["type"]], tuple(t["shape"])),
                        model.rules[t["rule"]],
                        t["layer"],
                        cfg,
                        model.transforms[model.rules[t["rule"]].transform],
                    )
                    for t in f["tensors"]
                ],
                f["digest"],
                f["memory"],
            )
            for f in data["files"]
        ]
        return cls(
            model,
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
        pf.shard,  # (the Hub: its SHA-256 too, so a changed shard redoes its file)
        items,
        plan.kvs_digest if pf.number == 1 else None,
    ]
    return hashlib.sha256(json.dumps(key, default=list, sort_keys=True).encode()).hexdigest()
