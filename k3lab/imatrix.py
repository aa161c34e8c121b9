"""``k3lab imatrix`` and what a notebook calls for the same: the importance matrix of a finished set,
computed a layer at a time (``pipeline.calibrating``), and what it covers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError

Say = Callable[[str], None]
DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration" / "k3lab-calibration-v1.txt"


def compute(req: Any, options: Any, say: Say | None = None) -> Any:
    """The imatrix of the set in ``req.out_dir`` (``options``: ``ImatrixOptions``)."""
    from k3lab.pipeline.calibrating.run import compute_imatrix

    if not req.out_dir:
        raise K3LabError("imatrix: give the folder of a converted set")
    return compute_imatrix(req.load_model(), req.out_dir, options, say)


def options(args: Any) -> Any:
    """The command line's (or a notebook's) values as the stage's options."""
    from k3lab.pipeline.calibrating.run import ImatrixOptions

    return ImatrixOptions(
        calibration=args.calibration or str(DEFAULT_CALIBRATION),
        chunk_size=args.chunk_size,
        chunks=args.chunks,
        out=args.out,
        process_output=args.process_output,
        in_files=tuple(args.in_file or ()),
        output_format=args.output_format,
        parse_special=args.parse_special,
        threads=args.threads,
    )
