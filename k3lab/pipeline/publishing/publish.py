"""Publishing a set to a Hugging Face repo from wherever its files are made.

- ``open_target`` makes the repo (and branch) if missing and reads what it holds: every file's
  SHA-256 (one ``model_info`` call) and its ``MANIFEST.json``. A repo holding another set (split
  files this plan does not make: another name, type or count) is refused, one line, unless ``force``
  (then this set replaces it, the other's files deleted in the same commits). A file of this set
  made from other inputs (the source moved) is stale: it is made again and replaced.
- ``published`` is the resume test: the repo's record of a file carries this plan's digest and its
  SHA-256 is the file's in the repo. Such a file is neither converted nor uploaded again.
- ``upload`` runs in the task, on the machine that made the file: huggingface_hub's
  ``preupload_lfs_files`` sends its bytes to LFS storage (no commit yet; a blob the Hub already
  has is not sent again), retried within the same budget as downloads. The task returns the
  uploaded operation (no bytes: huggingface_hub frees them) and the record, with the file's SHA-256.
- ``Committer`` (on the client) commits the uploaded files as they arrive, one commit per batch (at
  most every ``every`` seconds), each with the repo's ``MANIFEST.json`` brought up to date, so a
  killed run keeps what was committed (and one that uploaded nothing commits nothing); the last
  commit also adds the extra files (the model card, ``TENSOR_MAP.md``).

``HF_TOKEN`` travels in memory only (``PushTarget.token``): never written, never shown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.hashing import git_blob_hash
from k3lab.pipeline.hub.retry import with_retries
from k3lab.pipeline.publishing.card import EXTRA_NAMES, extra_files
from k3lab.pipeline.publishing.upload import PushTarget, upload
from k3lab.pipeline.state.record import (
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    ManifestError,
    Published,
    Record,
    manifest_bytes,
    read_manifest,
)

COMMIT_EVERY = 300.0  # seconds between two commits of a run (a killed run keeps what was committed)


class _NoEmptyCommitNote(logging.Filter):
    """huggingface_hub's "No files have been modified ... Skipping" is k3lab's own decision to make
    (and say): not a line on the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No files have been modified")


logging.getLogger("huggingface_hub.hf_api").addFilter(_NoEmptyCommitNote())


class PublishError(K3LabError):
    """The target repo cannot take this set (it holds another one): one line, exit 2."""


@dataclass
class RepoState:
    """What the target repo holds at its branch."""

    commit: str
    files: dict[str, str]  # path -> SHA-256 (LFS) or "git-<blob id>"
    records: dict[str, Record]  # file name -> its record in the repo's MANIFEST.json
    made: dict[str, str] = field(default_factory=dict)  # files besides the set k3lab made -> their oid
    variants: dict[str, dict[str, Record]] = field(default_factory=dict)  # LABEL -> LABEL/MANIFEST.json's
    made_as: dict[str, str] = field(default_factory=dict)  # LABEL -> its llama-quantize command

    def theirs(self, name: str) -> bool:
        """Whether the repo's ``name`` is a file k3lab did not make (a user's own README.md)."""
        return name in self.files and self.files[name] != self.made.get(name)


def open_target(target: PushTarget, planned: dict[str, str], force: bool = False) -> RepoState:
    """Make the repo and branch if missing and read what they hold; ``planned``: file name -> digest
    of every file this set has. Refuses a repo holding another set unless ``force``."""
    api = target.api()
    budget = target.retry_budget
    with_retries(
        f"{target.repo}: create",
        lambda: api.create_repo(target.repo, private=target.private, exist_ok=True),
        budget,
    )
    if target.branch != "main":
        with_retries(
            target.where("create branch"),
            lambda: api.create_branch(target.repo, branch=target.branch, exist_ok=True),
            budget,
        )
    state = read_repo(target)
    if not force:
        for rec in state.records.values():
            if rec.is_text and rec.file not in planned:
                raise PublishError(
                    f"{target.where(rec.file)}: the repo holds another set (split files this plan does not "
                    "make); give --force to replace it, or push to another repo or --push-branch"
                )
    return state


