"""``k3lab imatrix`` and what a notebook calls for the same: the importance matrix of a finished set,
computed a layer at a time (``pipeline.calibrating``), and what it covers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError

Say = Callable[[str], None]


def compute(req: Any, args: Any, say: Say | None = None) -> Any:
    """The imatrix of the set in ``req.out_dir``: a folder, or ``ORG/NAME[/FOLDER]`` on the Hub (at
    ``req.revision``; its state in the folder of ``--out``), computed here or on the Dask cluster at
    ``req.scheduler`` (``args``: the command's values, or a notebook's)."""
    from k3lab import values
    from k3lab.pipeline.calibrating import sets
    from k3lab.pipeline.calibrating.run import compute_imatrix, compute_until_covered
    from k3lab.pipeline.state import OutputFolder

    if not req.out_dir:
        raise K3LabError("imatrix: give the folder of a converted set, or ORG/NAME of a published one")
    model = req.load_model()
    opts = options(args, model)
    stages = None
    try:
        if req.scheduler:
            from k3lab.pipeline.calibrating.cluster import DaskStages

            stages = DaskStages(req.scheduler)
        if not values.is_repo(req.out_dir):
            if req.revision:
                raise K3LabError(f"--revision is for a set on the Hub; {req.out_dir} is a folder")
            folder = OutputFolder(req.out_dir)
            calib_set = sets.local_set(model, folder)
            if getattr(args, "until_covered", False):
                return compute_until_covered(model, calib_set, folder, opts, say, stages)
            return compute_imatrix(model, calib_set, folder, opts, say, stages)
        if not opts.out:
            raise K3LabError(f"imatrix {req.out_dir}: give --out FILE (its folder keeps the run's state)")
        folder = OutputFolder(Path(opts.out).parent)
        if getattr(args, "until_covered", False):
            raise K3LabError("--until-covered: on a set in a folder (a set on the Hub: give --chunks)")
        with _nothing_left_unless_begun(folder) as vocab:
            from k3lab.pipeline.hub.env import hub_env

            env = hub_env(req.retry_budget)
            calib_set = sets.hub_set(
                model, req.out_dir, req.revision, env.endpoint, env.token, vocab, env.budget
            )
            return compute_imatrix(model, calib_set, folder, opts, say, stages)
    finally:
        if stages is not None:
            stages.close()


@contextlib.contextmanager
def _nothing_left_unless_begun(folder: Any) -> Iterator[Path]:
    """The state folder made (yields where the vocabulary goes); when the block fails before the run
    saved its plan (bad input), what it made is removed again: the vocabulary, the folders it made."""
    from k3lab.formats.files import remove_regular
    from k3lab.pipeline.state.calibration import CalibrationState

    state = CalibrationState(folder.state)
    made = [p for p in (folder.path, folder.state, state.dir) if not os.path.lexists(p)]
    folder.create()
    state.make()
    try:
        yield state.path("vocab.gguf")
    except BaseException:
        if state.plan() is None:
            remove_regular(state.path("vocab.gguf"))
            for p in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(p)
        raise


def command_values(
    calibration: str | None = None,
    chunk_size: int = 512,
    chunks: int | None = None,
    out: str | None = None,
    threads: int | None = None,
    until_covered: bool = False,
) -> Any:
    """The command's values as a notebook, the demo or another command gives them (the rest as the
    command's defaults): what ``compute`` takes."""
    from types import SimpleNamespace

    return SimpleNamespace(calibration=calibration, chunk_size=chunk_size, chunks=chunks, out=out,
                           process_output=False, in_file=None, output_format="gguf", parse_special=False,
                           threads=threads, until_covered=until_covered)  # fmt: skip


def default_text(model: Any) -> Path:
    """The model's own calibration text (``Guide.calibration_text``)."""
    found = model.guide.calibration_text if model.guide is not None else None
    if found is None:
        raise K3LabError(f"{model.name}: no calibration text of its own: give --calibration TEXT")
    return Path(found)


