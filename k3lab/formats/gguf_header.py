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

from k3lab.errors import K3LabError, printable

MAGIC = b"GGUF"
# bounds on what a header may hold, each far beyond a real one (Kimi-K3's first file: ~60 keys,
# ~1,000 tensors, 330,000 vocabulary strings), so that parsing costs time in proportion to the
# bytes read and a crafted header of millions of tiny keys is refused at once
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ITEMS = 1 << 23  # strings and arrays inside arrays, over the whole header
MAX_NESTING = 8  # arrays of arrays (llama.cpp reads none; gguf-py writes them)
MAX_COUNT = 1 << 40  # scalars in one array (they are skipped by length, never one by one)
MAX_DIMS = 8
MAX_KEPT_STRINGS = 1024  # strings of an array kept (read) whole; a longer one is walked past
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
        """A string's bytes as a ``str``; bytes that are not UTF-8 kept as surrogate escapes (so the
        bytes come back whole: ``str.encode("utf-8", "surrogateescape")``)."""
        n = self.unpack("<Q")
        if n > len(self.data) + (1 << 30):
            raise GGUFHeaderError(f"a string of {n} bytes")
        return bytes(self.take(n)).decode("utf-8", errors="surrogateescape")

    def skip_strings(self, count: int) -> None:
        """Walk past ``count`` strings (a vocabulary: the one loop that runs per item)."""
        data, pos, end, unpack = self.data, self.pos, len(self.data), struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise NeedMore(pos + 8)
            pos += 8 + unpack("<Q", data, pos)[0]
            if pos > end:
                raise NeedMore(pos)
        self.pos = pos


def _scalar(c: _Cursor, vtype: int) -> Any:
    try:
        return c.unpack(_SCALAR[GGUFValueType(vtype)])
    except (KeyError, ValueError):
        raise GGUFHeaderError(f"value type {vtype} is not a GGUF type") from None


class _Budget:
    """Items walked one by one over a whole header (strings and arrays inside arrays)."""

    def __init__(self) -> None:
        self.left = MAX_ITEMS

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise GGUFHeaderError(
                f"more than {MAX_ITEMS} strings and arrays inside arrays: not a real header"
            )


def _value(c: _Cursor, vtype: int, keep: bool, budget: _Budget) -> Any:
    """A value read (``keep``) or walked past; arrays are walked with a stack of their own, never by
    recursion (nesting is bounded by ``MAX_NESTING``, not by Python's stack)."""
    if vtype == GGUFValueType.STRING:
        return c.string() if keep else c.skip_strings(1)
    if vtype != GGUFValueType.ARRAY:
        return _scalar(c, vtype)
    stack: list[tuple[int, int]] = []  # (item type, items left) of each array open
    itype, count = _array_head(c)
    if (
        keep and itype == GGUFValueType.STRING
    ):  # (an imatrix's datasets: the first ones kept, the rest walked past)
        kept = min(count, MAX_KEPT_STRINGS)
        budget.spend(kept)
        out = [c.string() for _ in range(kept)]
        budget.spend(count - kept)
        c.skip_strings(count - kept)
        return out
    if keep and itype in _SCALAR:  # (a per-layer value: its numbers)
        fmt = _SCALAR[GGUFValueType(itype)]
        budget.spend(count)
        raw = c.take(count * struct.calcsize(fmt))
        return [x[0] for x in struct.iter_unpack(fmt, raw)]
    stack.append((itype, count))
    while stack:
        itype, left = stack.pop()
        if not left:
            continue
        if itype in _SCALAR:
            c.take(left * struct.calcsize(_SCALAR[GGUFValueType(itype)]))
        elif itype == GGUFValueType.STRING:
            budget.spend(left)
            c.skip_strings(left)
        elif itype == GGUFValueType.ARRAY:
            budget.spend(1)
            stack.append((itype, left - 1))  # the rest of this array, after the one opening now
            if len(stack) >= MAX_NESTING:
                raise GGUFHeaderError(f"arrays nested more than {MAX_NESTING} deep")
            stack.append(_array_head(c))
        else:
            raise GGUFHeaderError(f"value type {itype} is not a GGUF type")
    return None


def _array_head(c: _Cursor) -> tuple[int, int]:
    itype, count = c.unpack("<I"), c.unpack("<Q")
    if count > MAX_COUNT:
        raise GGUFHeaderError(f"an array of {count} items")
    return itype, count


LOADER_MAX_DIMS = 4  # GGML_MAX_DIMS
LOADER_MAX_NAME = 64  # GGML_MAX_NAME: a tensor's name is shorter


def without_tensors(
    data: bytes | memoryview, dropping: tuple[str, ...] = (), align: int = GGUF_DEFAULT_ALIGNMENT
) -> bytes:
    """A header's metadata as a GGUF file of its own: the same version and keys, in order and byte
    for byte, but those starting with one of ``dropping``; no tensors (what a loader that reads the
    metadata alone, such as llama.cpp's vocabulary-only load, is given)."""
    c = _Cursor(data)
    if bytes(c.take(4)) != MAGIC:
        raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
    version = c.unpack("<I")
    _, n_kv = c.unpack("<Q"), c.unpack("<Q")
    if n_kv > MAX_KEYS:
        raise GGUFHeaderError(f"{n_kv} keys: not a real header (at most {MAX_KEYS})")
    budget = _Budget()
    kept: list[bytes] = []
    for _ in range(n_kv):
        start = c.pos
        key = c.string()
        _value(c, c.unpack("<I"), False, budget)
        if not (dropping and key.startswith(dropping)):
            kept.append(bytes(c.data[start : c.pos]))
    body = MAGIC + struct.pack("<IQQ", version, 0, len(kept)) + b"".join(kept)
    return body + b"\0" * (-len(body) % align)


