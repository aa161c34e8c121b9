"""`k3lab verify ORG/NAME`: a GGUF split set in a Hub repo, checked without downloading either side.

First the set's structure, from every file's header (read by ranges): every split file present, the
split keys agreeing, every tensor once; with a source, every tensor's name, type and shape against
the plan made from the source's config (so a set made by another tool, split another way, is checked
too). Then the bytes of the tensors chosen (``Choice``: every one, a seeded sample per file, or a
glob), each streamed through SHA-256 and compared with the repo's ``MANIFEST.json`` where it has one
and, given a source, with the same tensor re-derived from the source's byte ranges by the converter's
own transforms. Nothing is stored: the whole set can be checked with no disk.
"""

from __future__ import annotations

import fnmatch
import hashlib
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.pipeline.checking.remote import (
    SPLIT,
    Header,
    RemoteSetError,
    read_header,
    split_sets,
    tensor_pieces,
)
from k3lab.pipeline.checking.report import Report
from k3lab.pipeline.hub import transport
from k3lab.pipeline.hub.retry import RETRY_BUDGET, with_retries
from k3lab.pipeline.model import Model
from k3lab.pipeline.state.record import (
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    read_manifest,
)

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


SAMPLE_LIMIT = 16 << 20  # a sample draws among tensors this size or smaller (an expert stack is 2.9 GB)


@dataclass(frozen=True)
class Choice:
    """Which tensors' bytes to check: ``every`` one, ``sample`` per file (seeded, among tensors of
    ``SAMPLE_LIMIT`` bytes or less), or those matching the glob ``tensors``; none: the structure only."""

    every: bool = False
    sample: int | None = None
    tensors: str | None = None
    seed: int = 0

    def pick(self, file: str, sizes: dict[str, int]) -> list[str]:
        """The tensors of ``file`` (name -> bytes) to check."""
        if self.every:
            return list(sizes)
        chosen = [n for n in sizes if self.tensors and fnmatch.fnmatchcase(n, self.tensors)]
        if self.sample:
            small = sorted(n for n, size in sizes.items() if size <= SAMPLE_LIMIT)
            chosen += random.Random(f"{self.seed}:{file}").sample(small, min(self.sample, len(small)))
        return list(dict.fromkeys(chosen))


@dataclass
class RepoFiles:
    """A repo at one commit, and a ranged reader of its files (bounded, within the retry budget)."""

    repo: str
    commit: str
    sizes: dict[str, int]
    endpoint: str | None
    token: str | None
    budget: float = RETRY_BUDGET
    read: int = 0
    folder: str = ""  # the repo's folder the set is in (a variant's), its files named from there

    def fetch(self, file: str, start: int, stop: int) -> bytes:
        path = f"{self.folder}/{file}" if self.folder else file
        url = transport.file_url(self.repo, path, self.commit, self.endpoint)
        where = f"{self.repo}@{self.commit[:12]}: {path}"
        data = with_retries(
            where,
            lambda: transport.fetch_range(url, start, stop, self.sizes[file], self.token, where),
            self.budget,
        )
        self.read += len(data)
        return data


def open_repo(
    repo: str, revision: str | None, endpoint: str | None, token: str | None, budget: float
) -> RepoFiles:
    """``repo`` (``ORG/NAME``, or ``ORG/NAME/FOLDER``: the files of that folder) at ``revision``'s commit."""
    from huggingface_hub import HfApi

    parts = repo.split("/")
    repo, folder = "/".join(parts[:2]), "/".join(parts[2:])
    transport.install()
    api = HfApi(endpoint=endpoint, token=token)
    info = with_retries(
        f"{repo}@{revision or 'main'}",
        lambda: api.model_info(repo, revision=revision, files_metadata=True),
        budget,
    )
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    if folder:
        sizes = {n[len(folder) + 1 :]: size for n, size in sizes.items() if n.startswith(folder + "/")}
        if not sizes:
            raise K3LabError(f"{repo}@{info.sha[:12]}: no folder {folder!r}")
    return RepoFiles(repo, info.sha, sizes, endpoint, token, budget, folder=folder)


