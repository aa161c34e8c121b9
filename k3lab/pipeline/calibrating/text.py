"""The calibration text: a local file or ``ORG/NAME:PATH[@REVISION]`` on the Hub, read whole within a
bound, checked (text, not empty, no NUL), and read as ``llama-imatrix -f FILE`` reads it: its bytes,
one trailing newline dropped. Its SHA-256 (of the file as it is) and where it came from go into the
imatrix's metadata, the variants' manifests and the card."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from k3lab.errors import K3LabError, printable
from k3lab.formats.files import InputFileError, read_bounded

MAX_TEXT = 1 << 30  # bytes of calibration text read at most (llama-imatrix's largest sets are ~10 MB)
HUB = re.compile(r"(?P<repo>[^/:@\s]+/[^/:@\s]+):(?P<path>[^@\s]+?)(?:@(?P<rev>[^@\s]+))?")


class CalibrationError(K3LabError):
    """Calibration text that cannot be one: one line, naming it."""


@dataclass(frozen=True)
class CalibrationText:
    """The text as the forward reads it (``data``), the file's SHA-256, where it is (``source``: as
    given, or ``ORG/NAME:PATH@COMMIT``) and the name the imatrix records (``dataset``: as given, as
    llama-imatrix records its ``-f``)."""

    data: bytes
    sha256: str
    source: str
    dataset: str


def read_text(location: str) -> CalibrationText:
    """The calibration text at ``location`` (see the module's docstring): one line for what is not one."""
    m = HUB.fullmatch(location)
    if m is not None and not Path(location).exists():
        raw, source = _from_hub(m["repo"], m["path"], m["rev"])
    else:
        try:
            raw = read_bounded(location, MAX_TEXT, "calibration text")
        except InputFileError as e:
            raise CalibrationError(f"--calibration {e}") from None
        source = location
    return checked(raw, source, location)


def checked(raw: bytes, source: str, dataset: str) -> CalibrationText:
    where = printable(source)
    if not raw.strip():
        raise CalibrationError(
            f"--calibration {where}: empty (a calibration text is text to run the model on)"
        )
    if b"\0" in raw:
        raise CalibrationError(f"--calibration {where}: holds NUL bytes: a binary file, not text")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(
            f"--calibration {where}: not UTF-8 text (byte {e.start}): a binary file?"
        ) from None
    data = raw[:-1] if raw.endswith(b"\n") else raw  # (as llama.cpp's -f reads a file)
    return CalibrationText(data, hashlib.sha256(raw).hexdigest(), source, dataset)


def _from_hub(repo: str, path: str, revision: str | None) -> tuple[bytes, str]:
    """The file at one pinned commit, through k3lab's bounded transport, checked against the SHA-256
    the Hub lists."""
    from k3lab.pipeline.hub import transport
    from k3lab.pipeline.hub.files import pinned_file
    from k3lab.pipeline.hub.retry import with_retries

    try:
        pin = pinned_file(repo, path, revision, "--calibration", MAX_TEXT, "calibration text")
    except K3LabError as e:
        raise CalibrationError(str(e)) from None
    size, where = pin.file.size, pin.where
    raw = with_retries(
        where, lambda: transport.fetch_range(pin.url(), 0, size, size, pin.token, where), pin.budget
    )
    if pin.file.sha256 is not None and hashlib.sha256(raw).hexdigest() != pin.file.sha256:
        raise CalibrationError(f"{where}: its bytes are not the ones the Hub lists (SHA-256)")
    return bytes(raw), f"{repo}:{path}@{pin.commit}"
