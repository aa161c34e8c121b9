"""llama.cpp's importance matrix files, read as ``llama-quantize`` reads them (``common/imatrix-loader``
and ``tools/quantize``), in bounded memory and by ranges: an index of every entry first (where its
numbers lie), then only the entries a task quantises.

Two formats (``llama-imatrix`` writes the first; the second is older):

GGUF (``general.type imatrix``): per weight tensor NAME two F32 tensors, ``NAME.in_sum2`` (ne [n, m]:
    the sums of squared inputs of each of the n columns, for each of m experts, m = 1 for a dense
    tensor) and ``NAME.counts`` (m values: how many rows each sum saw); keys ``imatrix.datasets``
    (strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32). llama-quantize refuses a
    GGUF imatrix without all three keys.
legacy ``.dat``: i32 entry count; per entry an i32 name length, the name, i32 ncall, i32 nval,
    nval f32 (already divided by the count, times ncall); then optionally i32 chunk count, i32 length
    and the dataset name.

What a quantiser is given for a tensor (``load_imatrix`` in tools/quantize): GGUF, per expert j,
``in_sum2[j] / float(lround(counts[j]))``, or 1.0 for every column where the count is 0; legacy,
``values / ncall`` when ncall > 0, else the values; float32 arithmetic throughout (``vector``).

This module knows bytes, not models: which entries a model needs, and whether their sizes fit its
tensors, is the caller's (``pipeline.quantizing``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3lab.errors import K3LabError, printable
from k3lab.formats.gguf_header import GGUFHeaderError, NeedMore, parse

Read = Callable[[int, int], bytes]  # (offset, length) -> exactly those bytes of the file

MAX_ENTRIES = 1 << 20
MAX_NAME = 512  # bytes of an entry's name
MAX_VALUES = 1 << 34  # floats in one entry
HEADER_STEP = 1 << 20  # the first read of a GGUF imatrix; more when its header is longer
MAX_HEADER = 256 << 20
SUMS, COUNTS = ".in_sum2", ".counts"
KEYS = ("general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
# what k3lab imatrix adds (read when there): the calibration text's SHA-256 and where it came from
CALIBRATION_KEYS = ("k3lab.calibration.sha256", "k3lab.calibration.source")


class IMatrixError(K3LabError):
    """An imatrix file llama-quantize would refuse, or that is not one: one line naming it."""


@dataclass(frozen=True)
class Entry:
    """One tensor's entry: ``n`` values per expert for ``m`` experts; its sums (and, GGUF, counts)
    as (file offset, bytes); the legacy format's call count."""

    name: str
    n: int
    m: int
    sums: tuple[int, int]
    counts: tuple[int, int] | None = None
    ncall: int = 0
    sha256: str = ""  # of its sums' bytes, then its counts' (``entry_sha256``), once the whole file was read

    def proven(self, digest: str) -> Entry:
        return Entry(self.name, self.n, self.m, self.sums, self.counts, self.ncall, digest)

    @property
    def nbytes(self) -> int:
        return self.sums[1] + (self.counts[1] if self.counts else 0)

    def to_json(self) -> list:
        return [
            self.name,
            self.n,
            self.m,
            list(self.sums),
            list(self.counts) if self.counts else None,
            self.ncall,
        ] + ([self.sha256] if self.sha256 else [])

    @classmethod
    def from_json(cls, row: list) -> Entry:
        name, n, m, sums, counts, ncall, *sha = row
        return cls(str(name), int(n), int(m), (int(sums[0]), int(sums[1])),
                   (int(counts[0]), int(counts[1])) if counts else None, int(ncall),
                   str(sha[0]) if sha else "")  # fmt: skip


@dataclass
class IMatrix:
    """An imatrix file's index: every entry by tensor name, and what llama-quantize records of it."""

    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False
    size: int = 0
    calibration: tuple[str, str] = ("", "")  # k3lab's: (the text's SHA-256, its source), when recorded


def read_index(read: Read, size: int, where: str) -> IMatrix:
    """The index of the imatrix file at ``where`` (``size`` bytes, read through ``read``): its entries
    checked (names, F32, sizes that fit the file), nothing of their numbers read."""
    if size < 8:
        raise IMatrixError(f"{where}: {size} bytes: not an imatrix")
    head = read(0, 4)
    if head == b"GGUF":
        return _gguf_index(read, size, where)
    return _legacy_index(read, size, where)