def parse(
    data: bytes | memoryview,
    keep: tuple[str, ...] = (),
    size: int | None = None,
    loader: bool = False,
    prefixes: tuple[str, ...] = (),
) -> Header:
    """The header at the start of ``data`` (the keys named in ``keep``, or starting with one of
    ``prefixes``, read; the others skipped);
    ``NeedMore`` when ``data`` ends first. ``size``: the whole file's, which every tensor must fit.
    ``loader``: also what ggml's own loader (``gguf_init_from_file``, as ``llama-quantize`` reads an
    imatrix) refuses: an empty or repeated key, a tensor name repeated or of 64 bytes or more, more
    than 4 dimensions, a shape of over 2**63 elements, tensors not laid out one after another (each at
    the end of the one before, padded to the alignment), a file that ends before its data does."""
    c = _Cursor(data)
    if bytes(c.take(4)) != MAGIC:
        raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
    version = c.unpack("<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version}; k3lab reads 2 and 3")
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KEYS:
        raise GGUFHeaderError(
            f"{n_tensors} tensors and {n_kv} keys: not a real header (at most {MAX_TENSORS} and {MAX_KEYS})"
        )
    header = Header(version)
    wanted = set(keep) | {"general.alignment"}
    budget = _Budget()
    keys: set[str] = set()
    for _ in range(n_kv):
        key = c.string()
        if loader and (not key or key in keys):
            raise GGUFHeaderError(
                f"key {printable(key)!r} {'repeated' if key else 'empty'} (ggml's loader refuses it)"
            )
        keys.add(key)
        kept = key in wanted or (bool(prefixes) and key.startswith(prefixes))
        value = _value(c, c.unpack("<I"), kept, budget)
        if kept:
            header.kvs[key] = value
    infos = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = c.string()
        dims = c.unpack("<I")
        if loader:
            shown = printable(name[:80])
            if len(name.encode("utf-8", "surrogateescape")) >= LOADER_MAX_NAME or name in names:
                raise GGUFHeaderError(
                    f"tensor {shown}: a name {'repeated' if name in names else 'of 64 bytes or more'} "
                    "(ggml's loader refuses it)"
                )
            if dims > LOADER_MAX_DIMS:
                raise GGUFHeaderError(f"tensor {shown}: {dims} dimensions (ggml's loader takes at most 4)")
            names.add(name)
        if dims > MAX_DIMS:
            raise GGUFHeaderError(f"tensor {printable(name)}: {dims} dimensions")
        ne = tuple(c.unpack("<Q") for _ in range(dims))
        gtype, offset = c.unpack("<I"), c.unpack("<Q")
        try:
            qtype = GGMLQuantizationType(gtype)
            block, per = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFHeaderError(
                f"tensor {printable(name)}: GGML type {gtype} is not one gguf-py knows"
            ) from None
        elements = 1
        for n in ne:
            elements *= n
        if loader and (elements >= 1 << 63 or any(n >= 1 << 63 for n in ne)):
            raise GGUFHeaderError(
                f"tensor {printable(name)}: a shape of {list(ne)} (ggml's loader refuses it)"
            )
        if ne and ne[0] % block:
            raise GGUFHeaderError(
                f"tensor {printable(name)}: {ne[0]} values do not fill {qtype.name} blocks of {block}"
            )
        infos.append((name, qtype.name, ne, offset, elements // block * per))
    align = header.kvs.get("general.alignment") or GGUF_DEFAULT_ALIGNMENT
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFHeaderError(f"general.alignment {align!r} is not a power of two")
    header.data_start = c.pos + (-c.pos % align)
    if loader:
        end = 0
        for name, _, _, offset, nbytes in infos:
            if offset != end:
                raise GGUFHeaderError(
                    f"tensor {printable(name)}: at offset {offset} of the data, not {end} (ggml's loader "
                    "takes tensors one after another)"
                )
            end += nbytes + -nbytes % align
        if size is not None and header.data_start + end > size:
            raise GGUFHeaderError(
                f"ends at byte {size}, before its data does ({header.data_start + end}): cut short?"
            )
    for name, qtype, ne, offset, nbytes in infos:
        start = header.data_start + offset
        if offset % align or (size is not None and start + nbytes > size):
            raise GGUFHeaderError(
                f"tensor {printable(name)}: its bytes [{start}, {start + nbytes}) do not fit the file"
            )
        header.tensors.append(TensorInfo(name, qtype, ne, start, nbytes))
    # what a loader relies on: every tensor's bytes its own (sorted by start, each ends before the next)
    by_start = sorted(header.tensors, key=lambda t: (t.offset, t.nbytes))
    for before, after in zip(by_start, by_start[1:]):
        if after.offset < before.offset + before.nbytes:
            raise GGUFHeaderError(
                f"tensor {printable(after.name)}: its bytes from {after.offset} overlap tensor "
                f"{printable(before.name)}'s [{before.offset}, {before.offset + before.nbytes})"
            )
    return header
