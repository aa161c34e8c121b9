"""``OutputFolder``: ``OUT/`` and ``OUT/.k3lab/``, the handle the state's parts hang on (``lock``,
``plans``, ``records``), and what it alone creates and deletes.

Rules, so that nothing a user has is lost and nothing k3lab wrote is taken on faith:
- every file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` as ``NAME.PID.partial`` (or
  ``NAME.partial``), fsynced and renamed: never written through a symlink, a final name only ever
  holds a whole file; ``.k3lab`` itself must be a real directory;
- deleted are only k3lab's own: ``*.partial`` regular files of its naming, files its records prove
  it wrote, nothing else.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

from k3lab.formats.files import PARTIAL, partial_path, remove_regular
from k3lab.formats.gguf_stream import KV
from k3lab.pipeline.planning.plan import Plan
from k3lab.pipeline.state.lock import FolderLock
from k3lab.pipeline.state.names import (
    KVS_NAME,
    LOCK_NAME,
    PLAN_NAME,
    SCRATCH_NAME,
    STATE_DIR,
    FolderError,
    plain_name,
    record_names,
)
from k3lab.pipeline.state.plans import Plans, VariantPlans
from k3lab.pipeline.state.record import MANIFEST_NAME
from k3lab.pipeline.state.records import Records


class OutputFolder:
    """``OUT/`` and its state. Cheap to make; touches the disk only when asked."""

    def __init__(self, path: str | os.PathLike, within: OutputFolder | None = None):
        self.path = Path(path)
        self.state = self.path / STATE_DIR
        self.within = within  # a variant's folder: the set's, which it must be inside, as a real directory

    @cached_property
    def lock(self) -> FolderLock:
        return FolderLock(self.path, self.state / LOCK_NAME)

    @cached_property
    def plans(self) -> Plans:
        return Plans(self.state, self.create, self.check_state_dir)

    @cached_property
    def records(self) -> Records:
        return Records(self)

    @cached_property
    def variant_plan(self) -> VariantPlans:
        """A variant folder's plan (this folder is ``OUT/LABEL``)."""
        return VariantPlans(self.state, self.create, self.check_state_dir)

    def variant(self, label: str) -> OutputFolder:
        """The folder of this set's variant ``label`` (``OUT/LABEL``: a plain name, never a path)."""
        if label.startswith(".") or label == STATE_DIR:
            raise FolderError(f"{label!r}: not a variant's name")
        return OutputFolder(self.path / plain_name(label), within=self)

    # --- a set and its variants, together ---------------------------------------------------------
    def variant_file_complete(self, label: str, number: int, filename: str, digest: str) -> bool:
        """File ``number`` of variant ``label`` is the one its record describes, made by its plan
        from the set's file ``number`` as that file is recorded now (a set file converted again, from
        a source that changed, makes the variant files made from it stale)."""
        made_from = self.records.text(number)
        return made_from is not None and self.variant(label).records.is_complete(
            number, filename, digest, made_from
        )

    def variant_plans(self, labels: tuple[str, ...]) -> dict[str, Any]:
        """Each variant's saved plan (its command: what its manifest says it was made as; its digest:
        what every task checks)."""
        return {v: vp for v in labels if (vp := self.variant(v).variant_plan.load())}

    def variant_commands(self, labels: tuple[str, ...]) -> dict[str, str]:
        """Each planned variant's command (what its manifest says it was made as)."""
        return {v: vp.made_as() for v, vp in self.variant_plans(labels).items()}

    def keep_record(self, record: Any, label: str | None = None) -> None:
        """A file's record, in the set's state (``label`` None) or in variant ``label``'s."""
        (self if label is None else self.variant(label)).records.write(record)

    def merge_manifests(self, convert: bool, labels: tuple[str, ...], published: Any = None) -> None:
        """The set's ``MANIFEST.json`` (when this run converted) and each variant's, from the records."""
        if convert:
            self.records.merge(published)
        commands = self.variant_commands(labels)
        for label in labels:
            self.variant(label).records.merge(made_as=commands.get(label, ""))

    def exported_plans(self, labels: tuple[str, ...]) -> dict[str, str]:
        """The set's saved plan and its variants' plans, as text (workers that share no folder)."""
        state = self.plans.export()
        return state | {f"{v}/variant": self.variant(v).variant_plan.export() for v in labels}

    # --- names ----------------------------------------------------------------------------------
    def output(self, name: str) -> Path:
        """An output file in the folder (a plain name, never a path)."""
        return self.path / plain_name(name)

    def partial(self, name: str) -> Path:
        """Where output file ``name`` is while it is written."""
        return partial_path(self.output(name))

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST_NAME

    @property
    def scratch(self) -> Path:
        """Where a run's Hub downloads go unless ``--scratch`` says otherwise: the one default."""
        return self.state / SCRATCH_NAME

    # --- the folder itself ----------------------------------------------------------------------
    def create(self) -> None:
        """``OUT/`` and ``OUT/.k3lab/``, the latter a real directory (never a symlink to elsewhere);
        a variant's ``OUT/LABEL/`` too."""
        if self.within is not None:
            self.within.path.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # (then it must be a real directory: checked next)
                os.mkdir(self.path)
            self._check_real()
        else:
            self.path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # (then it must be a real directory: checked next)
            os.mkdir(self.state)
        self.check_state_dir()

    def _check_real(self) -> None:
        """A variant's folder is a real directory of the set's folder: k3lab never writes elsewhere
        through a link."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise FolderError(
                f"{self.path}: is {kind}; a variant's folder is a real directory inside its set's folder"
            )

    def check_state_dir(self) -> bool:
        """Whether ``.k3lab`` exists; one line when it is anything but a real directory (or, a
        variant's, its folder is not)."""
        if self.within is not None:
            self._check_real()
        try:
            st = os.lstat(self.state)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise FolderError(f"{self.state}: is {kind}; k3lab keeps its state only in a real directory here")
        return True

    def hold(self, run_token: str | None = None) -> contextlib.AbstractContextManager[str]:
        """The folder's lock for a block (made first when this run takes it)."""
        if run_token is None:
            self.create()
        return self.lock.hold(run_token)

    @contextlib.contextmanager
    def begin(
        self, plan: Plan, kvs: list[KV] | None, run_token: str | None = None
    ) -> Iterator[tuple[str, list[str]]]:
        """The folder held for a run of ``plan``: its lock (or, with ``run_token``, the check that
        this run holds it), the plan saved when it is new (``kvs``: file 1's metadata) and the files
        of an earlier split it replaces retired, what a killed run left removed. Yields the run's
        token and the names retired. A run that made ``.k3lab`` and fails or is stopped with no
        file finished (the block raises) removes what it made, ``OUT/`` too when it made that: nothing is left behind."""
        made = [p for p in (self.path, self.state, self.manifest) if not os.path.lexists(p)]
        with self.hold(run_token) as token:
            try:
                gone: list[str] = []
                if kvs is not None:
                    self.plans.save(plan, kvs)
                    gone = self.records.retire(plan)
                if run_token is None:
                    self.remove_partials()
                yield token, gone
            except BaseException:
                if run_token is None and self.state in made:
                    self._unmake(made)
                raise

    def _unmake(self, made: list[Path]) -> None:
        """Remove what this run made when it finished no file: its plan, its lock, an empty scratch
        folder and a manifest of no records (regular files only), then the folders if empty (a
        scratch download in progress, or anything else put there, keeps them)."""
        if record_names(self.state) or any(self.path.glob("*.gguf")):
            return
        for name in (PLAN_NAME, KVS_NAME, LOCK_NAME):
            remove_regular(self.state / name)
        if self.manifest in made:
            remove_regular(self.manifest)
        for folder in (self.scratch, self.state, *(p for p in made if p == self.path)):
            with contextlib.suppress(OSError):
                os.rmdir(folder)

    # --- cleaning up ------------------------------------------------------------------------------
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