def options(args: Any, model: Any) -> Any:
    """The command line's (or a notebook's) values as the stage's options (no ``--calibration``: the
    model's own text, read as it is meant to be: its special tokens parsed)."""
    from k3lab.pipeline.calibrating.run import ImatrixOptions

    own = not args.calibration
    return ImatrixOptions(
        calibration=str(default_text(model)) if own else args.calibration,
        chunk_size=args.chunk_size,
        chunks=args.chunks,
        out=args.out,
        process_output=args.process_output,
        in_files=tuple(args.in_file or ()),
        output_format=args.output_format,
        parse_special=args.parse_special or own,
        threads=args.threads,
    )


@dataclass
class Made:
    """What ``convert --imatrix-from`` made: the set's files, the imatrix, the variants' files."""

    converted: list[Any]
    imatrix: Any
    variants: list[Any]


def convert_then_variants(req: Any, asked: Any, text: str, say: Say | None = None) -> Made:
    """``convert --variants V --imatrix-from TEXT``: the set converted (and published, with
    ``--push-to``), its imatrix computed from ``TEXT`` (``own``: the model's own text) in its folder
    (recorded with the set), the variants made with it, and with ``--push-to`` the imatrix published
    beside the set. Every flag checked before any work."""
    import dataclasses

    from k3lab import request
    from k3lab.variants import quantize

    if not asked.variants:
        raise K3LabError("--imatrix-from makes the variants' imatrix: name them (--variants IQ2_XXS, ...)")
    if asked.imatrix:
        raise K3LabError("--imatrix and --imatrix-from both give the variants' imatrix: give one")
    if req.push_to and req.scheduler:
        raise K3LabError(
            "--imatrix-from with --push-to and --scheduler: the workers keep the set's files apart; publish the "
            "set, then `k3lab imatrix ORG/NAME --scheduler` and `k3lab quantize --imatrix`"
        )
    if req.push_to and not req.keep_local:
        raise K3LabError(
            "--imatrix-from with --push-to needs --keep-local: the imatrix and the variants are made from "
            "the set's files in --out-dir once it is whole"
        )
    if not req.out_dir:
        raise K3LabError("--out-dir: give the folder to write the set into")
    asked.build()  # (the variant flags checked before anything is converted)
    converted = request.convert(req, say)
    args = command_values(None if text == "own" else text, threads=asked.threads)
    set_req = dataclasses.replace(req, repo=None, revision=None, scheduler=req.scheduler)
    made = compute(set_req, args, say)
    variants = quantize(req, dataclasses.replace(asked, imatrix=str(made.path)), say)
    if req.push_to:
        request.publish(req, say)
    return Made(converted, made, variants)


@dataclass
class Statistics:
    """An imatrix file's figures, as ``llama-imatrix --show-statistics`` gives them, and its coverage."""

    path: Path
    tensors: list[Any]  # coverage.TensorStats, in llama-imatrix's order
    layers: list[tuple[int, float, float, float]]
    coverage: Any  # coverage.Coverage

    def table(self) -> str:
        """The two tables llama-imatrix prints, in its columns."""
        head = "\t".join([" Layer", "       Tensor", "          Σ(Act²)", "  Min", "            Max", "           μ",
                          "   σ", " % Active", "N", "   Entropy", "E (norm)", "ZD", "  CosSim"])  # fmt: skip
        rows = [f"{head}", "=" * 179, *(s.row() for s in self.tensors), ""]
        rows += [f"{'  Layer'}\t{'     μΣ(Act²)'}\t{'      μZD'}\t{'μCosSim'}", "=" * 48]
        rows += [f"{k:5d}\t{b:14.2f}\t{100 * z:10.4f}%\t{c:6.4f}" for k, b, z, c in self.layers]
        return "\n".join(rows)


def statistics(path: str | Path) -> Statistics:
    """The figures of the imatrix at ``path`` (a local GGUF or .dat): ``k3lab imatrix --show-statistics``."""
    from k3lab.pipeline.calibrating.coverage import coverage, layer_stats, tensor_stats
    from k3lab.pipeline.calibrating.output import entries_from_file

    try:
        entries = entries_from_file(path).entries
    except OSError as e:
        raise K3LabError(f"{path}: cannot be read ({e.strerror or e})") from None
    stats = tensor_stats(entries)
    return Statistics(Path(path), stats, layer_stats(stats), coverage(entries))