def read_repo(target: PushTarget) -> RepoState:
    """The branch's commit, every file's SHA-256 and the records of its ``MANIFEST.json`` (read by a
    ranged GET of exactly the size the Hub lists, parsed with bounded depth: a stranger's repo may
    hold anything)."""
    api = target.api()
    info = with_retries(
        target.where(),
        lambda: api.model_info(target.repo, revision=target.branch, files_metadata=True),
        target.retry_budget,
    )
    files = {
        s.rfilename: (s.lfs.sha256 if s.lfs is not None else f"git-{s.blob_id}") for s in info.siblings or []
    }
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    records: dict[str, Record] = {}
    made: dict[str, str] = {}
    variants: dict[str, dict[str, Record]] = {}
    made_as: dict[str, str] = {}
    for path in sorted(p for p in files if p.endswith(MANIFEST_NAME) and p.count("/") <= 1)[:MAX_VARIANTS]:
        man = _repo_manifest(target, info.sha, path, sizes[path])
        if path == MANIFEST_NAME:
            records = {r.file: r for r in man.records}
            made = man.published.made if man.published is not None else {}
        else:
            variants[path.split("/")[0]] = {r.file: r for r in man.records}
            made_as[path.split("/")[0]] = man.made_as
    return RepoState(info.sha, files, records, made, variants, made_as)


MAX_VARIANTS = 64  # variant folders (LABEL/MANIFEST.json) a repo's state reads


def _repo_manifest(target: PushTarget, commit: str, path: str, size: int) -> Any:
    """A manifest of the repo (``MANIFEST.json`` or a variant's ``LABEL/MANIFEST.json``), read by a
    ranged GET of exactly its listed size and parsed with bounded depth."""
    from k3lab.pipeline.hub import transport  # (here: a run that publishes nothing never imports it)

    where = target.where(path)
    if size > MANIFEST_LIMIT:
        raise PublishError(f"{where}: {size} bytes, larger than any k3lab manifest")
    url = transport.file_url(target.repo, path, commit, target.endpoint)
    raw = with_retries(where, lambda: transport.fetch_range(url, 0, size, size, target.token, where), target.retry_budget)  # fmt: skip
    try:
        return read_manifest(raw, where)
    except ManifestError as e:
        raise PublishError(f"{where}: not a k3lab manifest ({e})") from None


def published(
    state: RepoState, filename: str, digest: str | None, number: int | None = None, label: str = ""
) -> Record | None:
    """The repo's record of ``filename`` (output file ``number``; of variant ``label``, in its folder)
    when the repo holds exactly that file of this plan."""
    rec = (state.variants.get(label, {}) if label else state.records).get(filename)
    path = f"{label}/{filename}" if label else filename
    if rec is None or not rec.sha256 or state.files.get(path) != rec.sha256:
        return None
    if number is not None and rec.number != number:
        return None
    if digest is not None and rec.plan_digest != digest:
        return None
    return rec


RACES = 5  # commits tried when the branch keeps moving between reading it and committing


class _HeadMoved(K3LabError):
    """The branch moved since the repo was read (the Hub answered 412 to our parent commit)."""


