"""k3lab benchmarks: `python benchmarks/run.py [ROW ...]` prints a table.

Every figure is a ratio against a peer measured in the same run (memcpy, `cp`, or the
straightforward implementation), because these machines are shared and noisy. Rows:
  repack      MXFP4 repack of one [3072, 3584] expert vs a numpy copy of the same bytes and vs
              the unpack/stack implementation
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

from k3lab import mxfp4

ROWS: dict[str, Callable[[], list[tuple[str, str, str]]]] = {}


def row(fn: Callable[[], list[tuple[str, str, str]]]) -> Callable[[], list[tuple[str, str, str]]]:
    ROWS[fn.__name__.removeprefix("bench_")] = fn
    return fn


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@row
def bench_repack() -> list[tuple[str, str, str]]:
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3072, 1792), dtype=np.uint8)
    scale = rng.integers(100, 130, (3072, 112), dtype=np.uint8)
    out = np.empty((3072, 112 * 17), dtype=np.uint8)
    nbytes = packed.nbytes + scale.nbytes
    mxfp4.repack_into(packed, scale, out)  # compile / warm up
    t_repack = best_of(lambda: mxfp4.repack_into(packed, scale, out))
    t_copy = best_of(lambda: np.copyto(out.reshape(-1)[: packed.size], packed.reshape(-1)))
    t_simple = best_of(lambda: mxfp4.repack_unpack_stack(packed, scale), repeat=3)
    gbs = nbytes / t_repack / 1e9
    return [
        ("MXFP4 repack, one [3072, 3584] expert (1 core)", f"{gbs:.2f} GB/s", ""),
        (
            "  vs numpy copy of the same bytes",
            f"{t_repack / t_copy:.2f}x copy time",
            f"copy {packed.nbytes / t_copy / 1e9:.2f} GB/s",
        ),
        (
            "  vs unpack/stack implementation",
            f"{t_simple / t_repack:.1f}x faster",
            f"unpack/stack {nbytes / t_simple / 1e9:.2f} GB/s",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", choices=[[], *ROWS], help="rows to run (default: all)")
    args = p.parse_args(argv)
    results = []
    for name in args.rows or list(ROWS):
        results += ROWS[name]()
    w = max(len(r[0]) for r in results)
    print(f"{'benchmark':<{w}}  {'result':>20}  notes")
    for label, value, note in results:
        print(f"{label:<{w}}  {value:>20}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
