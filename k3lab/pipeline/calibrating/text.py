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
    """The file at one pinned commit, through k3lab's bounded transport."""
    from huggingface_hub import HfApi

    from k3lab import values
    from k3lab.pipeline.hub import transport
    from k3lab.pipeline.hub.env import hub_env
    from k3lab.pipeline.hub.retry import with_retries

    values.repo_id(repo, "--calibration")
    if revision is not None:
        values.revision(revision, "--calibration")
    transport.install()
    env = hub_env()
    where = f"--calibration {repo}:{path}"
    api = HfApi(endpoint=env.endpoint, token=env.token)
    info = with_retries(
        where, lambda: api.model_info(repo, revision=revision or "main", files_metadata=True), env.budget
    )
    remote = next((s for s in info.siblings or [] if s.rfilename == path), None)
    if remote is None or not info.sha:
        raise CalibrationError(f"{where}: no such file at {revision or 'main'}")
    size = int(remote.size or 0)
    if size > MAX_TEXT:
        raise CalibrationError(f"{where}: {size:,} bytes: more calibration text than k3lab reads")
    url = transport.file_url(repo, path, info.sha, env.endpoint)
    raw = with_retries(where, lambda: transport.fetch_range(url, 0, size, size, env.token, where), env.budget)
    if remote.lfs is not None and hashlib.sha256(raw).hexdigest() != remote.lfs.sha256:
        raise CalibrationError(f"{where}: its bytes are not the ones the Hub lists (SHA-256)")
    return bytes(raw), f"{repo}:{path}@{info.sha}"
