"""The finished set an imatrix is computed on, as the stage sees it: its files and their content, file
1's metadata, where every tensor is (file, offset, bytes, SHA-256), a vocabulary llama.cpp's tokenizer
loads, and a reader of tensors whose every byte is checked against its SHA-256.

Two kinds: a local folder (``local_set``: the set's plan and records, the files opened once), and a set
published on the Hub (``hub_set``: ``ORG/NAME[/FOLDER]`` at one commit; its ``MANIFEST.json`` says
where each tensor is and its SHA-256, file 1's header is fetched by ranges and checked against the
manifest's ``header_sha256``, tensors are fetched by ranges). A reader is opened from the set's
``source`` (plain values: a Dask worker opens its own), so machines that share nothing but the Hub
each read only the tensors of the steps they run.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from k3lab.errors import K3LabError
from k3lab.pipeline.state.record import TensorRecord

PIECE = 16 << 20  # bytes of a tensor fetched by one ranged read


@dataclass(frozen=True)
class SetTensor:
    """Where one tensor of the set is."""

    file: str
    record: TensorRecord


class TensorReader(Protocol):
    def read(self, name: str, into: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes (into ``into`` when given), every byte checked against its SHA-256."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LocalSource:
    """A set in a folder this process (or a worker sharing it) reads."""

    folder: str
    sizes: tuple[tuple[str, int], ...]  # (file, its recorded size)

    def open(self, tensors: dict[str, SetTensor]) -> TensorReader:
        return _LocalReader(self, tensors)


@dataclass(frozen=True)
class HubSource:
    """A set in a Hub repo at one commit (``folder``: the repo's folder it is in)."""

    repo: str
    commit: str
    sizes: tuple[tuple[str, int], ...]
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)
    folder: str = ""
    budget: float = 600.0

    def files(self) -> Any:
        from k3lab.pipeline.checking.hub_set import RepoFiles

        return RepoFiles(
            self.repo,
            self.commit,
            dict(self.sizes),
            self.endpoint,
            self.token,
            self.budget,
            folder=self.folder,
        )

    def open(self, tensors: dict[str, SetTensor]) -> TensorReader:
        from k3lab.pipeline.hub import transport

        transport.install()
        return _HubReader(self.files(), tensors, f"{self.repo}@{self.commit[:12]}")


@dataclass
class CalibrationSet:
    """A finished set, as the imatrix stage reads it (see the module's docstring)."""

    where: str  # to name it in a message
    files: dict[str, str]  # file -> its content digest
    kvs: dict[str, Any]
    tensors: dict[str, SetTensor]
    vocab: Path  # a GGUF of file 1's metadata llama.cpp's tokenizer loads
    source: LocalSource | HubSource

    @property
    def digest(self) -> str:
        """The set's identity: its files' content digests together (the same, local or on the Hub)."""
        import json

        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()

    def is_folder(self, folder: Any) -> bool:
        """Whether this is the set in ``folder`` (a local one)."""
        return isinstance(self.source, LocalSource) and Path(self.source.folder) == Path(folder.path)

    def open(self, names: list[str] | None = None) -> TensorReader:
        """A reader of these tensors (all of them by default)."""
        chosen = self.tensors if names is None else {n: self.tensors[n] for n in names}
        return self.source.open(chosen)


def _checked(name: str, where: str, data: np.ndarray, sha256: str) -> np.ndarray:
    if hashlib.sha256(data).hexdigest() != sha256:
        raise K3LabError(
            f"{where}: tensor {name}: its bytes are not the ones its record hashed (changed since?)"
        )
    return data


