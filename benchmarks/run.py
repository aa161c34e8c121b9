"""k3lab benchmarks: `python benchmarks/run.py [ROW ...]` prints a table.

Every figure is a ratio against a peer measured in the same run (memcpy, `cp`, or the
straightforward implementation), because these machines are shared and noisy. Rows:
  repack      MXFP4 repack of one [3072, 3584] expert vs a numpy copy of the same bytes and vs
              the unpack/stack implementation
  tokenizer   GGUF vocabulary of the real size (163,840 ids) vs the straightforward per-token BPE
              reconstruction (as upstream does it) on the same vocabulary; the merges must agree
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


@row
def bench_tokenizer() -> list[tuple[str, str, str]]:
    import base64
    import json
    import tempfile
    from pathlib import Path

    from k3lab.config import K3Config
    from k3lab.synth.generate import write_tokenizer_files
    from k3lab.synth.presets import real_config
    from k3lab.tokenizer import build_vocabulary, merges_reference, token_to_unicode

    with tempfile.TemporaryDirectory() as tmp:
        meta = Path(tmp)
        raw = real_config()
        (meta / "config.json").write_text(json.dumps(raw))
        write_tokenizer_files(meta, K3Config.from_dict(raw), seed=0)
        build_vocabulary(meta)  # warm the compiled kernel's cache
        t = time.perf_counter()
        vocab = build_vocabulary(meta)
        t_fast = time.perf_counter() - t

        t = time.perf_counter()  # the straightforward way: per line, per token, per merge in Python
        tokens = [
            base64.b64decode(line.split()[0]) for line in (meta / "tiktoken.model").read_text().splitlines()
        ]
        strings = [token_to_unicode(tok) for tok in tokens]
        merges = [f"{token_to_unicode(a)} {token_to_unicode(b)}" for a, b in merges_reference(tokens)]
        t_ref = time.perf_counter() - t
    same = merges == vocab.merges and strings == vocab.tokens[: len(strings)]
    return [
        (
            f"tokenizer -> GGUF vocabulary, {len(vocab.tokens):,} ids, {len(merges):,} merges",
            f"{t_fast:.2f} s",
            f"merges identical: {same}",
        ),
        (
            "  vs straightforward per-token BPE reconstruction",
            f"{t_ref / t_fast:.1f}x faster",
            f"straightforward {t_ref:.2f} s",
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
