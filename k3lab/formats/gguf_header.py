"""A GGUF file's header read from its first bytes alone, in bounded memory: the tensor infos and the
few keys a split set is checked by, every other value skipped (gguf-py's reader turns the 163,840
strings of a vocabulary into ~600 MB of arrays; this walks past them).

GGUF v3, little-endian: magic ``GGUF``, u32 version, u64 tensor count, u64 KV count; each KV a
string key (u64 length + UTF-8), u32 value type and the value (an array: u32 item type, u64 count,
the items); each tensor info a string name, u32 dimensions, u64 each, u32 GGML type, u64 offset
within the data; the data starts at the next multiple of ``general.alignment`` (default 32).
``parse`` raises ``NeedMore`` with the length it needs when the bytes end before the header does,
so a remote reader fetches exactly up to the header's end. The tests hold it to gguf-py's reader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from k3lab.errors import K3LabError

MAGIC = b"GGUF"
MAX_COUNT = 1 << 32  # tensors or keys in one file: far beyond any real one
MAX_DIMS = 8
_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class NeedMore(Exception):
    """The header runs past the bytes given: ``at_least`` bytes are needed (more may follow)."""

    def __init__(self, at_least: int):
        super().__init__(at_least)
        self.at_least = at_least


class GGUFHeaderError(K3LabError):
    """Bytes that are not a GGUF header: one line, naming the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGMLQuantizationType's name
    ne: tuple[int, ...]
    offset: int  # absolute in the file
    nbytes: int


@dataclass
class Header:
    version: int
    kvs: dict[str, Any] = field(default_factory=dict)  # the keys asked for (``keep``), by name
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0


class _Cursor:
    def __init__(self, data: bytes | memoryview):
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise NeedMore(end)
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > len(self.data) + (1 << 30):
            raise GGUFHeaderError(f"a string of {n} bytes")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.take(self.unpack("<Q"))


def _value(c: _Cursor, vtype: int, keep: bool) -> Any:
    if vtype == GGUFValueType.STRING:
        return c.string() if keep else c.skip_string()
    if vtype == GGUFValueType.ARRAY:
        itype, count = c.unpack("<I"), c.unpack("<Q")
        if count > MAX_COUNT:
            raise GGUFHeaderError(f"an array of {count} items")
        if itype in _SCALAR:
            c.take(count * struct.calcsize(_SCALAR[GGUFValueType(itype)]))
            return None
        for _ in range(count):
            _value(c, itype, False)
        return None
    try:
        return c.unpack(_SCALAR[GGUFValueType(vtype)])
    except (KeyError, ValueError):
        raise GGUFHeaderError(f"value type {vtype} is not a GGUF type") from None


def parse(data: bytes | memoryview, keep: tuple[str, ...] = (), size: int | None = None) -> Header:
    """The header at the start of ``data`` (the keys named in ``keep`` read, the others skipped);
    ``NeedMore`` when ``data`` ends first. ``size``: the whole file's, which every tensor must fit."""
    c = _Cursor(data)
    if bytes(c.take(4)) != MAGIC:
        raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
    version = c.unpack("<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version}; k3lab reads 2 and 3")
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise GGUFHeaderError(f"{n_tensors} tensors and {n_kv} keys: not a real header")
    header = Header(version)
    wanted = set(keep) | {"general.alignment"}
    for _ in range(n_kv):
        key = c.string()
        value = _value(c, c.unpack("<I"), key in wanted)
        if key in wanted:
            header.kvs[key] = value
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = c.unpack("<I")
        if dims > MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name}: {dims} dimensions")
        ne = tuple(c.unpack("<Q") for _ in range(dims))
        gtype, offset = c.unpack("<I"), c.unpack("<Q")
        try:
            qtype = GGMLQuantizationType(gtype)
            block, per = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFHeaderError(f"tensor {name}: GGML type {gtype} is not one gguf-py knows") from None
        elements = 1
        for n in ne:
            elements *= n
        if ne and ne[0] % block:
            raise GGUFHeaderError(f"tensor {name}: {ne[0]} values do not fill {qtype.name} blocks of {block}")
        infos.append((name, qtype.name, ne, offset, elements // block * per))
    align = header.kvs.get("general.alignment") or GGUF_DEFAULT_ALIGNMENT
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFHeaderError(f"general.alignment {align!r} is not a power of two")
    header.data_start = c.pos + (-c.pos % align)
    for name, qtype, ne, offset, nbytes in infos:
        start = header.data_start + offset
        if offset % align or (size is not None and start + nbytes > size):
            raise GGUFHeaderError(f"tensor {name}: its bytes [{start}, {start + nbytes}) do not fit the file")
        header.tensors.append(TensorInfo(name, qtype, ne, start, nbytes))
    return header