def verify_repo(
    files: RepoFiles,
    choice: Choice,
    model: Model | None = None,
    source: Any = None,
    say: Any = None,
) -> Report:
    """Check the repo's split set: structure, plan (with ``source``), and the chosen tensors' bytes."""
    report = Report()
    if files.folder and source is not None:
        raise K3LabError(
            f"{files.repo}/{files.folder}: a variant is checked against its manifest; it is made from the set, "
            "not from a checkpoint (give no source)"
        )
    manifest = _manifest(files)
    recorded = {r.file: r for r in manifest.records} if manifest else {}
    # the set is what the manifest lists; every other file is a stranger, named and never read (a
    # stranger named like file 1 of another count, unreadable or valid, cannot stand in for the set's)
    members = [n for n in sorted(files.sizes) if "/" not in n and (n in recorded or not recorded)]
    report.strangers = [
        n for n in sorted(files.sizes) if n not in recorded and not _companion(n, files.sizes)
    ]
    if not recorded:  # (no manifest: every .gguf at the top is taken for the set's)
        report.strangers = [n for n in report.strangers if not (n.endswith(".gguf") and "/" not in n)]
    sets = split_sets(members)
    if (
        not sets and recorded
    ):  # (the manifest's set is not here: its files missing, the repo's strangers named)
        for rec in manifest.records if manifest else []:
            if rec.file not in files.sizes:
                report.add("missing", rec.file, f"{rec.file}: in {MANIFEST_NAME}, not in the repo")
        return report
    if not sets:
        raise K3LabError(f"{files.repo}@{files.commit[:12]}: holds no GGUF file")
    plan = _plan(model, source, recorded) if source is not None else None
    texts = 0
    for base, names in sorted(sets.items()):
        read = {n: _header(files, n, report) for n in names}
        headers = [h for h in read.values() if h is not None]
        report.files += len(names) - len(headers)
        if not headers:
            texts += not recorded or any(recorded[n].is_text for n in names if n in recorded)
            continue
        beside = len(names) == 1 and _beside_the_set(headers[0])
        if not beside:  # a text model's set: its structure, and with a source its plan
            texts += 1
            _check_structure(base, names, read, report)
            if plan is not None and len(headers) == len(names):
                _check_plan(plan, headers, report)
        else:
            report.tensors += len(headers[0].tensors)
        for h in headers:
            rec = recorded.get(h.file)
            if rec is not None and rec.header_sha256 != h.header_sha256:
                report.add(
                    "header",
                    h.file,
                    f"{h.file}: header (metadata and tensor infos) differs from the manifest",
                )
            report.files += 1
        derive = _single_deriver(model, source, headers[0]) if beside else None
        _check_bytes(files, headers, choice, recorded, None if beside else plan, source, report, say, derive)
    for rec in manifest.records if manifest else []:
        if rec.file not in files.sizes:
            report.add("missing", rec.file, f"{rec.file}: in {MANIFEST_NAME}, not in the repo")
    if not texts:
        raise K3LabError(f"{files.repo}@{files.commit[:12]}: holds no GGUF set of a text model")
    if not recorded and plan is None and (choice.every or choice.sample or choice.tensors):
        report.add(
            "set",
            "",
            f"{files.repo}: no {MANIFEST_NAME} and no source given: tensor bytes were read but not compared",
        )
    return report


COMPANIONS = frozenset({MANIFEST_NAME, "README.md", "TENSOR_MAP.md", ".gitattributes"})


def _companion(name: str, sizes: dict[str, int]) -> bool:
    """A file k3lab puts beside a set (its manifest, card, tensor map), or one of a variant's folder
    (a set of its own, with its own manifest: ``verify ORG/NAME/LABEL``)."""
    folder, _, rest = name.rpartition("/")
    if not folder:
        return name in COMPANIONS
    return "/" not in folder and f"{folder}/{MANIFEST_NAME}" in sizes


def _single_deriver(model: Model | None, source: Any, h: Header) -> Any:
    """For the model's single file (the mmproj) and a source: names -> their digests made again."""
    single = model.single if model is not None else None
    if source is None or single is None or h.fields.get("general.architecture") != single.arch:
        return None
    from pathlib import Path

    from k3lab.pipeline.writing.single import single_digests

    return lambda names: single_digests(model, model.load_config(Path(source.meta_dir)), source, names)


def _beside_the_set(h: Header) -> bool:
    """A file that goes beside a text model's set: an mmproj (``clip``) or a tokenizer (no tensors)."""
    return h.fields.get("general.architecture") == "clip" or not h.tensors


def _manifest(files: RepoFiles) -> Manifest | None:
    size = files.sizes.get(MANIFEST_NAME)
    if size is None:
        return None
    where = f"{files.repo}@{files.commit[:12]}: {MANIFEST_NAME}"
    if size > MANIFEST_LIMIT:
        raise ManifestError(f"{where}: {size} bytes, larger than any k3lab manifest")
    return read_manifest(files.fetch(MANIFEST_NAME, 0, size), where)


def _header(files: RepoFiles, name: str, report: Report) -> Header | None:
    """``name``'s header, or None with the file named (a file that cannot be read stops nothing else)."""
    try:
        return read_header(name, files.sizes[name], files.fetch)
    except RemoteSetError as e:
        report.add("junk", name, str(e))
        return None


def _check_structure(base: str, names: list[str], read: dict[str, Header | None], report: Report) -> None:
    """The split keys against each other, against the files' names and against the files present
    (a file that could not be read keeps its place: it is named once, its neighbours never blamed)."""
    headers = [h for h in read.values() if h is not None]
    said = headers[0].split(SPLIT_COUNT)
    count = said if said is not None else len(names)
    total = sum(len(h.tensors) for h in headers) if len(headers) == len(names) else None
    if len(names) != count:
        report.add("set", "", f"{base}: {len(names)} files in the repo, the set has {count}")
    for k, n in enumerate(names):
        named = SPLIT.fullmatch(n)
        if (
            read[n] is not None
            and named
            and (int(named["no"]) != k + 1 or int(named["count"]) != max(count, len(names)))
        ):
            report.add(
                "split",
                n,
                f"{n}: named file {int(named['no'])} of {int(named['count'])}, but it is file "
                f"{k + 1} of the {len(names)} present and the set says {count}",
            )
    seen: dict[str, str] = {}
    for k, n in enumerate(names):
        if (h := read[n]) is None:
            continue
        for key, want in ((SPLIT_NO, k), (SPLIT_COUNT, count), (SPLIT_TENSORS, total)):
            if want is not None and h.split(key) != want and not (count == 1 and h.split(key) is None):
                report.add("split", h.file, f"{h.file}: {key} is {h.split(key)}, expected {want}")
        for t in h.tensors:
            if t.name in seen:
                report.add("set", h.file, f"{h.file}: tensor {t.name}: also in {seen[t.name]}")
            seen[t.name] = h.file
        report.tensors += len(h.tensors)


