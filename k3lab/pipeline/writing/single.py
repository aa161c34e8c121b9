"""A single file beside the split set, through the same pipeline: a model's second output (Kimi-K3's
vision mmproj: ``Model.single``), and the standalone tokenizer GGUF (``Model.tokenizer_kvs``).

Planned and checked first (every source tensor against the config's layout, ``--out`` not a name of
the split set), then written holding the folder's lock, with a record in ``.k3lab/`` and the
merged manifest rebuilt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError
from k3lab.formats.gguf_stream import KV, write_metadata_only
from k3lab.pipeline.model import Model, SingleFileModel
from k3lab.pipeline.planning.plan import PlanError, PlannedTensor
from k3lab.pipeline.planning.planner import plan_tensor
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import Source, SourceSpec
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.state.names import SPLIT_NAME, STATE_DIR, FolderError
from k3lab.pipeline.writing.convert import Reader, write_tensors


def check_single_output(folder: OutputFolder, out: Path) -> None:
    """``vision``/``tokenizer`` may write ``out`` there: a ``.gguf`` that is not a file of the set (by
    its name, or the names its records give), nor the manifest or the state."""
    name = out.name
    if STATE_DIR in out.parts:
        raise FolderError(f"{out}: is inside {STATE_DIR}/, k3lab's state; write the file beside it")
    if not name.endswith(".gguf") or name.startswith("."):
        raise FolderError(f"{out}: give a file name ending in .gguf")
    taken = {r.file for r in folder.records.all() if r.is_text}
    if SPLIT_NAME.fullmatch(name) or name in taken:
        raise FolderError(
            f"{out}: is the name of a file of the set; give the mmproj or tokenizer its own name"
        )
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise FolderError(f"{out}: exists and is not a regular file; k3lab will not replace it")


def plan_single(model: Model, cfg: Any, source: Source) -> list[PlannedTensor]:
    """Every source tensor the model's single file takes, each used exactly once."""
    single = model.single
    if single is None:
        raise K3LabError(f"{model.name}: has no single-file output")
    single.check_config(cfg)
    names = [n for n in source.weight_map if n.startswith(single.prefixes)]
    if not names:
        raise PlanError(f"{source.index_path}: no {' or '.join(p + '*' for p in single.prefixes)} tensors")
    where = source.weight_map[names[0]]
    expected = single.layout(cfg)
    planned: list[PlannedTensor] = []
    for bid in single.units(cfg):
        tags = single.unit_tags(cfg, bid)
        for rule in single.rules:
            made = plan_tensor(rule, cfg, source, bid, "auto", where, expected, tags, frozenset(), model)
            if made is not None:
                planned.append(made[0])
    used = {n for pt in planned for n in pt.sources}
    unused = [n for n in names if n not in used]
    if unused:
        raise PlanError(
            f"{source.weight_map[unused[0]]}: tensor {unused[0]} is not used by any {single.kind} rule"
        )
    return planned


def convert_single(model: Model, spec: SourceSpec, out: str | Path, run_token: str | None = None) -> Path:
    """Write the model's single file (the mmproj) and its record (``OUT_DIR/.k3lab/KEY.json``),
    holding the folder (or, with ``run_token``, as part of the run that holds it)."""
    single = model.single
    if single is None:
        raise K3LabError(f"{model.name}: has no single-file output")
    out = Path(out)
    folder = OutputFolder(out.parent)
    check_single_output(folder, out)
    source = open_source(spec, fresh=True)
    source.fetch_meta()
    cfg = model.load_config(spec.meta_dir)
    planned = plan_single(model, cfg, source)
    files = sorted({source.weight_map[n] for pt in planned for n in pt.sources})
    kvs = single.kvs(cfg, Path(spec.meta_dir))
    with folder.hold(run_token):
        check_single_output(folder, out)  # (a plan saved meanwhile)
        return _write_single(folder, single, out, kvs, planned, source, files)


def _write_single(
    folder: OutputFolder,
    single: SingleFileModel,
    out: Path,
    kvs: list[KV],
    planned: list[PlannedTensor],
    source: Source,
    files: list[str],
) -> Path:
    try:
        for f in files:
            source.acquire(f)
        entries = {n: e for f in files for n, e in source.file_header(f)[0].items()}
        reader = Reader(source, entries, files={n: source.weight_map[n] for n in entries})
        records, data_start, _ = write_tensors(out, single.arch, kvs, planned, reader)
    finally:
        for f in files:
            source.release(f)
    folder.records.write_single(out, single.kind, single.key, data_start, records)
    return out


