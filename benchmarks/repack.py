"""The `repack` row: MXFP4 repack of one [3072, 3584] expert vs a numpy copy of the same bytes and vs the
unpack/stack implementation"""

from __future__ import annotations

import numpy as np

from benchmarks.common import best_of, row
from k3lab.formats import mxfp4


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
