"""Each tensor's cost per type: what quantising it to a type loses, and what it then weighs.

For a tensor of the finished set and a type ggml quantises to, the loss is the expected change of the
matrix's output on the calibration data that ggml's own round trip makes: quantised by ggml (with the
tensor's importance matrix, as llama-quantize quantises it), dequantised by ggml, the squared errors
of every weight weighted by its input column's mean square (the imatrix's values: E[(dW x)^2] with the
columns taken apart), per expert with that expert's importance (an expert no token reached: 1.0, as
llama-quantize has it). Measured on ``rows`` evenly spaced rows of every matrix (every expert's) and
scaled to the whole; the size is exact. A type whose block does not divide the row width is left out
(llama.cpp would fall back to another: the solver chooses only what is made as chosen), as is a type
that needs an imatrix when there is none; the tensor's own type costs nothing (the lossless bytes).

A table is computed per output file, where the file is (proven first: the one its record describes;
one pass over its tensors, every type at once), and kept beside the set:
``OUT/.k3lab/costs/costs-NNNNN.json``, a state file (its own digest checked when read) keyed by the
file's content digest, the imatrix's SHA-256, the rows, the types and ggml's version (a table of
another file or imatrix is made again).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.ggml import TYPE_IDS, ggml

# the types a cost is measured for: ggml's quantisation targets people run, largest first (those of
# blocks of 32 too: llama.cpp's own choice for rows that 256 does not divide; down to Q1_0's 1.125 bits,
# what the smallest published Kimi-K3 is made of)
CANDIDATES = ("Q8_0", "Q6_K", "Q5_1", "Q5_K", "Q5_0", "Q4_1", "Q4_K", "IQ4_NL", "Q4_0", "IQ4_XS", "Q3_K",
              "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "TQ1_0", "IQ1_S",
              "Q1_0")  # fmt: skip
ROWS = 16  # rows measured per matrix (an expert's matrix is one): the real model in hours, not weeks
FORMAT = "k3lab-costs/4"  # raised whenever the same inputs give other costs
# tensors whose rows are the vocabulary's, by llama.cpp's names: their cost is one row's, the rows' mean
# (not their sum). The embedding is read, not multiplied: a token reads its own row. The head's rows
# are the logits: what moves the next token is the spread of their changes over the vocabulary (KL is
# about half their variance under the model's distribution), not the sum of 163,840 squares, which
# made the head outweigh every other tensor a millionfold (benchmarks/fit_proof.py: the head at Q4_K
# moves nothing, the embedding at Q2_K moves everything).
PER_ROW = ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")


@dataclass(frozen=True)
class Option:
    """One type of one tensor: its bytes, and its loss (the expected squared change of its output)."""

    type: str
    nbytes: int
    cost: float


@dataclass
class TensorCost:
    """A tensor's options, its own (lossless) type first among them at no cost."""

    name: str
    type: str
    ne: tuple[int, ...]
    options: list[Option] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "ne": list(self.ne),
                "options": [[o.type, o.nbytes, o.cost] for o in self.options]}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorCost:
        return cls(str(d["name"]), str(d["type"]), tuple(int(x) for x in d["ne"]),
                   [Option(str(t), int(b), float(c)) for t, b, c in d["options"]])  # fmt: skip


def _nbytes(type_name: str, ne: Sequence[int]) -> int:
    tr = ggml().traits(TYPE_IDS[type_name])
    return tr.row_bytes(ne[0]) * math.prod(ne[1:])


def candidates(ne: Sequence[int], imatrix: bool, types: Sequence[str] = CANDIDATES) -> list[str]:
    """The types measured for a tensor whose rows are ``ne[0]`` wide."""
    lib = ggml()
    out = []
    for t in types:
        tid = TYPE_IDS[t]
        if ne[0] % lib.traits(tid).block or (lib.requires_imatrix(tid) and not imatrix):
            continue
        out.append(t)
    return out


def sample_rows(n_rows: int, rows: int = ROWS) -> np.ndarray:
    """Evenly spaced rows of a matrix of ``n_rows`` (all of them when there are few)."""
    if n_rows <= rows:
        return np.arange(n_rows)
    return np.unique(np.linspace(0, n_rows - 1, rows).round().astype(np.int64))


