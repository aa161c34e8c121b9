"""A variant's plan: which type every tensor of a finished (lossless) set becomes, file by file, and
the metadata each file carries, decided once for the whole model and saved beside the variant
(``OUT/LABEL/.k3lab/variant.json``) so that a task quantising file k anywhere reads its file's part.

A variant is ``llama-quantize`` over the whole set, written file by file:

- split sets: ``llama-quantize --keep-split --allow-requantize [flags] FILE1 OUT/LABEL/NAME-LABEL.gguf
  FTYPE``: the files ``NAME-LABEL-0000k-of-0000n.gguf``, each with the lossless file k's tensors in
  its order; a set of one file: the same without ``--keep-split`` (``NAME-SIZE-LABEL.gguf``, the
  tensors in llama.cpp's by-layer order);
- types: ``llama_types.choose_types`` over every tensor in that order (its counters run over the
  whole model);
- file 1's metadata: the lossless file 1's keys in their order, without ``general.quantization_version``,
  ``general.file_type`` and the split keys, then those two (u32), then the imatrix's keys
  (``quantize.imatrix.file``, ``.dataset``, ``.entries_count``, ``.chunks_count``), then the split
  keys; the other files carry the split keys only (no ``general.architecture``: llama-quantize
  writes none there).

Each file's digest covers what decides its bytes: the lossless file's own digest (its plan's), the
types chosen, the imatrix (its SHA-256 and the entries the file uses), ggml's version (the kernels
are ggml's), and for file 1 its metadata; a variant is remade exactly where one of them changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.gguf_stream import KV, kvs_from_json, kvs_to_json, split_kvs
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.quantizing.imatrix_files import IMatrixUse
from k3lab.pipeline.quantizing.llama_mix import choose_types
from k3lab.pipeline.quantizing.llama_types import (
    BLOCK,
    Choice,
    ModelFacts,
    QuantSpec,
    TensorFact,
    llama_order,
)
from k3lab.pipeline.quantizing.metadata import lossless_kvs, variant_kvs
from k3lab.pipeline.quantizing.quality import MEASURED, PREDICTED, PREDICTED_WORDS
from k3lab.pipeline.quantizing.recipes import command, recipe
from k3lab.pipeline.quantizing.variant_notes import notes, tensor_bytes

VARIANT_FORMAT = "k3lab-variant/1"  # raised whenever k3lab would write other bytes from the same inputs
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class VariantError(K3LabError):
    """A variant that cannot be made from this set as asked: one line, before any work."""


def check_label(label: str) -> str:
    """A variant's name: its folder and its files' type label (letters, digits, ``.``, ``_``, ``-``)."""
    if not _LABEL.fullmatch(label or "") or label in (".", ".."):
        raise VariantError(
            f"variant {label!r}: a name of letters, digits, '.', '_' and '-' (its folder's name)"
        )
    return label


@dataclass(frozen=True)
class Variant:
    """What a user asks for: a name, llama-quantize's flags, and an imatrix (or none)."""

    label: str
    spec: QuantSpec
    imatrix: IMatrixUse | None = None
    recipe: str = ""  # the named recipe it came from, if any


