"""The imatrix stage's files: llama-imatrix's file written (GGUF, byte for byte its writer's, or the
legacy ``.dat``) with k3lab's keys (the calibration text's SHA-256 and source, the set), each step's
sums as a file of their own, an imatrix read back as sums (``--in-file``, a resumed step), and the
imatrix recorded beside the set it was made from."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.formats import imatrix as imatrix_format
from k3lab.formats.files import open_regular
from k3lab.pipeline.calibrating.sums import Entry, Sums
from k3lab.pipeline.calibrating.text import CalibrationText
from k3lab.pipeline.state import OutputFolder


def entries_from_file(path: Path | str) -> Sums:
    """An imatrix file's entries as raw sums and counts (a GGUF's as they are; a legacy ``.dat``'s as
    llama-imatrix's ``--in-file`` takes them back: times the chunk size)."""
    from k3lab.formats.files import open_regular
    from k3lab.pipeline.quantizing.imatrix_files import _pread

    fd, size = open_regular(Path(path), "imatrix")
    try:
        read = _pread(fd, Path(path))
        index = imatrix_format.read_index(read, size, str(path))
        out = Sums()
        for name, e in index.entries.items():
            values = np.frombuffer(read(*e.sums), dtype="<f4").astype(np.float32).reshape(e.m, e.n)
            if e.counts is not None:
                counts = np.frombuffer(read(*e.counts), dtype="<f4").astype(np.float64)
                counts = np.sign(counts) * np.floor(np.abs(counts) + 0.5)
            else:  # legacy: (sum / count) * ncall per value; back by the chunk size, as llama-imatrix does
                size_ = max(1, index.chunk_size or 1)
                values, counts = values * np.float32(size_), np.full(1, e.ncall * size_, dtype=np.float64)
            out.entries[name] = Entry(values, counts.astype(np.int64))
        out.datasets, out.chunk_count = list(index.datasets), index.chunk_count
        return out
    finally:
        import os

        os.close(fd)


def read_in_file(location: str) -> Sums:
    try:
        return entries_from_file(location)
    except OSError as e:
        raise K3LabError(f"--in-file {location}: cannot be read ({e.strerror or e})") from None


def _kvs(
    datasets: list[str], chunk_count: int, chunk_size: int, text: CalibrationText, body: dict[str, Any]
) -> list[Any]:
    """llama-imatrix's keys, then k3lab's: where the text came from, its SHA-256, the set."""
    from gguf import GGUFValueType

    from k3lab.formats.gguf_stream import KV

    return imatrix_format.gguf_kvs(
        datasets, chunk_count, chunk_size,
        [KV("k3lab.calibration.sha256", text.sha256, GGUFValueType.STRING),
         KV("k3lab.calibration.source", text.source, GGUFValueType.STRING),
         KV("k3lab.set", body["set"], GGUFValueType.STRING)],
    )  # fmt: skip


def write_entries(path: Path, sums: Sums, text: CalibrationText, body: dict[str, Any], n_chunks: int) -> None:
    entries = {n: imatrix_format.Sums(e.values, e.counts.astype(np.float32)) for n, e in sums.entries.items()}
    imatrix_format.write_gguf(path, entries, _kvs([text.dataset], n_chunks, body["chunk_size"], text, body))


def write_final(out: Path, total: Sums, datasets: list[str], n_chunks: int, n_ctx: int, fmt: str,
                 text: CalibrationText, body: dict[str, Any]) -> None:  # fmt: skip
    """The imatrix file: llama-imatrix's chunk count (its largest count, in chunks), its format."""
    largest = max((int(e.counts.max()) for e in total.entries.values() if e.counts.size), default=0)
    chunk_count = largest // n_ctx
    entries = {
        n: imatrix_format.Sums(e.values, e.counts.astype(np.float32)) for n, e in total.entries.items()
    }
    if fmt == "dat":
        from k3lab.pipeline.state.codec import write_atomically

        data = imatrix_format.legacy_bytes(entries, chunk_count, n_ctx, datasets[-1])
        write_atomically(out, lambda fh: fh.write(data))
        return
    imatrix_format.write_gguf(out, entries, _kvs(datasets, chunk_count, n_ctx, text, body))


def record_beside(folder: OutputFolder, out: Path) -> None:
    """The imatrix beside the set it was made from, recorded as one of the set's files (``imatrix``):
    in its manifest, published and verified with it."""
    from k3lab.formats import gguf_header
    from k3lab.pipeline.state.record import TensorRecord

    data = out.read_bytes()
    header = gguf_header.parse(data)
    tensors = [
        TensorRecord(t.name, t.type, t.ne, t.nbytes, t.offset,
                     hashlib.sha256(data[t.offset : t.offset + t.nbytes]).hexdigest())
        for t in header.tensors
    ]  # fmt: skip
    folder.records.write_single(out, "imatrix", "imatrix", header.data_start, tensors)


def file_sha(path: Path) -> str:
    from k3lab.formats.files import hash_span

    fd, size = open_regular(path, "state file", follow=False)
    try:
        with os.fdopen(os.dup(fd), "rb") as fh:
            return hash_span(fh, size)
    finally:
        os.close(fd)