class Committer:
    """Commits uploaded files as they arrive: a batch at a time, with the repo's manifest. A commit
    that carries files beside the set (the card) is made on the branch's head as read just before,
    so a file a collaborator committed meanwhile (their README.md) is seen, and kept."""

    def __init__(
        self,
        target: PushTarget,
        state: RepoState,
        every: float = COMMIT_EVERY,
        stale: tuple[str, ...] = (),
        force: bool = False,
    ):
        self.target, self.state, self.every, self.force = target, state, every, force
        # what k3lab made beside the set, kept in the state its ``theirs`` reads (updated as it commits)
        state.made = dict(state.made)
        self.made: dict[str, str] = state.made
        self.records: dict[str, Record] = dict(state.records)
        self.variants: dict[str, dict[str, Record]] = {k: dict(v) for k, v in state.variants.items()}
        self.touched: set[str] = set()  # the variants this run adds files to (their manifests are committed)
        self.made_as: dict[str, str] = dict(state.made_as)
        self.pending: list[Any] = []
        self.stale = list(stale)  # files of another set to delete (--force)
        self.last = time.monotonic()
        self.commits: list[str] = []
        self.uploaded = 0

    def add(self, op: Any, record: Record, label: str = "") -> None:
        """An uploaded file (``op``; None: the repo holds it already) and its record; ``label``: a
        variant's, in its folder."""
        if label:
            self.variants.setdefault(label, {})[record.file] = record
            self.touched.add(label)
        else:
            self.records[record.file] = record
        if op is not None:
            self.pending.append(op)
            self.uploaded += 1
        if time.monotonic() - self.last >= self.every:
            self.commit()

    def manifest(self) -> bytes:
        recs = sorted(self.records.values(), key=lambda r: (not r.is_text, r.number, r.file))
        return manifest_bytes(recs, Published(self.target.repo, self.target.branch, self.made))

    def commit(self, extra: dict[str, bytes] | None = None, message: str = "") -> str | None:
        """One commit of what is pending (with the manifest, and ``extra`` files); None if nothing.
        An extra file the repo holds that k3lab did not make (a user's README.md) is kept, unless
        ``force``."""
        self.last = time.monotonic()
        for _ in range(RACES):
            if extra:  # the repo as it is now: a collaborator may have committed a README meanwhile
                fresh = read_repo(self.target)
                self.state.commit, self.state.files = fresh.commit, fresh.files
            try:
                return self._commit(extra or {}, message)
            except _HeadMoved:
                continue  # another commit landed between the read and ours: read again
        raise PublishError(
            f"{self.target.where('commit')}: the branch kept moving under {RACES} attempts to commit; run again"
        )

    def _commit(self, extra: dict[str, bytes], message: str) -> str | None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete
        from huggingface_hub.errors import HfHubHTTPError

        if not (extra or self.pending or self.stale or self.records or any(self.variants.values())):
            return None
        extra = {k: v for k, v in extra.items() if self.force or not self.state.theirs(k)}
        self.made.update({name: f"git-{git_blob_id(data)}" for name, data in extra.items()})
        regular = {MANIFEST_NAME: self.manifest(), **self._variant_manifests(), **extra}
        if (
            not self.pending
            and not self.stale
            and all(
                self.state.files.get(name) == f"git-{git_blob_id(data)}" for name, data in regular.items()
            )
        ):
            return None  # the repo holds all of it already: no empty commit
        ops: list[Any] = list(self.pending)
        ops += [CommitOperationDelete(p) for p in self.stale]
        ops += [CommitOperationAdd(name, data) for name, data in regular.items()]
        files = sum(1 for op in self.pending)
        summary = (
            message or f"k3lab: {files} file{'s' if files != 1 else ''} of {self.target.repo.split('/')[-1]}"
        )
        api = self.target.api()
        parent = self.state.commit if extra else None  # (the Hub refuses it if the branch moved: 412)

        def create() -> Any:
            try:
                return api.create_commit(
                    self.target.repo,
                    operations=ops,
                    commit_message=summary,
                    revision=self.target.branch,
                    parent_commit=parent,
                )
            except HfHubHTTPError as e:
                if parent and getattr(e.response, "status_code", None) == 412:
                    raise _HeadMoved() from None
                raise

        info = with_retries(self.target.where("commit"), create, self.target.retry_budget)
        for op in self.pending:
            self.state.files[op.path_in_repo] = op.upload_info.sha256.hex()
        for path in self.stale:
            self.state.files.pop(path, None)
        self.pending, self.stale = [], []
        self.commits.append(info.oid)
        self.state.commit = info.oid
        self.state.files.update({name: f"git-{git_blob_id(data)}" for name, data in regular.items()})
        return info.oid

    def variant_table(self) -> dict[str, tuple[list[Record], str]]:
        """Every variant the repo will hold: its records and command (for the card)."""
        return {
            label: (list(recs.values()), self.made_as.get(label, ""))
            for label, recs in self.variants.items()
            if recs
        }

    def _variant_manifests(self) -> dict[str, bytes]:
        """``LABEL/MANIFEST.json`` of each variant this run adds to: its records, as the repo holds them."""
        published = Published(self.target.repo, self.target.branch, {})
        return {
            f"{label}/{MANIFEST_NAME}": manifest_bytes(
                sorted(self.variants[label].values(), key=lambda r: r.number),
                published,
                self.made_as.get(label, ""),
            )
            for label in sorted(self.touched)
        }


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub) gives a small file's bytes."""
    h = git_blob_hash(len(data))
    h.update(data)
    return h.hexdigest()


