"""Opening what a notebook looks at, through the same request as the CLI (``k3lab.request``): a
checkpoint (a folder, or a Hub repo at a revision) and the plan of converting it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3lab import request
from k3lab.errors import K3LabError
from k3lab.request import Request


def source_spec(
    meta: str | Path,
    src: str | Path | None = None,
    repo: str | None = None,
    revision: str | None = None,
    model: str = "kimi-k3",
) -> Any:
    """The checkpoint, as the command line names it: a local folder (``src``, default ``meta``) or a
    Hub repo (``repo`` at ``revision``)."""
    return _request(meta, src, repo, revision, model=model).source()


def _request(
    meta: str | Path | None,
    src: Any = None,
    repo: str | None = None,
    revision: str | None = None,
    **more: Any,
) -> Request:
    if src is not None and not isinstance(src, (str, Path)):  # a SourceSpec: its own folders
        raise TypeError("give src as a folder, or repo= for the Hub")
    return Request(
        meta=str(meta) if meta is not None else None,
        src=str(src) if src is not None and repo is None else None,
        repo=repo,
        revision=revision,
        **more,
    )


def open_conversion(
    meta: str | Path,
    src: str | Path | None,
    out_dir: str | Path,
    repo: str | None = None,
    revision: str | None = None,
    model: str = "kimi-k3",
) -> tuple[Any, Any]:
    """The plan of converting the checkpoint into ``out_dir`` (the saved one when it is current, else
    made as ``k3lab convert`` would; nothing is written) and the source it reads."""
    return request.prepared(_request(meta, src, repo, revision, out_dir=str(out_dir), model=model))


def convert(
    meta: str | Path,
    src: str | Path | None,
    out_dir: str | Path,
    shards: list[int] | None = None,
    force: bool = False,
    run_token: str | None = None,
    progress: bool = False,
    repo: str | None = None,
    revision: str | None = None,
) -> list[Any]:
    """Convert output files ``shards`` (default: all) exactly as ``k3lab convert`` does (as part of
    the run holding ``run_token`` when `k3lab batch` runs this), with a progress bar if asked."""
    req = _request(
        meta, src, repo, revision, out_dir=str(out_dir), shards=shards, force=force, quiet=not progress
    )
    return request.convert(req, run_token=run_token)


def open_checkpoint(
    src: str | Path, meta: str | Path | None = None, repo: str | None = None, revision: str | None = None
) -> tuple[Any, Any]:
    """The config and the source of a checkpoint (a folder, or a Hub repo)."""
    req = _request(meta or src, src, repo, revision)
    source = request.opened(req)
    source.weight_map  # noqa: B018 - the index is read now, when the checkpoint is opened, not by a view
    return req.load_model().load_config(Path(req.meta)), source


def make_mmproj(
    meta: str | Path, out: str | Path, repo: str | None = None, revision: str | None = None
) -> Path:
    """The checkpoint's vision mmproj at ``out``, as ``k3lab vision`` writes it (made when missing)."""
    out = Path(out)
    if not out.exists():
        request.vision(_request(meta, meta, repo, revision), str(out))
    return out


def check_vision(
    meta: str | Path,
    mmproj: str | Path,
    image: str | Path | None = None,
    repo: str | None = None,
    revision: str | None = None,
    source: Any = None,
) -> Any:
    """``k3lab check-vision`` on ``image`` (default: the sample the package ships); ``source``: the
    notebook's open one (what the check reads then counts with the rest)."""
    req = _request(meta, meta, repo, revision)
    return request.check_vision(req, str(mmproj), None if image is None else str(image), source=source)


def ensure_demo(folder: str | Path, model: str = "kimi-k3") -> Path:
    """The model's small synthetic checkpoint in ``folder`` (what `k3lab demo` writes), made when it
    is missing: a notebook run with no checkpoint of its own looks at this one."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        front = Request(model=model).load_model().guide
        if front is None:
            raise K3LabError(f"--model {model}: brings no demo checkpoint")
        front.demo(folder, 0)
    return folder


def fetched(source: Any) -> str:
    """What a view cost: for a Hub source, the bytes fetched by ranges (and served from the cache)."""
    from k3lab.util import human_bytes

    counts = getattr(source, "counts", None)
    if counts is None:
        return "read from the local copy: nothing fetched"
    return (
        f"fetched {human_bytes(counts.fetched)} from the Hub in {counts.requests} ranged reads "
        f"({human_bytes(counts.cached)} more from the cache)"
    )
