"""The output folder's one owner: the only code that names, opens, writes or deletes anything in
``OUT/`` and ``OUT/.k3lab/``.

Layout (README, "On-disk state"):
  OUT/NAME-000NN-of-000MM.gguf  finished text files (``NAME.partial`` while written)
  OUT/mmproj-*.gguf, tokenizer  single files written by ``vision`` / ``tokenizer``
  OUT/MANIFEST.json             every record merged; rebuilt from the records, plain JSON
  OUT/.k3lab/lock               held (``flock``) by the one run writing the folder: "PID TOKEN"
  OUT/.k3lab/plan.json          the plan, naming the digest of file 1's KVs (written last)
  OUT/.k3lab/kvs.json           file 1's planned metadata
  OUT/.k3lab/00001.json ...     one record per finished text file; mmproj.json, tokenizer.json
  OUT/.k3lab/scratch/           Hub downloads in flight (default ``--scratch``)

Rules, so that nothing a user has is lost and nothing k3lab wrote is taken on faith:
- Every state file (plan, KVs, records) is a first line ``k3lab-state/1 KIND SHA256`` and then JSON
  whose SHA-256 that line gives. Reading checks the line, the digest and the fields; a state file
  that is missing, malformed, tampered with, or from another plan reads as absent, and the work it
  describes is redone: never trusted, never a traceback.
- State spanning two files is written so that the last one names the other: the KVs, then the plan
  naming their digest. A plan whose KVs do not match reads as absent. An interrupt between any two
  writes leaves a folder the next run finishes.
- Files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` as ``NAME.PID.partial`` (or
  ``NAME.partial``), fsynced and renamed: never written through a symlink, a final name only ever
  holds a whole file. ``.k3lab`` itself must be a real directory.
- Deleted are only k3lab's own: ``*.partial`` regular files of its naming, nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from k3lab.errors import K3LabError, MachineError
from k3lab.formats.files import (
    PARTIAL,
    InputFileError,
    json_bytes,
    open_lock_file,
    partial_path,
    read_bounded,
    remove_regular,
    write_atomically,
)
from k3lab.formats.gguf_stream import KV, kvs_from_json, kvs_to_json
from k3lab.pipeline.model import Model
from k3lab.pipeline.planning.plan import Plan, PlanError, file_digest, kvs_digest
from k3lab.pipeline.writing.proof import identity, is_recorded_file
from k3lab.pipeline.writing.record import (
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    Published,
    Record,
    TensorRecord,
    read_manifest,
    write_manifest,
)

STATE_DIR = ".k3lab"
LOCK_NAME, PLAN_NAME, KVS_NAME, SCRATCH_NAME = "lock", "plan.json", "kvs.json", "scratch"
STATE_MAGIC = "k3lab-state/1"
MiB = 1024 * 1024
STATE_LIMITS = {"plan": 512 * MiB, "kvs": 512 * MiB, "record": 256 * MiB}
SPLIT_NAME = re.compile(r".+-\d{5}-of-\d{5}\.gguf")
_RECORD_NAME = re.compile(r"(\d{5}|[a-z][a-z0-9_-]{0,31})\.json")


class FolderBusyError(K3LabError):
    """Another run is writing this output folder."""


class FolderError(K3LabError):
    """The output folder, or a name in it, is not one k3lab may write (a symlinked ``.k3lab``, a
    ``--name`` with a path in it, an ``--out`` that is part of a split set)."""


def check_basename(name: str, flag: str = "--name") -> str:
    """A plain file-name stem: letters, digits, ``.``, ``_``, ``-``; not starting with a dot."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", name or ""):
        raise FolderError(
            f"{flag} {name!r}: give a plain name (letters, digits, '.', '_', '-'), not a path; "
            "files are written inside --out-dir"
        )
    return name


