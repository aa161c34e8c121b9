"""``k3lab imatrix`` and what a notebook calls for the same: the importance matrix of a finished set,
computed a layer at a time (``pipeline.calibrating``), and what it covers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError

Say = Callable[[str], None]


def compute(req: Any, args: Any, say: Say | None = None) -> Any:
    """The imatrix of the set in ``req.out_dir`` (``args``: the command's values, or a notebook's)."""
    from k3lab.pipeline.calibrating.run import compute_imatrix

    if not req.out_dir:
        raise K3LabError("imatrix: give the folder of a converted set")
    model = req.load_model()
    return compute_imatrix(model, req.out_dir, options(args, model), say)


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
