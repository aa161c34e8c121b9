"""A checkpoint in a local folder: the shards' bytes are read where they are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3lab.formats.files import file_identity
from k3lab.pipeline.sources.base import Source, SourceError, SourceSpec


def open_source(spec: SourceSpec) -> Source:
    return LocalSource(spec.location, spec.meta_dir)


class LocalSource(Source):
    """A checkpoint in a local folder (the index and metadata may live in a separate ``meta`` folder)."""

    DIRECT_READS = True

    def __init__(self, src_dir: str | Path, meta_dir: str | Path | None = None):
        super().__init__()
        self.src_dir = Path(src_dir)
        self.meta_dir = Path(meta_dir or src_dir)

    def _index_dirs(self) -> list[Path]:
        return [self.meta_dir, self.src_dir]

    @property
    def name(self) -> str:
        return self.src_dir.resolve().name

    def local_path(self, file: str) -> Path:
        return self.src_dir / file

    def content_identity(self, file: str) -> dict[str, Any] | None:
        """The file's size, times, inode and device (``formats.files.file_identity``)."""
        return file_identity(self.local_path(file))

    def _fetch_raw_header(self, file: str) -> tuple[bytes, int]:
        raise SourceError(f"{self.index_path}: names {file}, which is not in {self.src_dir}")