class OutputFolder:
    """``OUT/`` and its state. Cheap to make; touches the disk only when asked."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.state = self.path / STATE_DIR

    # --- names ----------------------------------------------------------------------------------
    def partial(self, name: str) -> Path:
        """Where output file ``name`` is while it is written."""
        return partial_path(self.output(name))

    def output(self, name: str) -> Path:
        """An output file in the folder (a plain name, never a path)."""
        if "/" in name or name in ("", ".", "..") or "\0" in name:
            raise FolderError(f"{name!r}: not a plain file name")
        return self.path / name

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST_NAME

    @property
    def scratch(self) -> Path:
        """Where a run's Hub downloads go unless ``--scratch`` says otherwise: the one default."""
        return self.state / SCRATCH_NAME

    # --- the folder itself ----------------------------------------------------------------------
    def create(self) -> None:
        """``OUT/`` and ``OUT/.k3lab/``, the latter a real directory (never a symlink to elsewhere)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # (then it must be a real directory: checked next)
            os.mkdir(self.state)
        self.check_state_dir()

    def check_state_dir(self) -> bool:
        """Whether ``.k3lab`` exists; one line when it is anything but a real directory."""
        try:
            st = os.lstat(self.state)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise FolderError(f"{self.state}: is {kind}; k3lab keeps its state only in a real directory here")
        return True

    # --- the lock --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, run_token: str | None = None) -> Iterator[str]:
        """Hold the folder's lock for the block; yields the run's token. With ``run_token`` (a process
        of a run that already holds it), check that the holder is that run instead of locking.

        ``flock`` locks belong to the open file: the kernel drops the lock when its holder exits,
        however it exits, so there is no stale lock to clear by hand."""
        path = self.state / LOCK_NAME
        if run_token is not None:
            self.check_held(run_token)
            yield run_token
            return
        self.create()
        fd = open_lock_file(path, "the folder's lock")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                pid, _ = self._holder()
                raise FolderBusyError(
                    f"{self.path}: another k3lab run (pid {pid}) is writing this folder; wait for it or use another --out-dir"
                ) from None
            token = uuid.uuid4().hex
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {token}\n".encode(), 0)
            yield token
        finally:
            os.close(fd)  # releases the lock

    def check_held(self, run_token: str) -> None:
        """That the run with ``run_token`` holds the lock now (a task checks before it writes)."""
        _, token = self._holder()
        if token != run_token or self._lock_is_free():
            raise FolderBusyError(
                f"{self.path}: this task's run (token {run_token[:8]}) does not hold the folder lock"
            )

    def _holder(self) -> tuple[str, str]:
        try:
            text = read_bounded(self.state / LOCK_NAME, 4096, "lock file", follow=False).decode("ascii")
        except (InputFileError, UnicodeDecodeError):
            return "?", ""
        pid, _, token = text.strip().partition(" ")
        return pid or "?", token

    def _lock_is_free(self) -> bool:
        try:
            fd = os.open(self.state / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        finally:
            os.close(fd)

    # --- writing files ---------------------------------------------------------------------------
    def write_atomically(self, path: Path, write: Callable[[BinaryIO], Any]) -> None:
        """``files.write_atomically``, with a full disk or a stranger's file in the way as one line
        naming ``path``."""
        try:
            write_atomically(path, write)
        except BaseException as e:
            raise _disk_full(e, path) from None

    def _write_state(self, name: str, kind: str, body: Any) -> Path:
        data = json_bytes(body)
        head = f"{STATE_MAGIC} {kind} {hashlib.sha256(data).hexdigest()}\n".encode()
        path = self.state / name
        self.write_atomically(path, lambda fh: fh.write(head + data))
        return path

    def _state_body(self, name: str, kind: str) -> bytes | None:
        """A state file's JSON bytes when its first line names ``kind`` and the SHA-256 of the rest;
        None when it is missing, malformed, tampered with or not a regular file."""
        try:
            data = read_bounded(self.state / name, STATE_LIMITS[kind], f"{kind} file", follow=False)
        except InputFileError:
            return None
        head, _, body = data.partition(b"\n")
        parts = head.split(b" ")
        if len(parts) != 3 or parts[0] != STATE_MAGIC.encode() or parts[1] != kind.encode():
            return None
        if hashlib.sha256(body).hexdigest().encode() != parts[2]:
            return None
        return body

    def _read_state(self, name: str, kind: str) -> Any | None:
        body = self._state_body(name, kind)
        if body is None:
            return None
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            return None

    # --- the plan and file 1's KVs ----------------------------------------------------------------
    def export_plan(self) -> dict[str, bytes]:
        """The saved plan's state files as they are on disk, for a worker with a folder of its own."""
        return {
            name: read_bounded(self.state / name, STATE_LIMITS[kind], f"{kind} file", follow=False)
            for name, kind in ((KVS_NAME, "kvs"), (PLAN_NAME, "plan"))
        }

    def import_plan(self, blobs: dict[str, bytes]) -> None:
        """Install a plan exported from another folder (KVs first), unless these very bytes are
        there; it is then loaded, and so proven, like any saved plan."""
        self.create()
        for name in (KVS_NAME, PLAN_NAME):
            try:
                same = (
                    read_bounded(self.state / name, len(blobs[name]) + 1, "state file", follow=False)
                    == blobs[name]
                )
            except InputFileError:
                same = False
            if not same:
                self.write_atomically(self.state / name, lambda fh, data=blobs[name]: fh.write(data))

    def save_plan(self, plan: Plan, kvs: list[KV]) -> Path:
        """The KVs first, then the plan naming their digest: whichever write an interrupt stops,
        the plan on disk either has its KVs or reads as absent (and is made again)."""
        self.create()
        self._write_state(KVS_NAME, "kvs", kvs_to_json(kvs))
        return self._write_state(PLAN_NAME, "plan", plan.to_json())

    def load_plan(self, model: Model) -> Plan | None:
        """The saved plan, or None when there is none or it cannot be trusted: damaged, edited (each
        file's digest is re-derived from its tensors), or its KVs are not the ones it names."""
        if not self.check_state_dir():
            return None
        data = self._read_state(PLAN_NAME, "plan")
        if data is None:
            return None
        try:
            plan = Plan.from_json(data, model)
            if any(file_digest(plan, f) != f.digest for f in plan.files) or not plan.files:
                return None
        except (K3LabError, KeyError, TypeError, ValueError, IndexError, AttributeError):
            return None
        return plan if self._kvs_body(plan) is not None else None

    def require_plan(self, model: Model, inputs_digest: str | None = None) -> Plan:
        """The saved plan, for a task or a notebook: one line when there is none (or not this run's)."""
        plan = self.load_plan(model)
        path = self.state / PLAN_NAME
        if plan is None:
            raise PlanError(f"{path}: no usable plan (`k3lab plan --out-dir` or `k3lab convert` makes it)")
        if inputs_digest is not None and plan.inputs_digest != inputs_digest:
            raise PlanError(f"{path}: the saved plan changed under this run (another run re-planned?)")
        return plan

    def _kvs_body(self, plan: Plan) -> bytes | None:
        """The KVs' JSON when it is the one the plan names: checked by digest, not parsed (a task
        that does not write file 1 never holds the 163,840-token vocabulary)."""
        body = self._state_body(KVS_NAME, "kvs")
        # the body is json_bytes(kvs_to_json(kvs)): the KV digest's canonical JSON and a newline
        if body is None or hashlib.sha256(body[:-1]).hexdigest() != plan.kvs_digest:
            return None
        return body

    def load_kvs(self, plan: Plan) -> list[KV]:
        """File 1's planned metadata, checked against the plan's digest of it."""
        body = self._kvs_body(plan)
        if body is None:
            raise PlanError(f"{self.state / KVS_NAME}: missing or not the plan's; run the command again")
        try:
            kvs = kvs_from_json(json.loads(body))
        except (ValueError, KeyError, TypeError, IndexError):
            raise PlanError(
                f"{self.state / KVS_NAME}: not file 1's metadata; run the command again"
            ) from None
        if kvs_digest(kvs) != plan.kvs_digest:  # (the same bytes, so never; but proven, not assumed)
            raise PlanError(f"{self.state / KVS_NAME}: not the plan's; run the command again")
        return kvs

    # --- records ----------------------------------------------------------------------------------
    def write_record(self, record: Record) -> Path:
        return self._write_state(record.state_name, "record", record.to_json(state=True))

    def record_single(
        self, path: Path, kind: str, key: str, data_start: int, tensors: list[TensorRecord]
    ) -> Path:
        """The record (``.k3lab/KEY.json``) of a file outside the split set (the mmproj: kind
        ``vision``; the standalone tokenizer: ``tokenizer``); then the merged manifest."""
        size = path.stat().st_size
        data_start = min(data_start, size)
        rec = Record(kind, path.name, 0, size, data_start, header_sha256(path, data_start), tensors, key=key)
        rec.identity = identity(path) or {}
        self.write_record(rec)
        return self.merge()

    def read_record(self, name: str) -> Record | None:
        data = self._read_state(name, "record")
        if data is None:
            return None
        try:
            return Record.from_json(data, str(self.state / name))
        except ManifestError:
            return None

    def text_record(self, number: int) -> Record | None:
        rec = self.read_record(f"{number:05d}.json")
        return rec if rec is not None and rec.is_text and rec.number == number else None

    def is_complete(self, number: int, filename: str, plan_digest: str) -> bool:
        """The resume test: the record is this plan's, and the file is the one it describes (its
        identity as recorded, or else every byte: ``proof``). A file proven by its bytes gets its
        new identity recorded (a copied folder is checked once)."""
        rec = self.text_record(number)
        if rec is None or rec.plan_digest != plan_digest or rec.file != filename:
            return False
        path = self.output(filename)
        if not is_recorded_file(path, rec):
            return False
        found = identity(path)
        if found is not None and found != rec.identity:
            rec.identity = found
            self.write_record(rec)
        return True

    def _record_names(self) -> list[str]:
        """The names of record files in ``.k3lab/``, in the manifest's order: text files by number
        (``00001.json`` ...), then the others (``mmproj.json``, ``tokenizer.json``)."""
        if not self.check_state_dir():
            return []
        names = [
            p.name
            for p in self.state.iterdir()
            if _RECORD_NAME.fullmatch(p.name) and p.name not in (PLAN_NAME, KVS_NAME)
        ]
        return sorted(names, key=lambda n: (not n[0].isdigit(), n))

    def _each_record(self) -> Iterator[tuple[str, Record | None]]:
        """(name, record or None when it does not read as one), one parsed at a time."""
        for name in self._record_names():
            rec = self.read_record(name)
            yield name, rec if rec is not None and rec.state_name == name else None

    def records(self) -> list[Record]:
        """Every trustworthy record in ``.k3lab/``, text files first by number, then the others."""
        return [rec for _, rec in self._each_record() if rec is not None]

    def damaged_records(self) -> list[str]:
        """Names of record files that do not read as records (for verify to report)."""
        return [name for name, rec in self._each_record() if rec is None]

    def merge(self, published: Published | None = None) -> Path:
        """Rebuild ``MANIFEST.json`` from the records, streaming (one record in memory at a time).
        ``published``: where the set was pushed, by this run (a later run's manifest says nothing of
        it: its files may have changed since)."""
        records = (rec for _, rec in self._each_record() if rec is not None)
        self.write_atomically(self.manifest, lambda fh: write_manifest(fh, records, published))
        return self.manifest

    def read_manifest(self, path: Path | None = None) -> Manifest:
        """``MANIFEST.json`` (or another manifest): its records, every field checked."""
        path = path or self.manifest
        try:
            data = read_bounded(path, MANIFEST_LIMIT, "manifest")
        except InputFileError as e:
            raise ManifestError(str(e)) from None
        return read_manifest(data, str(path))

    # --- cleaning up -------------------------------------------------------------------------------
    def retire(self, plan: Plan) -> list[str]:
        """A new plan cuts the set into other files (another split, a new version's default): the
        files of the earlier split k3lab recorded here go, with their records (a file is deleted only
        when it is the one its record describes: a user's file of that name is kept). Their names."""
        keep = {(f.number, f.filename) for f in plan.files}
        gone = []
        for name, rec in list(self._each_record()):
            if rec is None or not rec.is_text or (rec.number, rec.file) in keep:
                continue
            path = self.output(rec.file)
            if rec.file not in {f.filename for f in plan.files} and is_recorded_file(path, rec):
                remove_regular(path)
                gone.append(rec.file)
            remove_regular(self.state / name)
        return gone

    def remove_output(self, name: str) -> None:
        """Delete a finished output file once it is published (a regular file only: a symlink or
        anything else of that name is left alone)."""
        remove_regular(self.output(name))

    def remove_partials(self) -> list[Path]:
        """Delete the ``*.partial`` files a killed run left: regular files of k3lab's naming only
        (``NAME.gguf.partial`` and ``MANIFEST.json.PID.partial`` here, ``NAME.PID.partial`` in
        ``.k3lab/``), never a symlink's target. Only while holding the folder's lock."""
        found = [*self.path.glob(f"*.gguf{PARTIAL}")]
        found += [p for p in self.path.glob(f"{MANIFEST_NAME}.*{PARTIAL}") if p.name.split(".")[2].isdigit()]
        if self.check_state_dir():
            found += self.state.glob(f"*.json.*{PARTIAL}")
        return [p for p in found if remove_regular(p)]

    # --- files outside the split set ------------------------------------------------------------------
    def check_single_output(self, out: Path) -> None:
        """``vision``/``tokenizer`` may write ``out`` here: a ``.gguf`` that is not part of a split set
        (by its name, or the names its records give), the manifest or the state."""
        name = out.name
        if STATE_DIR in out.parts:
            raise FolderError(f"{out}: is inside {STATE_DIR}/, k3lab's state; write the file beside it")
        if not name.endswith(".gguf") or name.startswith("."):
            raise FolderError(f"{out}: give a file name ending in .gguf")
        taken = {r.file for r in self.records() if r.is_text}
        if SPLIT_NAME.fullmatch(name) or name in taken:
            raise FolderError(
                f"{out}: is the name of a file of a split set; give the mmproj or tokenizer its own name"
            )
        if out.is_symlink() or (out.exists() and not out.is_file()):
            raise FolderError(f"{out}: exists and is not a regular file; k3lab will not replace it")


def header_sha256(path: str | Path, data_start: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(data_start)).hexdigest()


def _disk_full(e: BaseException, path: Path) -> BaseException:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return MachineError(f"{path}: no space left on the device; nothing was kept of it")
    if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ELOOP):
        return FolderError(f"{path}: a file k3lab did not make is in the way ({e.strerror}); remove it")
    return e


WORKER_DIR = "k3lab"  # in a Dask worker's local directory


def worker_folders(local_directory: str | os.PathLike, plan_digest: str) -> tuple[Path, Path]:
    """A Dask worker's own output folder and scratch, for a run that shares nothing but the Hub:
    ``<local directory>/k3lab/out-<plan digest>/`` and ``<local directory>/k3lab/scratch/``."""
    root = Path(local_directory) / WORKER_DIR
    return root / f"out-{plan_digest[:16]}", root / SCRATCH_NAME
