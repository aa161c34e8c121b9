"""The records in ``OUT/.k3lab/`` (one per finished file: ``00001.json`` ..., ``mmproj.json``,
``tokenizer.json``), the resume test they back, and ``MANIFEST.json``, every record merged.

Files before their records, records before the manifest: an interrupt between any two writes leaves
a folder the next run finishes. A record that does not read as one (damaged, edited, another
version's) counts as absent: its file is redone, and ``verify`` reports it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from k3lab.formats.files import InputFileError, read_bounded, remove_regular
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.state.codec import read_state, write_atomically, write_state
from k3lab.pipeline.state.names import record_names, text_record_name
from k3lab.pipeline.state.proof import header_sha256, identity, is_recorded_file
from k3lab.pipeline.state.record import (
    MANIFEST_LIMIT,
    Manifest,
    ManifestError,
    Published,
    Record,
    TensorRecord,
    read_manifest,
    write_manifest,
)


def content_digest(rec: Record) -> str:
    """What a recorded file holds, in one SHA-256: its header's and every tensor's (a file made from
    it records this, so a file made again with other bytes makes it stale)."""
    rows = [f"{rec.file}\0{rec.size}\0{rec.header_sha256}"]
    rows += [f"{t.name}\0{t.offset}\0{t.sha256}" for t in rec.tensors]
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


class Folder(Protocol):
    """What records need of their folder (``folder.OutputFolder``)."""

    state: Path

    @property
    def manifest(self) -> Path: ...

    def output(self, name: str) -> Path: ...

    def create(self) -> None: ...

    def check_state_dir(self) -> bool: ...


class Records:
    def __init__(self, folder: Folder):
        self.folder = folder

    def write(self, record: Record) -> Path:
        self.folder.create()
        return write_state(self.folder.state / record.state_name, "record", record.to_json(state=True))

    def write_single(
        self, path: Path, kind: str, key: str, data_start: int, tensors: list[TensorRecord]
    ) -> Path:
        """The record (``.k3lab/KEY.json``) of a file beside the split set (the mmproj: kind
        ``vision``; the standalone tokenizer: ``tokenizer``); then the merged manifest."""
        size = path.stat().st_size
        data_start = min(data_start, size)
        rec = Record(kind, path.name, 0, size, data_start, header_sha256(path, data_start), tensors, key=key)
        rec.identity = identity(path) or {}
        self.write(rec)
        return self.merge()

    def read(self, name: str) -> Record | None:
        data = read_state(self.folder.state / name, "record")
        if data is None:
            return None
        try:
            return Record.from_json(data, str(self.folder.state / name))
        except ManifestError:
            return None

    def text(self, number: int) -> Record | None:
        rec = self.read(text_record_name(number))
        return rec if rec is not None and rec.is_text and rec.number == number else None

    def is_complete(
        self, number: int, filename: str, plan_digest: str, made_from: Record | None = None
    ) -> bool:
        """The resume test: the record is this plan's, and the file is the one it describes (its
        identity as recorded, or else every byte: ``proof``). A file proven by its bytes gets its
        new identity recorded (a copied folder is checked once). ``made_from``: the record of the
        file it is made from (a variant's: the set's file), which must be the one it read then."""
        rec = self.text(number)
        if rec is None or rec.plan_digest != plan_digest or rec.file != filename:
            return False
        if made_from is not None and (rec.read.get(made_from.file) or {}).get("sha256") != content_digest(
            made_from
        ):
            return False
        path = self.folder.output(filename)
        if not is_recorded_file(path, rec):
            return False
        found = identity(path)
        if found is not None and found != rec.identity:
            rec.identity = found
            self.write(rec)
        return True

    def _each(self) -> Iterator[tuple[str, Record | None]]:
        """(name, record or None when it does not read as one), one parsed at a time."""
        if not self.folder.check_state_dir():
            return
        for name in record_names(self.folder.state):
            rec = self.read(name)
            yield name, rec if rec is not None and rec.state_name == name else None

    def all(self) -> list[Record]:
        """Every trustworthy record, text files first by number, then the others."""
        return [rec for _, rec in self._each() if rec is not None]

    def damaged(self) -> list[str]:
        """Names of record files that do not read as records (for verify to report)."""
        return [name for name, rec in self._each() if rec is None]

    def merge(self, published: Published | None = None, made_as: str = "") -> Path:
        """Rebuild ``MANIFEST.json`` from the records, streaming (one record in memory at a time).
        ``published``: where the set was pushed, by this run (a later run's manifest says nothing of
        it: its files may have changed since); ``made_as``: a variant's command."""
        records = (rec for _, rec in self._each() if rec is not None)
        write_atomically(self.folder.manifest, lambda fh: write_manifest(fh, records, published, made_as))
        return self.folder.manifest

    def manifest(self, path: Path | None = None) -> Manifest:
        """``MANIFEST.json`` (or another manifest): its records, every field checked."""
        path = path or self.folder.manifest
        try:
            data = read_bounded(path, MANIFEST_LIMIT, "manifest")
        except InputFileError as e:
            raise ManifestError(str(e)) from None
        return read_manifest(data, str(path))

    def retire(self, plan: Plan | Any) -> list[str]:
        """A new plan cuts the set into other files (another split, a new version's default; a
        variant's plan: its set's files): the files of the earlier split k3lab recorded here go, with
        their records (a file is deleted only when it is the one its record describes: a user's file
        of that name is kept). Their names."""
        keep = {(f.number, f.filename) for f in plan.files}
        names = {f.filename for f in plan.files}
        gone = []
        for name, rec in list(self._each()):
            if rec is None or not rec.is_text or (rec.number, rec.file) in keep:
                continue
            path = self.folder.output(rec.file)
            if rec.file not in names and is_recorded_file(path, rec):
                remove_regular(path)
                gone.append(rec.file)
            remove_regular(self.folder.state / name)
        return gone