def _plan(model: Model | None, source: Any, recorded: dict) -> Any:
    from pathlib import Path

    from k3lab.pipeline.planning.planner import build_plan

    if model is None:
        raise K3LabError("re-deriving from a source needs the model")
    text = [r for r in recorded.values() if r.is_text]
    outtype = text[0].outtype if text else "auto"
    basename = text[0].basename if text else None
    return build_plan(model, model.load_config(Path(source.meta_dir)), source, outtype, basename)


def _check_plan(plan: Any, headers: list[Header], report: Report) -> None:
    planned = {t.name: (t.info.type.name, tuple(t.info.ne)) for f in plan.files for t in f.tensors}
    found = {t.name: (t.type, t.ne, t.file) for h in headers for t in h.tensors}
    for name in sorted(planned.keys() - found.keys())[:20]:
        report.add("plan", "", f"tensor {name}: the source plans it, the set lacks it")
    for name in sorted(found.keys() - planned.keys())[:20]:
        report.add(
            "plan", found[name][2], f"{found[name][2]}: tensor {name}: not a tensor of the source's plan"
        )
    for name in sorted(planned.keys() & found.keys()):
        if planned[name] != found[name][:2]:
            report.add(
                "plan",
                found[name][2],
                f"{found[name][2]}: tensor {name}: {found[name][0]} {list(found[name][1])}, the source "
                f"plans {planned[name][0]} {list(planned[name][1])}",
            )


def _check_bytes(
    files: RepoFiles,
    headers: list[Header],
    choice: Choice,
    recorded: dict,
    plan: Any,
    source: Any,
    report: Report,
    say: Any,
    derive: Any = None,
) -> None:
    planned = {t.name: (f, t) for f in plan.files for t in f.tensors} if plan is not None else {}
    for h in headers:
        by_name = {t.name: t for t in h.tensors}
        chosen = choice.pick(h.file, {t.name: t.nbytes for t in h.tensors})
        rec = recorded.get(h.file)
        want = {t.name: t.sha256 for t in rec.tensors} if rec is not None else {}
        derived = derive(set(chosen)) if derive is not None and chosen else {}
        for name in chosen:
            t = by_name[name]
            digest = _hash(tensor_pieces(t, files.fetch))
            report.bytes += t.nbytes
            if name in want and want[name] != digest:
                report.add("tensor", h.file, f"{h.file}: tensor {name}: SHA-256 differs from the manifest")
            if name in derived and derived[name][2] != digest:
                report.add(
                    "rederive",
                    h.file,
                    f"{h.file}: tensor {name}: re-derived from the source, SHA-256 differs",
                )
            if name in planned:
                derived_text = _derive(planned[name], source)
                if derived_text != digest:
                    report.add(
                        "rederive",
                        h.file,
                        f"{h.file}: tensor {name}: re-derived from the source, SHA-256 differs "
                        f"(source {_first_source(*planned[name])}: {planned[name][1].sources[0]})",
                    )
            if say is not None:
                say(t)


def _first_source(pf: Any, pt: Any) -> str:
    return pf.sources[pt.files[0]].file if pt.files else "?"


def _hash(pieces: Any) -> str:
    h = hashlib.sha256()
    for p in pieces:
        h.update(p)
    return h.hexdigest()


def _derive(planned: tuple[Any, Any], source: Any) -> str:
    """The tensor made again from the source's bytes (read by ranges), by the converter's streams."""
    from k3lab.pipeline.writing.convert import tensor_pieces as derived_pieces
    from k3lab.pipeline.writing.convert import tensor_reader

    pf, pt = planned
    h = hashlib.sha256()
    for piece in derived_pieces(pt, tensor_reader(source, pf, pt)):
        h.update(memoryview(np.ascontiguousarray(piece)).cast("B"))
    return h.hexdigest()


def verify_at(
    repo: str,
    revision: str | None,
    endpoint: str | None,
    token: str | None,
    budget: float,
    choice: Choice | None = None,
    model: Model | None = None,
    source: Any = None,
) -> Report:
    """``verify_repo`` of ``repo`` at ``revision`` (pinned to its commit now); the report says how
    many bytes were read from the repo."""
    files = open_repo(repo, revision, endpoint, token, budget)
    report = verify_repo(files, choice or Choice(), model, source)
    report.read = files.read
    return report
