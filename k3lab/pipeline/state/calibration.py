"""The imatrix stage's state in a set's folder: ``OUT/.k3lab/imatrix/``, what a run needs to resume a
step (a layer) at a time:

    plan.json             what the run computes: the set (its plan and its files' content), the text's
                          SHA-256, the chunks, the options, the steps; a run of another plan clears the rest
    tokens.i32            the chunks' tokens, [chunks, chunk size] int32
    STEP-NAME.f32         an array the step wrote for every chunk ([chunks, tokens, width] float32): the
                          residual stream ``x`` (``x.K``: written by step K, removed once step K+1 is done)
                          and each AttnRes checkpoint ``bank.IL``
    step-K.json           step K finished: its arrays' and its entries' SHA-256 and identity
    step-K.gguf           step K's sums, an imatrix of its own weights (llama-imatrix's format)
    vocab.gguf            a set on the Hub: file 1's metadata (its header, no tensors) for the tokenizer

Every file is written as ``NAME.partial`` (created new, never through a symlink), fsynced, renamed;
a step's record is written last. A file whose record does not prove it (identity, else its bytes) is
absent: the step is made again. Nothing here outlives a finished run but ``plan.json`` and ``done.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.formats.files import PARTIAL, hash_span, open_regular, partial_path, remove_regular
from k3lab.pipeline.state.codec import read_state, write_state
from k3lab.pipeline.state.names import STATE_DIR, FolderError
from k3lab.pipeline.state.proof import identity

DIR = "imatrix"
_OWN = re.compile(
    r"(plan|done|step-\d{3,5})\.json|tokens\.i32|vocab\.gguf|step-\d{3,5}\.gguf|[a-z][a-z0-9_]*(\.\d+)?\.\d{3,5}\.f32"
)


class ArrayWriter:
    """One state array, chunk after chunk, into ``NAME.partial``; ``finish`` fsyncs, renames, and
    gives its SHA-256."""

    def __init__(self, path: Path):
        self.path, self.partial = path, partial_path(path)
        remove_regular(self.partial)
        try:
            self.fd = os.open(
                self.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )
        except FileExistsError:
            raise FolderError(
                f"{self.partial}: exists and is not k3lab's (a symlink?): not written through"
            ) from None
        self.sha = hashlib.sha256()

    def write(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, dtype=np.float32).reshape(-1).view(np.uint8)
        self.sha.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def finish(self) -> str:
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.partial, self.path)
        return self.sha.hexdigest()

    def abandon(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        remove_regular(self.partial)


class CalibrationState:
    """``OUT/.k3lab/imatrix/`` (see the module's docstring)."""

    def __init__(self, state_dir: Path):
        self.dir = state_dir / DIR
        if state_dir.name != STATE_DIR:
            raise FolderError(f"{state_dir}: not a .k3lab folder")

    def make(self) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.dir)
        if self.dir.is_symlink() or not self.dir.is_dir():
            raise FolderError(f"{self.dir}: not a real directory; k3lab keeps its state only in one")

    def path(self, name: str) -> Path:
        if not _OWN.fullmatch(name):
            raise FolderError(f"{name!r}: not a name of the imatrix state")
        return self.dir / name

    # --- the plan and the records (state files) ---
    def plan(self) -> dict[str, Any] | None:
        return read_state(self.dir / "plan.json", "imatrix") if self.dir.is_dir() else None

    def save_plan(self, plan: dict[str, Any]) -> None:
        self.make()
        write_state(self.path("plan.json"), "imatrix", plan)

    def record(self, name: str) -> dict[str, Any] | None:
        return read_state(self.path(name), "imatrix") if self.dir.is_dir() else None

    def write_record(self, name: str, body: dict[str, Any]) -> None:
        write_state(self.path(name), "imatrix", body)

    # --- arrays ---
    def writer(self, name: str) -> ArrayWriter:
        return ArrayWriter(self.path(name))

    def proven(self, name: str, sha256: str, ident: dict[str, int]) -> bool:
        """Whether the file is the one recorded: its identity, else every byte hashed."""
        path = self.path(name)
        found = identity(path)
        if found is None:
            return False
        if found == ident:
            return True
        fd, size = open_regular(path, "state file", follow=False)
        try:
            with os.fdopen(os.dup(fd), "rb") as fh:
                return hash_span(fh, size) == sha256
        finally:
            os.close(fd)

    def chunk(self, name: str, index: int, shape: tuple[int, ...]) -> np.ndarray:
        """Chunk ``index`` of an array file ([chunks, *shape] float32)."""
        n = int(np.prod(shape)) * 4
        fd, size = open_regular(self.path(name), "state file", follow=False)
        try:
            data = os.pread(fd, n, index * n)
        finally:
            os.close(fd)
        if len(data) != n:
            raise FolderError(
                f"{self.path(name)}: ends before chunk {index} (cut short since it was written?)"
            )
        return np.frombuffer(data, dtype=np.float32).reshape(shape)

    def identity(self, name: str) -> dict[str, int]:
        return identity(self.path(name)) or {}

    def remove(self, name: str) -> None:
        remove_regular(self.path(name))

    def clear(self, keep: tuple[str, ...] = ()) -> None:
        """Every file of the state k3lab made (by its name, regular files only), but ``keep``."""
        if not self.dir.is_dir():
            return
        for p in self.dir.iterdir():
            base = p.name[: -len(PARTIAL)] if p.name.endswith(PARTIAL) else p.name
            if _OWN.fullmatch(base) and base not in keep:
                remove_regular(p)