def tensor_cost(
    name: str,
    type_name: str,
    ne: tuple[int, ...],
    read_rows: Callable[[int, np.ndarray], np.ndarray],
    importance: np.ndarray | None,
    types: Sequence[str] = CANDIDATES,
    rows: int = ROWS,
    share: np.ndarray | None = None,
) -> TensorCost:
    """The options of one tensor: ``read_rows(matrix, rows)`` gives float32 [len(rows), ne[0]] of
    matrix ``matrix`` (an expert of a stack; 0 for a 2-D tensor), ``importance`` float32
    [n_matrices * ne[0]] as llama-quantize gives it to ggml (None: no imatrix); ``share``: the part of
    the tokens each matrix sees (an expert: the tokens routed to it; default all: a dense tensor), by
    which its loss counts in the whole. The vocabulary's tensors (``PER_ROW``: the embedding, the head)
    count one row's loss, the rows' mean (not their sum)."""
    lib = ggml()
    n_cols, n_rows = ne[0], ne[1]
    n_mat = math.prod(ne[2:]) if len(ne) > 2 else 1
    picked = sample_rows(n_rows, rows)
    scale = (1 if name in PER_ROW else n_rows) / len(picked)
    out = TensorCost(name, type_name, ne, [Option(type_name, _nbytes(type_name, ne), 0.0)])
    chosen = [t for t in candidates(ne, importance is not None, types) if t != type_name]
    totals = dict.fromkeys(chosen, 0.0)
    for m in range(n_mat):
        w = np.ascontiguousarray(read_rows(m, picked), dtype=np.float32)
        im = None if importance is None else np.ascontiguousarray(importance[m * n_cols : (m + 1) * n_cols])
        weight = np.ones(n_cols, np.float64) if im is None else im.astype(np.float64)
        weight *= 1.0 if share is None else float(share[m])
        for t in chosen:
            tid = TYPE_IDS[t]
            q = np.empty(len(picked) * lib.traits(tid).row_bytes(n_cols), np.uint8)
            lib.quantize(tid, w, q, im)
            back = np.empty(w.size, np.float32)
            lib.to_float(tid, q, back)
            err = (back.reshape(w.shape).astype(np.float64) - w) ** 2
            totals[t] += float((err * weight).sum()) * scale
    out.options += [Option(t, _nbytes(t, ne), totals[t]) for t in chosen]
    return out


# --- kept beside the set ----------------------------------------------------------------------------


def table_path(state_dir: Any, number: int) -> Any:
    return state_dir / "costs" / f"costs-{number:05d}.json"


def save_table(path: Any, proof: dict[str, str], tensors: list[TensorCost]) -> None:
    from k3lab.pipeline.state.codec import write_state

    with contextlib.suppress(FileExistsError):  # (then it must be a real directory: checked next)
        os.mkdir(path.parent)
    if path.parent.is_symlink() or not path.parent.is_dir():
        raise K3LabError(f"{path.parent}: not a real directory; k3lab keeps its state only in one")
    write_state(path, "costs", {"format": FORMAT, "proof": proof, "tensors": [t.to_json() for t in tensors]})


def load_table(path: Any, proof: dict[str, str]) -> list[TensorCost] | None:
    """The table at ``path`` when it is the one of this file and imatrix (``proof``), else None."""
    from k3lab.pipeline.state.codec import read_state

    try:
        body = read_state(path, "costs")
        if body is None or body.get("format") != FORMAT or body.get("proof") != proof:
            return None
        return [TensorCost.from_json(t) for t in body["tensors"]]
    except (K3LabError, KeyError, TypeError, ValueError, OSError):
        return None


def predicted_loss(folder: Any, vp: Any) -> float | None:
    """A variant's loss as the set's cost tables predict it: every tensor's cost under the type it is
    given, summed; None unless every file of it has a table of its lossless file as it is, with the
    variant's imatrix, this ggml and these types (any rows: a ``--fit`` made them). Reads only."""
    from k3lab.pipeline.state.codec import read_state
    from k3lab.pipeline.state.records import content_digest

    total = 0.0
    for vf in vp.files:
        rec = folder.records.text(vf.source_number)
        if rec is None:
            return None
        try:
            body = read_state(table_path(folder.state, vf.source_number), "costs")
        except (K3LabError, OSError, ValueError):
            return None
        if not isinstance(body, dict):
            return None
        proof = body.get("proof")
        want = {"file": content_digest(rec), "imatrix": vp.imatrix.sha256 if vp.imatrix else "none",
                "types": ",".join(CANDIDATES), "ggml": ggml().version}  # fmt: skip
        if (
            body.get("format") != FORMAT
            or not isinstance(proof, dict)
            or any(proof.get(k) != v for k, v in want.items())
        ):
            return None
        try:
            costs = {t["name"]: {o[0]: float(o[2]) for o in t["options"]} for t in body["tensors"]}
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        for t in vf.tensors:
            if not t.quantized:
                continue
            cost = costs.get(t.name, {}).get(t.type)
            if cost is None:
                return None
            total += cost
    return total


# --- a set's tables ---------------------------------------------------------------------------------


