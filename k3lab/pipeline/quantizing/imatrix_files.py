"""Where a variant's imatrix comes from, and the reads of it: a local file (read by offset) or a file in
a Hub repo, ``ORG/NAME:PATH`` (read by ranged GETs at one pinned commit, through the range cache:
a task fetches only the entries of its own file's tensors).

The plan reads the imatrix's index once and records the file's identity: locally its SHA-256 and
each entry's (made once, at plan time, reading it whole) and what the file system says of it; on the
Hub the commit and its SHA-256 (its LFS oid). A task finds a local file changed since (another size,
time or inode) and stops in one line, and checks every entry it reads against the entry's SHA-256 (a
file changed in place under an open descriptor, mid-run, is caught there); on the Hub it reads at the
commit, so nothing can change under it. Every Hub request goes through k3lab's bounded transport.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.files import InputFileError, open_regular
from k3lab.formats.imatrix import MAX_VALUES, Entry, IMatrix, Read, entry_sha256, read_index, vector
from k3lab.pipeline.state.proof import identity


@dataclass(frozen=True, eq=False)
class IMatrixUse:
    """The imatrix a variant is made with, as its plan records it: where it is, what llama-quantize
    would record of it, its SHA-256, and its index (every entry, so a task reads its own by range)."""

    location: str  # a local path, or ORG/NAME:PATH@COMMIT
    shown: str  # quantize.imatrix.file: the path llama-quantize was given (at most 127 bytes)
    sha256: str
    index: IMatrix = field(compare=False)
    identity: tuple[tuple[str, int], ...] = ()  # a local file's, when the plan read it
    repo: str = ""  # on the Hub: where, at which commit, on which Hub (never who: the token is not kept)
    path: str = ""
    commit: str = ""
    endpoint: str = ""
    include: tuple[str, ...] = ()  # --include-weights: only the entries whose names hold one of these
    exclude: tuple[str, ...] = ()  # --exclude-weights: not the entries whose names hold one of these

    def made_from(self) -> str:
        """A comment line on what k3lab made this imatrix from (its calibration text), when it did."""
        sha, source = self.index.calibration
        if not sha:
            return ""
        return (f"\n# the imatrix (SHA-256 {self.sha256}): k3lab imatrix on the calibration text "
                f"{source or '(unnamed)'}, SHA-256 {sha}")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        ix = self.index
        return {
            "location": self.location,
            "shown": self.shown,
            "sha256": self.sha256,
            "identity": dict(self.identity),
            "hub": [self.repo, self.path, self.commit, self.endpoint] if self.repo else None,
            "size": ix.size,
            "legacy": ix.legacy,
            "datasets": ix.datasets[:1],
            "chunk_count": ix.chunk_count,
            "chunk_size": ix.chunk_size,
            "calibration": list(ix.calibration),
            **({"include": list(self.include)} if self.include else {}),
            **({"exclude": list(self.exclude)} if self.exclude else {}),
            "entries": [e.to_json() for e in ix.entries.values()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IMatrixUse:
        entries = {e.name: e for e in (Entry.from_json(row) for row in data["entries"])}
        calibration = data.get("calibration") or ["", ""]
        index = IMatrix(entries, list(data["datasets"]), int(data["chunk_count"]), int(data["chunk_size"]),
                        bool(data["legacy"]), int(data["size"]), (str(calibration[0]), str(calibration[1])))  # fmt: skip
        hub = data.get("hub") or ["", "", "", ""]
        ident = tuple(sorted((str(k), int(v)) for k, v in (data.get("identity") or {}).items()))
        return cls(
            str(data["location"]), str(data["shown"]), str(data["sha256"]), index, ident, *map(str, hub),
            tuple(map(str, data.get("include", ()))), tuple(map(str, data.get("exclude", ()))),
        )  # fmt: skip

    def filtered(self, include: tuple[str, ...], exclude: tuple[str, ...]) -> IMatrixUse | None:
        """llama-quantize's ``--include-weights``/``--exclude-weights``: the entries whose names hold
        one of ``include`` (when given), without those holding one of ``exclude``; None when none is
        left (llama-quantize then quantises as without an imatrix, and records none)."""
        import dataclasses

        entries = {n: e for n, e in self.index.entries.items() if not any(x in n for x in exclude)}
        if include:
            entries = {n: e for n, e in entries.items() if any(x in n for x in include)}
        if not entries:
            return None
        index = dataclasses.replace(self.index, entries=entries)
        return dataclasses.replace(self, index=index, include=include, exclude=exclude)


HUB = re.compile(r"(?P<repo>[^/:@\s]+/[^/:@\s]+):(?P<path>[^@\s]+?)(?:@(?P<rev>[^@\s]+))?")
MAX_SIZE = 4 * MAX_VALUES + (256 << 20)  # the largest imatrix read at all


def open_imatrix(location: str) -> IMatrixUse:
    """The imatrix at ``location`` (a path, or ``ORG/NAME:PATH[@REVISION]``), its index read and
    checked: one line for anything that is not an imatrix llama-quantize would take."""
    m = HUB.fullmatch(location)
    if m is not None and not Path(location).exists():
        return _hub_imatrix(m["repo"], m["path"], m["rev"])
    path = Path(location)
    try:
        fd, size = open_regular(path, "file")
    except InputFileError as e:
        raise K3LabError(f"--imatrix {e}") from None
    try:
        if size > MAX_SIZE:
            raise K3LabError(f"--imatrix {path}: {size:,} bytes: larger than any imatrix k3lab reads")
        read = _pread(fd, path)
        index = read_index(read, size, str(path))
        h = hashlib.sha256()
        for at in range(0, size, 16 << 20):
            h.update(read(at, min(16 << 20, size - at)))
        for (
            name,
            entry,
        ) in index.entries.items():  # every value finite, as llama-quantize demands, before any work
            vector(entry, read, str(path))
            counts = read(*entry.counts) if entry.counts is not None else None
            index.entries[name] = entry.proven(entry_sha256(read(*entry.sums), counts))
        ident = identity(path)
    finally:
        os.close(fd)
    if ident is None or ident["size"] != size:
        raise K3LabError(f"--imatrix {path}: changed while it was read")
    return IMatrixUse(str(path.resolve()), location, h.hexdigest(), index, tuple(sorted(ident.items())))


def _pread(fd: int, path: Path) -> Read:
    def read(offset: int, n: int) -> bytes:
        data = os.pread(fd, n, offset)
        if len(data) != n:
            raise K3LabError(
                f"--imatrix {path}: ends at {offset + len(data)}, before its entries do (cut short?)"
            )
        return data

    return read


_READERS: dict[tuple[str, str], Read] = {}


def reader(use: IMatrixUse, token: str | None = None) -> Read:
    """Reads of the imatrix a plan recorded, by range: a local file proven unchanged first (one line
    when it changed since the plan read it), a Hub file at the plan's commit (``token``: the run's, as
    its tasks carry it). One per process."""
    key = (use.location, use.sha256)
    if key not in _READERS:
        _READERS[key] = _hub_reader(use, token) if use.repo else _local_reader(use)
    return _READERS[key]


def _local_reader(use: IMatrixUse) -> Read:
    path = Path(use.location)
    if tuple(sorted((identity(path) or {}).items())) != use.identity:
        raise K3LabError(
            f"{path}: the imatrix changed since this variant was planned (run the command again to re-plan)"
        )
    fd, _ = open_regular(path, "file")  # (kept open for the process's reads)
    return _pread(fd, path)


# --- on the Hub --------------------------------------------------------------------------------------


def _hub_imatrix(repo: str, path: str, revision: str | None) -> IMatrixUse:
    from k3lab.pipeline.hub.files import pinned_file

    pin = pinned_file(repo, path, revision, "--imatrix", MAX_SIZE, "imatrix")
    size, sha = pin.file.size, pin.file.oid
    where_at = f"{repo}:{path}@{pin.commit}"
    use = IMatrixUse(where_at, path, sha, IMatrix({}, size=size), (), repo, path, pin.commit, pin.endpoint)
    index = read_index(_hub_reader(use, pin.token), size, use.location)
    return IMatrixUse(use.location, path, sha, index, (), repo, path, pin.commit, pin.endpoint)


def _hub_reader(use: IMatrixUse, token: str | None) -> Read:
    from k3lab.pipeline.hub import transport
    from k3lab.pipeline.hub.env import hub_env
    from k3lab.pipeline.hub.ranges import FileIdentity, RangeCache
    from k3lab.pipeline.hub.retry import with_retries

    transport.install()
    env = hub_env()
    token = token or env.token
    total = use.index.size
    url = transport.file_url(use.repo, use.path, use.commit, use.endpoint or env.endpoint)
    cache = RangeCache()
    ident = FileIdentity(use.repo, use.commit, use.path, use.sha256)

    def fetch(a: int, b: int) -> bytes:
        return with_retries(
            use.location, lambda: transport.fetch_range(url, a, b, total, token, use.location), env.budget
        )

    def read(offset: int, n: int) -> bytes:
        if offset < 0 or offset + n > total:
            raise K3LabError(f"{use.location}: a read past its {total} bytes")
        return bytes(cache.read(ident, offset, offset + n, fetch))

    return read
