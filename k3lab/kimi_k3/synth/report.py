"""A human-readable summary of a synthetic checkpoint (what `k3lab synth` prints)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from k3lab.formats.safetensors import read_header
from k3lab.util import human_bytes

from .generate import SynthResult


def describe(result: SynthResult, max_rows: int = 12) -> str:
    files = list(result.files)
    lines = [
        f"synthetic Kimi-K3 '{result.preset}' checkpoint in {result.out}, laid out {result.layout}",
        f"{'file':<38} {'tensors':>8} {'bytes':>12}  dtypes",
    ]
    for i, fname in enumerate(files):
        if i == max_rows // 2 and len(files) > max_rows:
            lines.append(f"{'...':<38} ({len(files) - max_rows} more files)")
        if max_rows // 2 <= i < len(files) - max_rows // 2 and len(files) > max_rows:
            continue
        entries, _ = read_header(result.out / fname)
        dtypes = Counter(e.dtype for e in entries.values())
        size = sum(e.nbytes for e in entries.values())
        lines.append(
            f"{fname:<38} {len(entries):>8} {human_bytes(size):>12}  "
            + ", ".join(f"{k}:{v}" for k, v in sorted(dtypes.items()))
        )
    lines.append(
        f"{result.n_shards} files{' and an index' if result.n_shards > 1 else ', no index'}, {result.n_tensors} tensors, {human_bytes(result.data_bytes)} of "
        f"tensor data, {human_bytes(result.disk_bytes)} on disk; tokenizer: tiktoken.model + "
        "tokenizer_config.json"
    )
    return "\n".join(lines)


def synth_cli(req: Any, args: Any) -> int:
    """`k3lab synth`: write the checkpoint and describe it."""
    from k3lab.kimi_k3.synth.generate import synthesize

    made = synthesize(
        args.preset, args.out, seed=args.seed, experts=args.experts, draw=args.draw, layout=args.layout
    )
    print(describe(made))
    return 0