class _LocalReader:
    def __init__(self, source: LocalSource, tensors: dict[str, SetTensor]):
        from k3lab.formats.files import open_regular

        self.tensors = tensors
        self._fds: dict[str, int] = {}
        sizes = dict(source.sizes)
        try:
            for file in sorted({t.file for t in tensors.values()}):
                path = Path(source.folder) / file
                fd, size = open_regular(path, "GGUF file")
                self._fds[file] = fd
                if size != sizes[file]:
                    raise K3LabError(f"{path}: {size} bytes, its record says {sizes[file]} (changed since?)")
        except BaseException:
            self.close()
            raise
        self.folder = source.folder

    def read(self, name: str, into: np.ndarray | None = None) -> np.ndarray:
        t = self.tensors[name]
        rec = t.record
        buf = into if into is not None else np.empty(rec.nbytes, dtype=np.uint8)
        where = str(Path(self.folder) / t.file)
        view, at = memoryview(buf)[: rec.nbytes], 0
        while at < rec.nbytes:
            got = os.preadv(self._fds[t.file], [view[at:]], rec.offset + at)
            if got <= 0:
                raise K3LabError(
                    f"{where}: tensor {name}: the file ends inside it (cut short since it was written?)"
                )
            at += got
        return _checked(name, where, buf[: rec.nbytes], rec.sha256)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _HubReader:
    def __init__(self, files: Any, tensors: dict[str, SetTensor], where: str):
        self.files, self.tensors, self.where = files, tensors, where

    def read(self, name: str, into: np.ndarray | None = None) -> np.ndarray:
        t = self.tensors[name]
        rec = t.record
        buf = into if into is not None else np.empty(rec.nbytes, dtype=np.uint8)
        at = 0
        while at < rec.nbytes:
            data = self.files.fetch(t.file, rec.offset + at, rec.offset + min(rec.nbytes, at + PIECE))
            if not data:
                raise K3LabError(f"{self.where}: {t.file}: tensor {name}: the repo served no bytes at {at}")
            buf[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
            at += len(data)
        return _checked(name, f"{self.where}: {t.file}", buf[: rec.nbytes], rec.sha256)

    def close(self) -> None:
        """Nothing held: every read is a request of its own."""


# --- the two kinds ---


def local_set(model: Any, folder: Any) -> CalibrationSet:
    """A folder's finished set (``OutputFolder``): one line naming the first file not finished."""
    from k3lab.pipeline.state.records import content_digest

    plan = folder.plans.require(model)
    missing = [f.number for f in plan.files if not folder.records.is_complete(f.number, f.filename, f.digest)]
    if missing:
        raise K3LabError(
            f"{folder.output(plan.file(missing[0]).filename)}: not a finished file of the set ({len(missing)} of "
            f"{len(plan.files)} are not): the imatrix runs on the converted set; convert it first"
        )
    records = [folder.records.text(f.number) for f in plan.files]
    tensors = {t.name: SetTensor(rec.file, t) for rec in records for t in rec.tensors}
    return CalibrationSet(
        where=str(folder.path),
        files={rec.file: content_digest(rec) for rec in records},
        kvs={kv.key: kv.value for kv in folder.plans.kvs(plan)},
        tensors=tensors,
        vocab=folder.output(plan.file(1).filename),
        source=LocalSource(str(folder.path), tuple((rec.file, rec.size) for rec in records)),
    )


def hub_set(model: Any, repo: str, revision: str | None, endpoint: str | None, token: str | None,
            vocab: Path, budget: float = 600.0) -> CalibrationSet:  # fmt: skip
    """A set published on the Hub (``ORG/NAME`` or ``ORG/NAME/FOLDER``): its manifest, file 1's header
    (checked, its metadata read, written to ``vocab`` for the tokenizer)."""
    from k3lab.formats import gguf_header
    from k3lab.pipeline.checking.hub_set import _manifest, open_repo
    from k3lab.pipeline.checking.remote import RemoteSetError, read_header
    from k3lab.pipeline.state.records import content_digest

    files = open_repo(repo, revision, endpoint, token, budget)
    where = f"{files.repo}@{files.commit[:12]}"
    manifest = _manifest(files)
    if manifest is None:
        raise K3LabError(
            f"{where}: no MANIFEST.json: not a set k3lab published (the imatrix reads its records)"
        )
    records = sorted((r for r in manifest.records if r.is_text), key=lambda r: r.number)
    if not records or [r.number for r in records] != list(range(1, len(records) + 1)):
        raise K3LabError(f"{where}: MANIFEST.json does not list the files of one set (1 to N)")
    for r in records:
        if files.sizes.get(r.file) != r.size:
            raise K3LabError(
                f"{where}: {r.file}: {files.sizes.get(r.file)} bytes in the repo, its manifest says {r.size}"
            )
    first = records[0]
    try:
        header = read_header(first.file, first.size, files.fetch)
    except RemoteSetError as e:
        raise K3LabError(f"{where}: {e}") from None
    raw = b"".join(
        files.fetch(first.file, a, min(header.data_start, a + PIECE))
        for a in range(0, header.data_start, PIECE)
    )
    if hashlib.sha256(raw).hexdigest() != first.header_sha256:
        raise K3LabError(f"{where}: {first.file}: its header is not the one its manifest hashed")
    arch = header.fields.get("general.architecture")
    if arch != model.name:
        raise K3LabError(f"{where}: {first.file}: a {arch!r} set, not {model.name}")
    kvs = gguf_header.parse(raw, prefixes=(f"{model.name}.", "general.")).kvs
    _write_vocab(vocab, raw)
    tensors = {t.name: SetTensor(r.file, t) for r in records for t in r.tensors}
    return CalibrationSet(
        where=where,
        files={r.file: content_digest(r) for r in records},
        kvs=kvs,
        tensors=tensors,
        vocab=vocab,
        source=HubSource(
            files.repo, files.commit, tuple(files.sizes.items()), endpoint, token, files.folder, budget
        ),
    )


def _write_vocab(path: Path, header: bytes) -> None:
    """File 1's metadata as a GGUF of no tensors, what llama.cpp's vocabulary-only load reads (its
    split keys dropped: a split's file 1 would send the loader after the others)."""
    from k3lab.formats.gguf_header import parse, without_tensors
    from k3lab.pipeline.state.codec import write_atomically

    align = parse(header).kvs.get("general.alignment") or 32
    data = without_tensors(header, dropping=("split.",), align=align)
    write_atomically(path, lambda fh: fh.write(data))