@dataclass
class Publication:
    """A run that publishes: the target, how often to commit, whether to replace another set, and
    whether the run also makes and publishes the files beside the set (the mmproj, the tokenizer
    GGUF; not with ``--text-only``). Its last commit adds the card and ``TENSOR_MAP.md`` (``card``)."""

    target: PushTarget
    commit_every: float = COMMIT_EVERY
    force: bool = False
    beside: bool = True


def open_committer(
    plan: Any, publication: Publication, say: Callable[[str], None] | None = None
) -> Committer:
    """The target repo opened for ``plan``'s set (made if missing; another set there refused unless
    ``force``, and then its split files deleted in the same commits as this set's). ``say`` hears
    of files the repo holds that k3lab did not make and keeps (a user's README.md)."""
    planned = {pf.filename: pf.digest for pf in plan.files}
    state = open_target(publication.target, planned, publication.force)
    stale = tuple(r.file for r in state.records.values() if r.is_text and r.file not in planned)
    theirs = [n for n in EXTRA_NAMES if state.theirs(n)]
    if theirs and not publication.force and say is not None:
        say(
            f"{publication.target.where()}: {', '.join(theirs)} {'is' if len(theirs) == 1 else 'are'} the "
            "repo's own (k3lab did not make it): kept, and k3lab's is not published; --force replaces it"
        )
    return Committer(publication.target, state, publication.commit_every, stale, publication.force)


def publish_folder(
    model: Any, out_dir: str | Path, publication: Publication, say: Callable[[str], None] | None = None
) -> tuple[int, int, str | None]:
    """Push an existing local set (and its mmproj and standalone tokenizer, when there) the way a
    run publishes: files the repo holds already (same SHA-256) are not sent again, the rest are
    uploaded and committed in batches. Returns (uploaded, already there, the last commit)."""
    import hashlib

    from k3lab.formats.files import read_chunks
    from k3lab.pipeline.state import OutputFolder

    folder = OutputFolder(out_dir)
    plan = folder.plans.require(model)
    with folder.hold():
        records = folder.records.all()
        text = {r.number: r for r in records if r.is_text}
        for pf in plan.files:
            if pf.number not in text or not folder.records.is_complete(pf.number, pf.filename, pf.digest):
                raise PublishError(
                    f"{folder.output(pf.filename)}: missing or not complete; convert the set first "
                    "(`k3lab convert` with the same --out-dir)"
                )
        committer = open_committer(plan, publication, say)
        state = committer.state
        kept = 0
        for rec in sorted(records, key=lambda r: (not r.is_text, r.number, r.file)):
            path = folder.output(rec.file)
            if not rec.sha256:  # its SHA-256 decides whether the repo has it already
                h = hashlib.sha256()
                for chunk in read_chunks(path, rec.size, "output file"):
                    h.update(chunk)
                rec.sha256 = h.hexdigest()
                folder.records.write(rec)
            if state.files.get(rec.file) == rec.sha256:
                committer.add(None, rec)
                kept += 1
                continue
            op = upload(publication.target, path)
            committer.add(op, rec)
        extra = extra_files(
            model,
            plan,
            list(committer.records.values()),
            folder.plans.kvs(plan),
            publication.target,
            committer.variant_table(),
        )
        commit = committer.commit(extra, "k3lab: the whole set")
        target = publication.target
        folder.records.merge(Published(target.repo, target.branch, committer.made, commit or state.commit))
    return committer.uploaded, kept, commit