@dataclass(frozen=True)
class VariantTensor:
    name: str
    source_type: str
    ne: tuple[int, ...]
    type: str
    why: str
    nbytes: int

    @property
    def quantized(self) -> bool:
        return self.type != self.source_type

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order, trailing 1s of ``ne`` dropped as ggml writes the dims (ggml_n_dims)."""
        ne = list(self.ne)
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        return tuple(reversed(ne))


@dataclass
class VariantFile:
    number: int
    filename: str
    source: str  # the lossless file it is made from
    source_number: int
    source_digest: str  # that file's digest in the set's plan
    tensors: list[VariantTensor]
    digest: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def source_bytes(self) -> int:
        """The lossless file's bytes it reads (what a run's bar counts)."""
        return sum(tensor_bytes(t.source_type, t.ne) for t in self.tensors)


@dataclass
class VariantPlan:
    label: str
    spec: QuantSpec
    basename: str
    keep_split: bool
    set_digest: str  # the lossless plan's inputs digest
    ggml: str
    files: list[VariantFile]
    kvs: list[KV]  # file 1's metadata, split keys included
    imatrix: IMatrixUse | None = None
    recipe: str = ""
    notes: list[str] = field(default_factory=list)
    predicted_loss: float | None = (
        None  # from the set's cost tables, where they are (``costs.predicted_loss``)
    )
    kl: str = ""  # llama-perplexity's KL figures, measured after the files are made (``quantize --kl-text``)

    @property
    def n_tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    def file(self, number: int) -> VariantFile:
        return self.files[number - 1]

    def file_kvs(self, number: int) -> list[KV]:
        if number == 1:
            return self.kvs
        return split_kvs(number - 1, len(self.files), self.n_tensors) if self.keep_split else []

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def command(self, set_dir: str = ".") -> str:
        """The ``llama-quantize`` command that makes these bytes from the set in ``set_dir``."""
        import os.path

        first = os.path.join(set_dir, self.files[0].source)
        out = os.path.join(
            set_dir,
            self.label,
            f"{self.basename}-{self.label}.gguf" if self.keep_split else self.files[0].filename,
        )
        im = self.imatrix
        weights = (im.include, im.exclude) if im is not None else ((), ())
        return command(self.spec, first, out, im.shown if im else None, self.keep_split, weights)

    def made_as(self) -> str:
        """``command()`` for the manifest and the card, and what the imatrix was made from."""
        made = self.command() + (self.imatrix.made_from() if self.imatrix is not None else "")
        if self.predicted_loss is not None:
            made += f"\n{PREDICTED} {self.predicted_loss:.4g}: {PREDICTED_WORDS}"
        if self.kl:
            made += f"\n{MEASURED} {self.kl}"
        return made

    @property
    def digest(self) -> str:
        return hashlib.sha256("".join(f.digest for f in self.files).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": VARIANT_FORMAT,
            "label": self.label,
            "spec": self.spec.to_json(),
            "recipe": self.recipe,
            "basename": self.basename,
            "keep_split": self.keep_split,
            "set_digest": self.set_digest,
            "ggml": self.ggml,
            "imatrix": self.imatrix.to_json() if self.imatrix else None,
            "kvs": kvs_to_json(self.kvs),
            "notes": self.notes,
            "predicted_loss": self.predicted_loss,
            "kl": self.kl,
            "files": [
                {
                    "number": f.number,
                    "filename": f.filename,
                    "source": f.source,
                    "source_number": f.source_number,
                    "source_digest": f.source_digest,
                    "digest": f.digest,
                    "tensors": [
                        [t.name, t.source_type, list(t.ne), t.type, t.why, t.nbytes] for t in f.tensors
                    ],
                }
                for f in self.files
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> VariantPlan:
        """The plan ``to_json`` wrote, every file's digest made again from what it holds: anything
        else raises (the folder's owner then treats the plan as absent)."""
        if not isinstance(data, dict) or data.get("format") != VARIANT_FORMAT:
            raise VariantError(f"not a {VARIANT_FORMAT} plan")
        files = [
            VariantFile(
                int(f["number"]), str(f["filename"]), str(f["source"]), int(f["source_number"]),
                str(f["source_digest"]),
                [VariantTensor(str(n), str(st), tuple(int(x) for x in ne), str(t), str(w), int(b))
                 for n, st, ne, t, w, b in f["tensors"]],
                str(f["digest"]),
            )
            for f in data["files"]
        ]  # fmt: skip
        imatrix = IMatrixUse.from_json(data["imatrix"]) if data.get("imatrix") else None
        plan = cls(
            check_label(str(data["label"])), QuantSpec.from_json(data["spec"]), str(data["basename"]),
            bool(data["keep_split"]), str(data["set_digest"]), str(data["ggml"]), files,
            kvs_from_json(data["kvs"]), imatrix, str(data.get("recipe", "")), [str(n) for n in data.get("notes", [])],
        )  # fmt: skip
        loss = data.get("predicted_loss")
        plan.predicted_loss = float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None
        kl = data.get("kl")
        plan.kl = kl[:400] if isinstance(kl, str) and "\n" not in kl else ""
        if any(f.number != k for k, f in enumerate(files, 1)) or not files:
            raise VariantError("files out of order")
        for f in files:
            if file_digest(plan, f) != f.digest:
                raise VariantError(f"file {f.number}: its digest does not hold")
        return plan


def file_digest(plan: VariantPlan, f: VariantFile) -> str:
    """What decides file ``f``'s bytes (see the module's docstring)."""
    used = []
    if plan.imatrix is not None:
        entries = plan.imatrix.index.entries
        used = [entries[t.name].to_json() for t in f.tensors if t.quantized and t.name in entries]
    key = [
        VARIANT_FORMAT,
        plan.ggml,
        plan.label,
        plan.keep_split,
        len(plan.files),
        plan.n_tensors,
        f.number,
        f.filename,
        f.source,
        f.source_digest,
        [[t.name, t.source_type, list(t.ne), t.type] for t in f.tensors],
        plan.imatrix.sha256 if plan.imatrix else None,
        used,
        kvs_to_json(plan.kvs) if f.number == 1 else None,
    ]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


# --- making the plan ---------------------------------------------------------------------------------


def variant_filename(plan: Plan, label: str, number: int) -> str:
    """As llama-quantize names its output: ``PREFIX-0000k-of-0000n.gguf`` with ``--keep-split`` (the
    prefix ``NAME-LABEL``); one file: the set's file name with the variant's label for its type."""
    if len(plan.files) > 1:
        return f"{plan.basename}-{label}-{number:05d}-of-{len(plan.files):05d}.gguf"
    name = plan.files[0].filename
    suffix = f"-{plan.label}.gguf"
    stem = name[: -len(suffix)] if name.endswith(suffix) else plan.basename
    return f"{stem}-{label}.gguf"


def plan_variant(
    plan: Plan, kvs: list[KV], variant: Variant, ggml_version: str, forecast: bool = False
) -> VariantPlan:
    """The variant of the set ``plan`` describes (``kvs``: its file 1's planned metadata), every
    tensor's type decided as llama-quantize decides it over the whole model; one line, before any
    work, for what llama-quantize would refuse (an imatrix missing or of another model).
    ``forecast``: the sizes only, as if an imatrix were given where none is (it decides no size)."""
    label = check_label(variant.label)
    spec, imatrix = variant.spec, variant.imatrix
    file1 = lossless_kvs(plan, kvs)
    values = {kv.key: kv.value for kv in file1}
    facts = ModelFacts.from_kvs(values)
    if variant.recipe:  # made for this model; the user's own flags first (llama.cpp: first match wins)
        dense = values.get(f"{facts.arch}.leading_dense_block_count", 0)
        width = values.get(f"{facts.arch}.embedding_length", 0)
        base = recipe(variant.recipe).spec(
            facts,
            dense if isinstance(dense, int) else 0,
            width if isinstance(width, int) and width > 0 else 1,
        )
        spec = dataclasses.replace(
            base,
            overrides=spec.overrides + base.overrides,
            output_tensor_type=spec.output_tensor_type or base.output_tensor_type,
            token_embedding_type=spec.token_embedding_type or base.token_embedding_type,
        )
    listed = [(pf, t) for pf in plan.files for t in pf.tensors]
    facts_of = [TensorFact(t.name, t.info.type.name, tuple(t.info.ne)) for _, t in listed]
    keep_split = len(plan.files) > 1
    order = list(range(len(listed))) if keep_split else llama_order([t.name for t in facts_of])
    assumed = forecast and imatrix is None
    choices = choose_types([facts_of[i] for i in order], facts, spec, imatrix is not None or assumed)
    chosen: dict[str, Choice] = {facts_of[i].name: c for i, c in zip(order, choices)}
    for t in facts_of:  # (llama-quantize applies no fallback to the embedding and output flags: it aborts)
        if t.ne[0] % BLOCK[chosen[t.name].type]:
            c = chosen[t.name]
            raise VariantError(
                f"tensor {t.name}: {c.type} ({c.why}) needs rows of a multiple of {BLOCK[c.type]} values, "
                f"this one has {t.ne[0]} (llama-quantize would abort)"
            )
    if not assumed:
        _check_imatrix(facts_of, chosen, imatrix)
    files = []
    for pf in plan.files:
        names = [t.name for t in pf.tensors]
        within = names if keep_split else [names[i] for i in llama_order(names)]
        by_name = {t.name: t for t in pf.tensors}
        tensors = []
        for name in within:
            t, c = by_name[name], chosen[name]
            ne = tuple(t.info.ne)
            tensors.append(VariantTensor(name, t.info.type.name, ne, c.type, c.why, tensor_bytes(c.type, ne)))
        files.append(VariantFile(pf.number, variant_filename(plan, label, pf.number), pf.filename, pf.number,
                                 pf.digest, tensors))  # fmt: skip
    split = split_kvs(0, len(plan.files), sum(len(f.tensors) for f in files)) if keep_split else []
    out = VariantPlan(label, spec, plan.basename, keep_split, plan.inputs_digest, ggml_version, files,
                      variant_kvs(file1, spec, imatrix, split), imatrix, variant.recipe)  # fmt: skip
    needs = assumed and any(c.needs_imatrix for c in choices)
    out.notes = notes(out) + (
        [f"{label} needs an imatrix (--imatrix FILE): planned as with one"] if needs else []
    )
    for f in files:
        f.digest = file_digest(out, f)
    return out


def _check_imatrix(facts: list[TensorFact], chosen: dict[str, Choice], imatrix: IMatrixUse | None) -> None:
    """What llama-quantize refuses, said before any work: a type that needs an imatrix without one; an
    entry missing for such a tensor; an entry whose size is not the tensor's; an imatrix that names
    no tensor of this model at all (another model's)."""
    if imatrix is None:
        needs = next((t for t in facts if chosen[t.name].needs_imatrix), None)
        if needs is not None:
            c = chosen[needs.name]
            raise VariantError(
                f"tensor {needs.name}: {c.type} needs an importance matrix (--imatrix FILE, made by "
                "llama-imatrix); llama-quantize refuses it without one too"
            )
        return
    entries = imatrix.index.entries
    where = imatrix.location
    if not any(t.name in entries for t in facts):
        first = next(iter(entries), "")
        raise VariantError(
            f"{where}: names none of this set's tensors (its first entry: {first!r}): the imatrix of another model?"
        )
    for t in facts:
        c = chosen[t.name]
        if c.type == t.type:
            continue
        e = entries.get(t.name)
        if e is None and c.needs_imatrix:
            raise VariantError(f"{where}: no entry for tensor {t.name}, which {c.type} cannot be made without")  # fmt: skip
        if e is None:
            continue
        want = t.ne[0] * (t.ne[2] if len(t.ne) > 2 else 1)
        if e.n * e.m != want and t.name not in ("token_embd.weight", "per_layer_token_embd.weight"):
            raise VariantError(
                f"{where}: entry {t.name} holds {e.n * e.m} values, the tensor needs {want} "
                f"({t.ne[0]} columns x {want // t.ne[0]} experts): the imatrix of another model?"
            )