def _gguf_index(read: Read, size: int, where: str) -> IMatrix:
    want = min(size, HEADER_STEP)
    while True:
        try:
            header = parse(read(0, want), keep=KEYS + CALIBRATION_KEYS, size=size, loader=True)
            break
        except NeedMore as more:
            if more.at_least > size:
                raise IMatrixError(f"{where}: ends at byte {size}, inside its header (cut short?)") from None
            if more.at_least > MAX_HEADER:
                raise IMatrixError(f"{where}: a header of over {MAX_HEADER} bytes: not an imatrix") from None
            want = min(size, max(more.at_least, 2 * want))
        except GGUFHeaderError as e:
            raise IMatrixError(f"{where}: {e}") from None
    kind = header.kvs.get("general.type")
    if kind not in (None, "imatrix"):
        raise IMatrixError(f"{where}: a GGUF of general.type {printable(str(kind))!r}, not an imatrix")
    missing = [k for k in KEYS[1:] if k not in header.kvs]
    if missing:  # (llama-quantize: "missing imatrix metadata")
        raise IMatrixError(f"{where}: an imatrix without {', '.join(missing)} (llama-quantize refuses it)")
    datasets = header.kvs["imatrix.datasets"]
    counts = {k: header.kvs[k] for k in ("imatrix.chunk_count", "imatrix.chunk_size")}
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 32:
            raise IMatrixError(f"{where}: {key} is {value!r}, not a u32")
    pairs: dict[str, dict[str, object]] = {}
    for t in header.tensors:
        for suffix in (SUMS, COUNTS):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = t
    if not pairs:
        raise IMatrixError(f"{where}: no entries (no NAME.in_sum2 and NAME.counts tensors)")
    entries = {}
    for name, pair in pairs.items():
        shown = printable(name[:80])
        if len(pair) != 2:
            raise IMatrixError(f"{where}: entry {shown}: mismatched sums and counts")
        sums, cnts = pair[SUMS], pair[COUNTS]
        if sums.type != "F32" or cnts.type != "F32":  # type: ignore[attr-defined]
            raise IMatrixError(f"{where}: entry {shown}: sums and counts must be F32")
        nval, m = math.prod(sums.ne), math.prod(cnts.ne)  # type: ignore[attr-defined]
        if m < 1 or nval < 1 or nval % m or nval > MAX_VALUES:
            raise IMatrixError(f"{where}: entry {shown}: {nval} sums for {m} counts")
        entries[name] = Entry(name, nval // m, m, (sums.offset, sums.nbytes), (cnts.offset, cnts.nbytes))  # type: ignore[attr-defined]
    return IMatrix(
        entries,
        [d for d in datasets] if isinstance(datasets, list) else [],
        counts["imatrix.chunk_count"],
        counts["imatrix.chunk_size"],
        False,
        size,
        _calibration(header.kvs),
    )


def _calibration(kvs: dict[str, object]) -> tuple[str, str]:
    """k3lab's calibration keys, when they are what k3lab writes (a SHA-256, a short source)."""
    sha, source = (kvs.get(k) for k in CALIBRATION_KEYS)
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        return ("", "")
    return (sha, printable(source[:300]) if isinstance(source, str) else "")


def _legacy_index(read: Read, size: int, where: str) -> IMatrix:
    pos = 0

    def i32(what: str) -> int:
        nonlocal pos
        if pos + 4 > size:
            raise IMatrixError(f"{where}: ends inside {what} (a truncated imatrix?)")
        value = struct.unpack("<i", read(pos, 4))[0]
        pos += 4
        return value

    n_entries = i32("the entry count")
    if not 1 <= n_entries <= MAX_ENTRIES:
        raise IMatrixError(f"{where}: not an imatrix (GGUF or legacy): {n_entries} entries")
    entries = {}
    for i in range(n_entries):
        length = i32(f"entry {i + 1}'s name")
        if not 0 <= length <= MAX_NAME or pos + length > size:
            raise IMatrixError(f"{where}: entry {i + 1}: a name of {length} bytes")
        raw = read(pos, length)
        pos += length
        name = raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")  # (read as a C string)
        ncall, nval = i32(f"entry {name}"), i32(f"entry {name}")
        if not 1 <= nval <= MAX_VALUES or pos + 4 * nval > size:
            raise IMatrixError(f"{where}: entry {printable(name[:80])}: {nval} values do not fit the file")
        entries[name] = Entry(name, nval, 1, (pos, 4 * nval), None, ncall)
        pos += 4 * nval
    chunks, datasets = 0, []
    if pos + 4 <= size:  # the optional trailer: chunk count, dataset name
        chunks = i32("the chunk count")
        if pos + 4 <= size:
            length = i32("the dataset's name")
            if 0 < length <= 1 << 16 and pos + length <= size:
                datasets = [read(pos, length).split(b"\0", 1)[0].decode("utf-8", errors="replace")]
    return IMatrix(entries, datasets, chunks, 0, True, size)


def entry_sha256(sums: bytes, counts: bytes | None) -> str:
    import hashlib

    return hashlib.sha256(sums + (counts or b"")).hexdigest()


def vector(entry: Entry, read: Read, where: str) -> np.ndarray:
    """What llama-quantize gives ggml for this entry: float32 [m * n], normalised as it normalises
    (see the module's docstring); a value that is not finite is one line (llama-quantize refuses it);
    an entry whose bytes are not the ones its ``sha256`` says (the file changed since it was read
    whole) is one line too."""
    raw_sums = read(*entry.sums)
    raw_counts = read(*entry.counts) if entry.counts is not None else None
    if entry.sha256 and entry_sha256(raw_sums, raw_counts) != entry.sha256:
        raise IMatrixError(
            f"{where}: entry {printable(entry.name)}: its bytes are not the ones read when the run began "
            "(the imatrix changed since): nothing made from it"
        )
    sums = np.frombuffer(raw_sums, dtype="<f4").astype(np.float32)
    if sums.size != entry.n * entry.m:
        raise IMatrixError(f"{where}: entry {printable(entry.name)}: read {sums.size} sums")
    if entry.counts is None:  # legacy
        out = sums / np.float32(entry.ncall) if entry.ncall > 0 else sums.copy()
    else:
        raw = np.frombuffer(raw_counts, dtype="<f4")  # type: ignore[arg-type]
        if raw.size != entry.m or not np.all(np.isfinite(raw)) or np.any(np.abs(raw) > 2.0**62):
            raise IMatrixError(f"{where}: entry {printable(entry.name)}: counts are not {entry.m} counts")
        # std::lround: halves away from zero; then the int64 as a float
        counts = (np.sign(raw) * np.floor(np.abs(raw.astype(np.float64)) + 0.5)).astype(np.float32)
        out = np.ones(entry.m * entry.n, dtype=np.float32)
        view, sums2 = out.reshape(entry.m, entry.n), sums.reshape(entry.m, entry.n)
        seen = counts > 0
        view[seen] = sums2[seen] / counts[seen, None]
    if not np.all(np.isfinite(out)):
        raise IMatrixError(f"{where}: entry {printable(entry.name)} holds a value that is not finite")
    return out


# --- writing (as llama-imatrix's save_imatrix and save_imatrix_legacy write) -------------------------


@dataclass(frozen=True)
class Sums:
    """One weight's accumulated entry to write: ``values`` float32 [m, n] (m experts, or 1), ``counts``
    [m] (how many rows each sum saw)."""

    values: np.ndarray
    counts: np.ndarray


def _padded_shape(n: int, m: int) -> tuple[int, ...]:
    """numpy order of ggml's [n, m] as gguf writes it: trailing 1s of ``ne`` not counted (ggml_n_dims)."""
    return (m, n) if m > 1 else (n,)


def gguf_kvs(
    datasets: list[str], chunk_count: int, chunk_size: int, extra: list[Any] | None = None
) -> list[Any]:
    """The keys llama-imatrix writes, in its order (then any ``extra``)."""
    from gguf import GGUFValueType

    from k3lab.formats.gguf_stream import KV

    return [
        KV("general.type", "imatrix", GGUFValueType.STRING),
        KV("imatrix.datasets", list(datasets), GGUFValueType.ARRAY, GGUFValueType.STRING),
        KV("imatrix.chunk_count", int(chunk_count), GGUFValueType.UINT32),
        KV("imatrix.chunk_size", int(chunk_size), GGUFValueType.UINT32),
        *(extra or []),
    ]


def write_gguf(path: Any, entries: dict[str, Sums], kvs: list[Any], before_commit: Any = None) -> Any:
    """The GGUF imatrix llama-imatrix writes: per weight, names sorted, ``NAME.in_sum2`` then
    ``NAME.counts`` (F32), after ``kvs`` (``gguf_kvs``); atomically (``GGUFStream``). The stream."""
    from k3lab.formats.gguf_stream import GGUFStream

    @dataclass(frozen=True)
    class _Info:
        name: str
        type: int
        shape: tuple[int, ...]
        nbytes: int

    infos, data = [], []
    for name in sorted(entries):
        e = entries[name]
        m, n = e.values.shape
        infos += [
            _Info(name + SUMS, 0, _padded_shape(n, m), 4 * m * n),
            _Info(name + COUNTS, 0, _padded_shape(1, m), 4 * m),
        ]
        data += [np.ascontiguousarray(e.values, dtype="<f4"), np.ascontiguousarray(e.counts, dtype="<f4")]
    with GGUFStream(path, None, kvs, infos, before_commit) as g:
        for info, arr in zip(infos, data):
            g.write(info.name, [arr.reshape(-1).view(np.uint8)])
    return g


def legacy_bytes(entries: dict[str, Sums], chunk_count: int, chunk_size: int, dataset: str) -> bytes:
    """The legacy ``.dat`` llama-imatrix writes (``--output-format dat``): entries whose every count is 0
    left out; per entry its sums divided by their count and times ``ncall`` (the most rows any
    expert saw, in chunks, rounded up), 1.0 where a count is 0; the chunk count; the dataset."""
    out = []
    kept = [n for n in sorted(entries) if np.any(entries[n].counts > 0)]
    out.append(struct.pack("<i", len(kept)))
    for name in kept:
        e = entries[name]
        raw = name.encode("utf-8", "surrogateescape")
        counts = e.counts.astype(np.int64)
        ncall = int((counts.max() + chunk_size - 1) // chunk_size)
        values = e.values.astype(np.float32).copy()
        per = counts.astype(np.float32)[:, None] * np.ones_like(values)
        zero = per == 0
        values[zero], per[zero] = 1.0, 1.0
        tmp = (values / per) * np.float32(ncall)
        out.append(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size))
        out.append(tmp.astype("<f4").tobytes())
    name = dataset.encode("utf-8", "surrogateescape")
    out.append(struct.pack("<ii", chunk_count, len(name)) + name)
    return b"".join(out)