def set_tables(
    folder: Any, reference: Any, rows: int = ROWS, say: Callable[[str], None] | None = None
) -> tuple[list[TensorCost], int]:
    """The cost table of every tensor llama-quantize quantises in the set in ``folder`` (those
    ``reference``, a variant plan over the set, quantises; with its imatrix), file by file, each kept
    beside the set and used again while its file, the imatrix, the rows and ggml are the same; and
    the bytes of the tensors kept as they are."""
    from k3lab.pipeline.state.records import content_digest

    base = {"imatrix": reference.imatrix.sha256 if reference.imatrix else "none", "rows": str(rows),
            "types": ",".join(CANDIDATES), "ggml": ggml().version}  # fmt: skip
    tables: list[TensorCost] = []
    fixed = 0
    for vf in reference.files:
        rec = folder.records.text(vf.source_number)
        if rec is None or not folder.records.is_complete(vf.source_number, vf.source, vf.source_digest):
            raise K3LabError(
                f"{folder.output(vf.source)}: not the finished file its record describes (changed since, or "
                "not converted yet): convert it first"
            )
        fixed += sum(t.nbytes for t in vf.tensors if not t.quantized)
        proof = {**base, "file": content_digest(rec)}
        path = table_path(folder.state, vf.source_number)
        got = load_table(path, proof)
        if got is None:
            if say is not None:
                say(f"costs: {vf.source} ({sum(t.quantized for t in vf.tensors)} tensors, every type)")
            got = _file_table(folder.output(rec.file), rec, vf, reference, rows)
            save_table(path, proof, got)
        tables += got
    return tables, fixed


def _shares(reference: Any, name: str, ne: Sequence[int]) -> np.ndarray | None:
    """An expert stack's share of the tokens per expert, from the imatrix's counts (the tokens routed
    to it over the tokens every dense product saw; an expert never reached counts as one token);
    without counts, the tokens spread evenly over the experts (each sees ``1 / n_experts`` of the
    routed slots' worth of them)."""
    if len(ne) < 3:
        return None
    n = math.prod(ne[2:])
    entry = reference.imatrix.index.entries.get(name) if reference.imatrix is not None else None
    counts = _counts(reference, entry) if entry is not None and entry.m == n else None
    if counts is None:
        return np.full(n, 1.0 / n)
    tokens = _tokens(reference)
    return np.maximum(counts, 1.0) / max(tokens, float(counts.max()), 1.0)


def _counts(reference: Any, entry: Any) -> np.ndarray | None:
    from k3lab.pipeline.quantizing.imatrix_files import reader

    if entry.counts is None:
        return None
    raw = reader(reference.imatrix)(*entry.counts)
    return np.frombuffer(raw, dtype="<f4").astype(np.float64)


def _tokens(reference: Any) -> float:
    """The tokens every dense product saw: the largest count of an entry with one count."""
    from k3lab.pipeline.quantizing.imatrix_files import reader

    best = 0.0
    read = reader(reference.imatrix)
    for e in reference.imatrix.index.entries.values():
        if e.m == 1 and e.counts is not None:
            best = max(best, float(np.frombuffer(read(*e.counts), dtype="<f4")[0]))
    return best


def _file_table(path: Any, rec: Any, vf: Any, reference: Any, rows: int) -> list[TensorCost]:
    from k3lab.formats.files import open_regular
    from k3lab.pipeline.quantizing.quantize import imatrix_rows

    lib = ggml()
    by_name = {t.name: t for t in rec.tensors}
    fd, _ = open_regular(path, "GGUF file")
    out = []
    try:
        for vt in vf.tensors:
            if not vt.quantized:
                continue
            t = by_name[vt.name]
            src = TYPE_IDS[t.type]
            width, height = t.ne[0], t.ne[1]
            row_bytes = lib.traits(src).row_bytes(width)

            def read_rows(m: int, picked: np.ndarray, t: Any = t, src: int = src, row_bytes: int = row_bytes,
                          width: int = width, height: int = height) -> np.ndarray:  # fmt: skip
                got = np.empty((len(picked), width), np.float32)
                for j, r in enumerate(picked):
                    at = t.offset + (m * height + int(r)) * row_bytes
                    raw = np.frombuffer(os.pread(fd, row_bytes, at), np.uint8)
                    if raw.size != row_bytes:
                        raise K3LabError(f"{path}: tensor {t.name}: the file ends inside it (cut short?)")
                    lib.to_float(src, raw, got[j])
                return got

            importance = imatrix_rows(reference, vt)
            share = _shares(reference, vt.name, t.ne)
            out.append(
                tensor_cost(vt.name, t.type, tuple(t.ne), read_rows, importance, rows=rows, share=share)
            )
    finally:
        os.close(fd)
    return out
