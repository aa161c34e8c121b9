"""`python benchmarks/run.py [ROW ...]`: the rows asked for (default: all), one table, the commit, date and
machine above it. The rows are described in the package's docstring (`benchmarks/__init__.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (run as a script: the package beside it)

import benchmarks  # noqa: E402
from benchmarks import (  # noqa: E402,F401 (each registers its row)
    cluster,
    dense,
    fit_proof,
    fit_table,
    fullscale,
    imatrix,
    layer,
    layouts,
    notebooks,
    remote,
    repack,
    rerun,
    startup,
    tokenizer,
    variants,
)
from benchmarks.common import ROWS, _machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=benchmarks.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("rows", nargs="*", choices=[[], *ROWS], help="rows to run (default: all)")
    args = p.parse_args(argv)
    results = []
    for name in args.rows or list(ROWS):
        results += ROWS[name]()
    w = max(len(r[0]) for r in results)
    print(_machine())
    print(f"{'benchmark':<{w}}  {'result':>20}  notes")
    for label, value, note in results:
        print(f"{label:<{w}}  {value:>20}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
