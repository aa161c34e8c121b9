"""A variant's metadata as llama-quantize writes it: file 1's keys from the lossless file 1's (in
their order, without ``general.quantization_version``, ``general.file_type`` and the split keys,
then those two as u32, then what it records of the imatrix, then the split keys); strings as ggml
copies them (through ``c_str()``: cut at a NUL; what it records of the imatrix at most 127 bytes)."""

from __future__ import annotations

from gguf import GGUFValueType, Keys

from k3lab.formats.gguf_stream import KV, split_kvs
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.quantizing.imatrix_files import IMatrixUse
from k3lab.pipeline.quantizing.llama_types import QuantSpec

QNT_VERSION = 2  # GGML_QNT_VERSION: what llama-quantize writes as general.quantization_version
IMATRIX_KEYS = ("quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
                "quantize.imatrix.chunks_count")  # fmt: skip
SPLIT_KEYS = (
    Keys.Split.LLM_KV_SPLIT_NO,
    Keys.Split.LLM_KV_SPLIT_COUNT,
    Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
)


def variant_kvs(kvs: list[KV], spec: QuantSpec, imatrix: IMatrixUse | None, split: list[KV]) -> list[KV]:
    """File 1's metadata as llama-quantize writes it from the lossless file 1's (``kvs``: as that
    file carries them, general.architecture first): see the module's docstring."""
    moved = (Keys.General.QUANTIZATION_VERSION, Keys.General.FILE_TYPE, *SPLIT_KEYS)
    out = [_c_strings(kv) for kv in kvs if kv.key not in moved]
    out += [
        KV(Keys.General.QUANTIZATION_VERSION, QNT_VERSION, GGUFValueType.UINT32),
        KV(Keys.General.FILE_TYPE, spec.file_type.number, GGUFValueType.UINT32),
    ]
    for (
        key,
        kind,
        value,
    ) in spec.kv_overrides:  # (each set as ggml sets it: the old one removed, this one last)
        out = [kv for kv in out if kv.key != key] + [override_kv(key, kind, value)]
    if imatrix is not None:
        ix = imatrix.index
        out.append(KV(IMATRIX_KEYS[0], _strncpy(imatrix.shown), GGUFValueType.STRING))
        if ix.datasets:
            out.append(KV(IMATRIX_KEYS[1], _strncpy(ix.datasets[0]), GGUFValueType.STRING))
        out.append(KV(IMATRIX_KEYS[2], len(ix.entries), GGUFValueType.UINT32))
        if ix.chunk_count > 0:
            out.append(KV(IMATRIX_KEYS[3], ix.chunk_count, GGUFValueType.UINT32))
    return out + split


def override_kv(key: str, kind: str, value: str) -> KV:
    """``--override-kv KEY=TYPE:VALUE`` as llama-quantize writes it: ``int`` as a u32 of its absolute
    value (``atol``, then ``(uint32_t)std::abs``), ``float`` as an f32 (``atof``), ``bool``, ``str``."""
    import re

    import numpy as np

    if kind == "int":
        m = re.match(r"\s*[+-]?\d+", value)
        number = abs(int(m.group(0))) if m else 0
        return KV(key, number % (1 << 32), GGUFValueType.UINT32)
    if kind == "float":
        m = re.match(
            r"\s*[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", value, re.I
        )
        return KV(key, float(np.float32(float(m.group(0)) if m else 0.0)), GGUFValueType.FLOAT32)
    if kind == "bool":
        return KV(key, value == "true", GGUFValueType.BOOL)
    return KV(key, value, GGUFValueType.STRING)


def _strncpy(text: str) -> str:
    """What llama-quantize keeps of a string it records (``strncpy(val_str, s, 127)``): at most 127
    bytes, up to the first NUL (a character cut in two keeps its bytes: surrogate escapes here, bytes
    again in the file)."""
    return (
        text.encode("utf-8", errors="surrogateescape")
        .split(b"\0", 1)[0][:127]
        .decode("utf-8", errors="surrogateescape")
    )


def _c_strings(kv: KV) -> KV:
    """A key as ggml copies it: strings through ``c_str()``, so cut at their first NUL (k3lab's own
    files hold none; this keeps the bytes identical for any set that does)."""
    if kv.type == GGUFValueType.STRING and isinstance(kv.value, str) and "\0" in kv.value:
        return KV(kv.key, kv.value.split("\0", 1)[0], kv.type)
    if kv.sub_type == GGUFValueType.STRING and any(isinstance(v, str) and "\0" in v for v in kv.value):
        return KV(kv.key, [v.split("\0", 1)[0] for v in kv.value], kv.type, kv.sub_type)
    return kv


def lossless_kvs(plan: Plan, kvs: list[KV]) -> list[KV]:
    """File 1's keys in the order the lossless file 1 carries them: general.architecture first (the
    writer puts it there), the planned keys, then the split keys."""
    arch = KV(Keys.General.ARCHITECTURE, plan.model.name, GGUFValueType.STRING)
    rest = [kv for kv in kvs if kv.key != Keys.General.ARCHITECTURE]
    return [arch, *rest, *(split_kvs(0, len(plan.files), plan.n_tensors) if plan.split_keys else [])]
