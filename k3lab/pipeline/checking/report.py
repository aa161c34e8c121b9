"""What a check found, said in a few lines: every problem with its kind (``proof.Problem``), what was
checked, and the verdict; a damaged set is told in at most ``SUMMARY_LINES`` lines, one per kind
when there are more."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3lab.errors import printable
from k3lab.pipeline.state.proof import Problem

SUMMARY_LINES = 5  # a damaged set is told in at most this many lines
STRANGERS_SHOWN = 12  # a repo's files beside the set named on the strangers' line


@dataclass
class Report:
    """What ``verify`` found: every problem (``proof.Problem``), and what it checked."""

    found: list[Problem] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes: int = 0  # tensor bytes hashed
    read: int = 0  # bytes read from a Hub repo (headers and tensors)
    strangers: list[str] = field(default_factory=list)  # a repo's files not of the set: named, never read

    def stranger_lines(self, shown: int = STRANGERS_SHOWN) -> list[str]:
        """The repo's files that are not the set's, named (not problems: anyone may add a file)."""
        if not self.strangers:
            return []
        names = ", ".join(printable(n) for n in self.strangers[:shown])
        more = f" and {len(self.strangers) - shown} more" if len(self.strangers) > shown else ""
        return [
            f"not of the set (not in its manifest; not read, not counted): {len(self.strangers)} "
            f"file(s): {names}{more}"
        ]

    @property
    def ok(self) -> bool:
        return not self.found

    @property
    def problems(self) -> list[str]:
        return [p.text for p in self.found]

    def add(self, kind: str, file: str, text: str) -> None:
        """A problem; its text said as a terminal may show it (names from a stranger's file escaped)."""
        self.found.append(Problem(kind, printable(file), printable(text)))

    def lines(self, limit: int = SUMMARY_LINES) -> list[str]:
        """The problems in at most ``limit`` lines: each one, while they fit; else one line per kind
        (which files are truncated, foreign, junk, swapped ...), and the count of what is left."""
        if len(self.found) <= limit:
            return self.problems
        kinds: dict[str, list[Problem]] = {}
        for p in self.found:
            kinds.setdefault(p.kind, []).append(p)
        groups: list[tuple[int, str]] = []
        for kind, found in kinds.items():
            files = list(dict.fromkeys(p.file for p in found if p.file))
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            line = f"{len(found)} problems: {KIND_NAMES.get(kind, kind)}" + (
                f" ({len(files)} files: {shown})" if files else ""
            )
            groups.append((len(found), found[0].text if len(found) == 1 else line))
        if len(groups) > limit:
            rest = sum(n for n, _ in groups[limit - 1 :])
            groups = groups[: limit - 1] + [(rest, f"... and {rest} more problems of other kinds")]
        return [line for _, line in groups]


KIND_NAMES = {
    "missing": "missing files",
    "truncated": "truncated files",
    "longer": "files longer than recorded",
    "foreign": "files not from this conversion (every tensor differs)",
    "junk": "files that are not GGUF",
    "swapped": "files holding another file of the set",
    "header": "headers differ from the manifest",
    "padding": "non-zero padding",
    "tensor": "tensors differ from the manifest",
    "stray": ".gguf files in the folder that are not part of the set",
    "not-a-file": "names that are not regular files",
    "split": "split keys that disagree",
    "set": "the manifest disagrees with itself",
    "unlisted": "split files the manifest does not list (not converted yet?)",
    "plan": "records the folder's plan contradicts",
    "stale": "files made from other inputs (convert again)",
    "rederive": "tensors the source re-derives differently",
}


@dataclass
class Verified:
    """What ``verify`` found, and how it looked: the report's problems, then one verdict line."""

    report: Any
    rederived: bool
    remote: bool
    sample: int | None
    seed: int
    picked: bool

    def lines(self) -> list[str]:
        from k3lab.util import human_bytes

        r = self.report
        verdict = "OK" if r.ok else f"FAILED: {len(r.found)} problem(s)"
        line = (
            f"verify {verdict}: {r.files} files, {r.tensors} tensors, {r.bytes} bytes checked"
            + (" and re-derived from the source" if self.rederived else "")
            + (f"; sampled {self.sample} tensor(s) per file, seed {self.seed}" if self.sample else "")
            + (f"; {human_bytes(r.read)} read from the repo" if self.remote else "")
        )
        more = ["(the headers only: --sample N, --tensors GLOB or --all check tensor bytes too)"]
        strangers = r.stranger_lines() if self.remote else []
        return [*r.lines(), *strangers, line, *(more if self.remote and not self.picked else [])]
