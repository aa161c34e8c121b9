"""GGUF imatrix files written byte by byte, sound or broken on purpose (a key twice, a tensor twice, five
dimensions, cut short, dataset names of any bytes), to hold k3lab's reading to ``llama-quantize``'s.
The entries are taken from a real imatrix (llama-imatrix's, in tests/data) through gguf-py's reader."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

STRING, ARRAY, U32 = 8, 9, 4
F32 = 0
ALIGN = 32


@dataclass
class Crafted:
    kvs: list[tuple[bytes, int, bytes]] = field(default_factory=list)  # (key, type, encoded value)
    tensors: list[tuple[bytes, list[int], bytes]] = field(default_factory=list)  # (name, ne, F32 data)

    def kv_u32(self, key: str, value: int) -> None:
        self.kvs.append((key.encode(), U32, struct.pack("<I", value)))

    def kv_strings(self, key: str, items: list[bytes]) -> None:
        body = struct.pack("<IQ", STRING, len(items)) + b"".join(struct.pack("<Q", len(s)) + s for s in items)
        self.kvs.append((key.encode(), ARRAY, body))

    def kv_string(self, key: str, value: bytes) -> None:
        self.kvs.append((key.encode(), STRING, struct.pack("<Q", len(value)) + value))

    def tensor(self, name: str, values: np.ndarray, ne: list[int] | None = None) -> None:
        data = np.ascontiguousarray(values, dtype="<f4")
        self.tensors.append((name.encode(), ne or list(reversed(data.shape)), data.tobytes()))

    def to_bytes(self) -> bytes:
        out = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors), len(self.kvs))]
        for key, vtype, body in self.kvs:
            out.append(struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + body)
        offset = 0
        for name, ne, data in self.tensors:
            out.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(ne)))
            out.append(struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", F32, offset))
            offset += len(data) + -len(data) % ALIGN
        head = b"".join(out)
        blob = [head, b"\0" * (-len(head) % ALIGN)]
        for _, _, data in self.tensors:
            blob += [data, b"\0" * (-len(data) % ALIGN)]
        return b"".join(blob)


def from_imatrix(path: Path, datasets: list[bytes] | None = None) -> Crafted:
    """A crafted copy of a real GGUF imatrix: its entries, its chunk keys, ``datasets`` (default: its own)."""
    reader = gguf.GGUFReader(path)
    made = Crafted()
    own = [bytes(reader.fields["imatrix.datasets"].parts[i]) for i in reader.fields["imatrix.datasets"].data]
    made.kv_string("general.type", b"imatrix")
    made.kv_strings("imatrix.datasets", own if datasets is None else datasets)
    made.kv_u32("imatrix.chunk_count", int(reader.fields["imatrix.chunk_count"].contents()))
    made.kv_u32("imatrix.chunk_size", int(reader.fields["imatrix.chunk_size"].contents()))
    for t in reader.tensors:
        made.tensor(t.name, np.asarray(t.data), [int(n) for n in t.shape])
    return made