def single_digests(
    model: Model, cfg: Any, source: Source, names: set[str] | None = None
) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """The model's single file made again from the source, hashed, not written: each tensor's
    (type, ne, SHA-256), of those in ``names`` (default: every one). Read where the tensors are (a
    Hub source by ranges, nothing downloaded)."""
    import hashlib

    import numpy as np

    from k3lab.pipeline.writing.convert import tensor_pieces

    out = {}
    for pt in plan_single(model, cfg, source):
        if names is not None and pt.name not in names:
            continue
        entries = {}
        for file in dict.fromkeys(source.weight_map[n] for n in pt.sources):
            entries.update(source.file_header(file)[0])
        h = hashlib.sha256()
        for piece in tensor_pieces(pt, Reader(source, entries)):
            h.update(memoryview(np.ascontiguousarray(piece)).cast("B"))
        out[pt.name] = (pt.info.type.name, tuple(pt.info.ne), h.hexdigest())
    return out


def compare_derived(
    file: str, recorded: dict[str, tuple[str, tuple[int, ...], str]], derived: dict, add: Any
) -> None:
    """``add(kind, file, line)`` for each tensor the source gives otherwise than the record says."""
    for name in sorted(derived.keys() - recorded.keys()):
        add("rederive", file, f"{file}: tensor {name}: the source gives it, the file lacks it")
    for name in sorted(derived.keys() & recorded.keys()):
        (t, ne, sha), (want_t, want_ne, want_sha) = recorded[name], derived[name]
        if (t, tuple(ne)) != (want_t, tuple(want_ne)):
            add(
                "rederive",
                file,
                f"{file}: tensor {name}: {t} {list(ne)}, the source gives {want_t} {list(want_ne)}",
            )
        elif sha != want_sha:
            add("rederive", file, f"{file}: tensor {name}: re-derived from the source, SHA-256 differs")


def convert_tokenizer(
    model: Model,
    meta_dir: str | Path,
    out: str | Path,
    chat_template: str | None = None,
    run_token: str | None = None,
) -> Path:
    """The standalone tokenizer GGUF (vocabulary and hyperparameters, no tensors), with its manifest
    record beside it, written holding the folder's lock (or as part of the run holding it)."""
    if model.tokenizer_kvs is None:
        raise K3LabError(f"{model.name}: has no standalone tokenizer")
    out = Path(out)
    folder = OutputFolder(out.parent)
    check_single_output(folder, out)
    kvs = model.tokenizer_kvs(
        Path(meta_dir), chat_template
    )  # every input checked before the folder is touched
    with folder.hold(run_token):
        check_single_output(folder, out)
        write_metadata_only(out, model.name, kvs)
        folder.records.write_single(out, "tokenizer", "tokenizer", out.stat().st_size, [])
    return out


def beside_names(model: Model, basename: str, config: Any) -> dict[str, str]:
    """The files a set of ``basename`` has beside it, by their record's key: the standalone tokenizer
    GGUF and the model's single file, named by its type (Kimi-K3: ``Kimi-K3-tokenizer.gguf``,
    ``mmproj-Kimi-K3-BF16.gguf``; from an F32 checkpoint, ``mmproj-Kimi-K3-F32.gguf``)."""
    names = {}
    if model.tokenizer_kvs is not None:
        names["tokenizer"] = model.tokenizer_name.format(basename=basename)
    if (single := model.single) is not None:
        type_name = single.type_name(config) if single.type_name is not None else ""
        names[single.key] = single.file_name.format(basename=basename, key=single.key, type=type_name)
    return names


def make_beside(
    model: Model,
    spec: SourceSpec,
    out_dir: str | Path,
    basename: str,
    chat_template: str | None,
    run_token: str,
) -> list[Any]:
    """The files beside the set, written into ``out_dir`` as part of the run holding it (a publishing
    run makes them once the set is whole); their records."""
    folder = OutputFolder(out_dir)
    names = beside_names(model, basename, model.load_config(spec.meta_dir))
    if "tokenizer" in names:
        convert_tokenizer(model, spec.meta_dir, folder.output(names["tokenizer"]), chat_template, run_token)
    if model.single is not None:
        convert_single(model, spec, folder.output(names[model.single.key]), run_token)
    records = [folder.records.read(f"{key}.json") for key in names]
    return [r for r in records if r is not None]
