"""The safetensors file format: a validated header reader, a streaming writer, and the validated index
of a sharded checkpoint. Nothing model-specific.

Layout: u64 little-endian header length N, N bytes of JSON (padded with spaces to 8-byte
alignment), then the data section; each tensor's ``data_offsets`` are relative to its start.
The reader checks what a truncated or hand-edited file gets wrong (offsets past the end,
dtype x shape != byte length, overlapping ranges) and names the file and tensor when it fails.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats.files import InputFileError, json_counts, open_regular, parse_json, read_bounded

DTYPE_SIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# numpy dtype used to *hold* the bytes (BF16 is carried as its uint16 bit pattern)
NUMPY_DTYPE = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
    "E8M0": np.uint8,
    "U16": np.uint16,
    "I16": np.int16,
    "F16": np.float16,
    "BF16": np.uint16,
    "U32": np.uint32,
    "I32": np.int32,
    "F32": np.float32,
    "U64": np.uint64,
    "I64": np.int64,
    "F64": np.float64,
}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
INDEX_NAME = "model.safetensors.index.json"  # a sharded checkpoint's index: tensor name -> shard file
SINGLE_NAME = "model.safetensors"  # a checkpoint saved whole (transformers below its shard size): no index
INDEX_LIMIT = 512 * 1024 * 1024  # the real index is ~40 MB
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class SafetensorsError(K3LabError):
    """A safetensors file is malformed; the message names the file and, where known, the tensor."""


# --- the index of a sharded checkpoint (maybe a stranger's) ---


def check_shard_name(name: str, where: str) -> None:
    """A file name from an index (maybe a stranger's) must be a relative path inside the source:
    no absolute path, no ``..``, no control characters (NUL, newline). One line naming the entry."""
    parts = PurePosixPath(name).parts
    if (
        not name
        or _CONTROL.search(name)
        or "\\" in name
        or name.startswith("/")
        or any(p in ("..", ".") for p in parts)
        or not name.endswith(".safetensors")
    ):
        raise SafetensorsError(
            f"{where}: names file {name!r}; an index may only name .safetensors files inside the checkpoint "
            "(a relative path, no '..')"
        )


def find_index(*dirs: str | Path) -> Path | None:
    """The first ``model.safetensors.index.json`` in ``dirs`` (None: the checkpoint has no index)."""
    for d in dirs:
        path = Path(d) / INDEX_NAME
        if path.exists() or path.is_symlink():
            return path
    return None


def read_index(path: str | Path) -> dict[str, str]:
    """An index's weight_map (tensor name -> file), every entry checked: file names are relative
    ``.safetensors`` paths inside the checkpoint, tensor names hold no control characters."""
    path = Path(path)
    raw = read_bounded(path, INDEX_LIMIT, "safetensors index")
    index = parse_json(raw, str(path))
    try:
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
        # (the types gathered at C speed: an index of Kimi-K3 names 500,000 tensors)
        if not set(map(type, weight_map)) <= _STR or not set(map(type, weight_map.values())) <= _STR:
            raise TypeError("weight_map maps tensor names to file names (strings)")
    except (KeyError, TypeError) as e:
        raise SafetensorsError(f"{path}: not a safetensors index ({type(e).__name__}: {e})") from None
    files: dict[str, str] = {}  # one string object per file name: 500k entries share 96
    for file in dict.fromkeys(weight_map.values()):  # (in the index's order: the first bad one is said)
        if not _shard_name_ok(file):
            name = next(k for k, v in weight_map.items() if v == file)
            check_shard_name(file, f"{path}: tensor {name}")
        files[file] = file
    # (one search, and none without a backslash: JSON holds a control character only as an escape)
    if b"\\" in raw and _CONTROL.search("".join(weight_map)):
        name = next(k for k in weight_map if _CONTROL.search(k))
        raise SafetensorsError(f"{path}: tensor name {name!r} holds a control character")
    return dict(zip(weight_map, map(files.__getitem__, weight_map.values())))


def _shard_name_ok(file: str) -> bool:
    try:
        check_shard_name(file, "")
    except SafetensorsError:
        return False
    return True


class TensorEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int
    file: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints: no overflow, whatever a header claims


def _entry_problem(file: str, name: str, dtype: str, shape: tuple, begin: int, end: int) -> str:
    if dtype not in DTYPE_SIZE:
        return f"{file}: tensor {name}: unknown dtype {dtype!r}"
    if any(type(d) is not int or d < 0 for d in (*shape, begin, end)) or not begin <= end:
        return f"{file}: tensor {name}: bad shape {list(shape)} or offsets [{begin}, {end}]"
    want = math.prod(shape) * DTYPE_SIZE[dtype]
    return f"{file}: tensor {name}: {dtype} {list(shape)} needs {want} bytes, data_offsets span {end - begin}"


def _check_overlaps(file: str, entries: list[TensorEntry]) -> None:
    if len(entries) < 2:
        return
    # (the columns at C speed: a TensorEntry is a tuple, its fields are its items)
    starts = np.array(list(map(operator.itemgetter(3), entries)), dtype=np.int64)
    ends = starts + np.array(list(map(operator.itemgetter(4), entries)), dtype=np.int64)
    ranges = np.flatnonzero(ends > starts)  # (an empty tensor overlaps nothing)
    order = ranges[np.argsort(starts[ranges], kind="stable")]
    clash = np.nonzero(starts[order][1:] < ends[order][:-1])[0]
    if clash.size:
        a, b = entries[order[clash[0]]], entries[order[clash[0] + 1]]
        raise SafetensorsError(f"{file}: tensors {a.name} and {b.name} overlap")


class _DuplicateKey(Exception):
    """A JSON object of the header names this key twice (raised from the parser's object hook)."""


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object that names a key twice is refused (as the safetensors library refuses it): the
    last one would silently win."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return out


def _keys(header: dict) -> int:
    """The keys of a parsed header and of the objects directly in it. Never more than the text's
    pairs (each key comes of a colon); equal only when no key of these two levels was named twice
    and nothing nests deeper (else the exact, slower parse decides)."""
    values = header.values()
    if set(map(type, values)) == _DICT:  # (a sound header: every value an object, counted at C speed)
        return len(header) + sum(map(len, values))
    return len(header) + sum(len(v) for v in values if type(v) is dict)


def parse_header(
    raw: bytes, file: str, file_size: int | None
) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse a header (the bytes after the 8-byte length). Returns (entries by name, __metadata__)."""
    depth, _, _, pairs = json_counts(raw)
    if depth > MAX_NESTING:
        raise SafetensorsError(f"{file}: header nests {depth} levels deep; a safetensors header is flat")
    try:
        text = raw.decode("utf-8")
        header = json.loads(text)
        # a key named twice would silently keep its last value: the text's pairs (its colons outside
        # strings) against the objects' keys finds one at C speed; the slow parse then names it
        if pairs != _keys(header):
            json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        said = str(e) if not _CONTROL.search(str(e)) else repr(str(e))
        raise SafetensorsError(f"{file}: tensor {said}: appears twice in the header") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsError(f"{file}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{file}: header is not a JSON object")
    data_start = 8 + len(raw)
    metadata = header.pop("__metadata__", None) or {}
    limit = None if file_size is None else file_size - data_start
    # (JSON holds a control character in a string only as an escape: without a backslash, no name has one)
    entries = _sound_entries(header, file, data_start, limit, escaped=b"\\" in raw)
    if entries is None:
        entries = _entries_one_by_one(header, file, data_start, limit)
    _check_overlaps(file, list(entries.values()))
    return entries, metadata


def _sound_entries(
    header: dict, file: str, data_start: int, limit: int | None, escaped: bool = True
) -> dict[str, TensorEntry] | None:
    """Every entry of a sound header, checked a column at a time (dtypes, dimensions, offsets, sizes:
    each one pass at C speed; a Kimi-K3 header has 5,400 entries and the model 500,000). None when
    anything is off: the entry-by-entry check then names the first entry at fault."""
    try:
        infos = list(header.values())
        dtypes = [i["dtype"] for i in infos]
        shapes = [tuple(i["shape"]) for i in infos]
        offsets = [i["data_offsets"] for i in infos]
        if not set(dtypes) <= DTYPE_SIZE.keys() or not set(map(len, offsets)) <= {2}:
            return None
        begins, ends = [b for b, _ in offsets], [e for _, e in offsets]
    except (KeyError, TypeError, ValueError):
        return None
    if escaped and _CONTROL.search("".join(header)):
        return None
    dims = [d for shape in shapes for d in shape]
    if not (set(map(type, dims)) | set(map(type, begins)) | set(map(type, ends))) <= _INT:
        return None  # (JSON gives ints for whole numbers; a float or a bool is not one)
    if min(dims, default=0) < 0 or min(begins, default=0) < 0:
        return None
    spans = list(map(operator.sub, ends, begins))
    if spans != list(map(operator.mul, map(math.prod, shapes), map(DTYPE_SIZE.__getitem__, dtypes))):
        return None
    if limit is not None and max(ends, default=0) > limit:
        return None
    starts = [data_start + begin for begin in begins]
    rows = zip(header, dtypes, shapes, starts, spans, itertools.repeat(file))
    # (tuple.__new__ makes each entry without a Python-level call: half the time for 500,000)
    return dict(zip(header, map(tuple.__new__, itertools.repeat(TensorEntry), rows)))


def _entries_one_by_one(
    header: dict, file: str, data_start: int, limit: int | None
) -> dict[str, TensorEntry]:
    """The entries checked one at a time: the first one at fault is refused by name."""
    size_of, prod, make = DTYPE_SIZE.get, math.prod, TensorEntry
    entries: dict[str, TensorEntry] = {}
    named = _CONTROL.search("".join(header)) is not None  # (one search; the loop names the name)
    for name, info in header.items():
        if named and _CONTROL.search(name):  # (as in an index: a name is said in one line, or refused)
            raise SafetensorsError(f"{file}: tensor name {name!r} holds a control character")
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            size = size_of(dtype)
            want = prod(shape) * size if size else -1
            # JSON gives ints for whole numbers (a float or a bool is not one)
            ints = type(begin) is int and type(end) is int and set(map(type, shape)) <= _INT
            ok = (
                ints
                and size is not None
                and type(want) is int
                and want == end - begin
                and 0 <= begin
                and (not shape or min(shape) >= 0)
            )
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{file}: tensor {name}: header entry is malformed: {info!r}") from None
        if not ok:
            raise SafetensorsError(_entry_problem(file, name, dtype, shape, begin, end))
        if limit is not None and end > limit:
            raise SafetensorsError(
                f"{file}: tensor {name}: data ends at byte {data_start + end}, "
                f"past the end of the file ({data_start + limit} bytes; truncated?)"
            )
        entries[name] = make(name, dtype, shape, data_start + begin, end - begin, file)
    return entries


_INT, _STR, _DICT = {int}, {str}, {dict}
MAX_NESTING = 64  # a header is a flat object of small objects; deeper JSON is not a header


def read_raw_header(path: str | os.PathLike) -> tuple[bytes, int]:
    """The header's JSON bytes (after the 8-byte length) and the file's size, checked to fit."""
    path = Path(path)
    try:
        fd, size = open_regular(path, "safetensors file")
    except InputFileError as e:
        raise SafetensorsError(str(e)) from None
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        raw = os.pread(fd, n, 8)
        if len(raw) != n:
            raise SafetensorsError(f"{path}: header ends early (the file shrank while read?)")
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    return raw, size


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Read and validate the header of a local safetensors file."""
    raw, size = read_raw_header(path)
    return parse_header(raw, str(path), size)


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """A tensor's bytes as a read-only memory map with its numpy holding dtype and shape."""
    if entry.nbytes == 0:
        return np.zeros(entry.shape, dtype=NUMPY_DTYPE[entry.dtype])
    arr = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.start, shape=(entry.nbytes,))
    return arr.view(NUMPY_DTYPE[entry.dtype]).reshape(entry.shape)


def build_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """The 8-byte length + padded JSON header for tensors laid out back to back in the given order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * DTYPE_SIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def data_size(tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) * DTYPE_SIZE[d] for _, d, s in tensors)
