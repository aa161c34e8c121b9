"""Where the checkpoint's bytes come from, behind one interface (``base.Source``, named by a
``spec.SourceSpec``): a local folder (``local``) or a Hub repo at one pinned commit (``hub``: its
downloads in ``hub_downloads``, into ``slots``; its ranged reads in ``hub_ranges``; over the client in
``pipeline.hub``).

Kinds of source are named in ``KINDS`` (kind -> the module defining ``open_source(spec)``, imported
when first opened, so a local run never loads the Hub's code): a new kind is one module with a
``Source`` subclass and its line here.
"""

from __future__ import annotations

import functools
import importlib

from k3lab.pipeline.sources.base import Source, SourceError, SourceSpec

KINDS = {"local": "k3lab.pipeline.sources.local", "hub": "k3lab.pipeline.sources.hub"}


def open_source(spec: SourceSpec, fresh: bool = False) -> Source:
    """The source a spec names: this process's, opened once (a worker converting several shards);
    ``fresh``: a new one, reading the files as they are now (the planner)."""
    return (_open.__wrapped__ if fresh else _open)(spec)


@functools.lru_cache(maxsize=4)
def _open(spec: SourceSpec) -> Source:
    if spec.kind not in KINDS:
        raise SourceError(f"{spec.kind!r}: no such kind of source (known: {', '.join(KINDS)})")
    return importlib.import_module(KINDS[spec.kind]).open_source(spec)
