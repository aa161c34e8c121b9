"""The `imatrix` row: the importance matrix of a real-width MoE layer set (a `layer` checkpoint: one dense
layer, one MoE layer of 16 experts at Kimi-K3's expert dims, top-8) made by `k3lab imatrix` and by
llama.cpp's own `llama-imatrix` (the vendored tree's, on the same libggml), paired, the same text
(k3lab's own calibration text, its special tokens parsed), the same cores: 12 chunks of 64 tokens (the
issue's yardstick) and 8 of 512 (llama-imatrix's default chunk); wall time, peak RSS, and whether
every entry is the same bits. Then the real model's forecast: the MoE layer's time per chunk measured
here, scaled by the weights a token passes through per layer (the real plan's against this set's:
the compute of a forward is that), the memory of a task (the real layer's weights, plus what the
set's step held besides its weights), the state between layers (the arrays alive at once)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import _full_checkpoint, row
from benchmarks.variants import _run_timed_in

CASES = ((64, 12), (512, 8))


def _touched_per_token(tensors: list[tuple[str, tuple[int, ...]]], topk: int) -> int:
    """Weights one token multiplies by in a layer: every matrix, of an expert stack the chosen ones."""
    total = 0
    for name, ne in tensors:
        if len(ne) < 2:
            continue
        per = ne[0] * ne[1]
        total += per * topk if "_exps" in name and len(ne) == 3 else math.prod(ne)
    return total


@row
def bench_imatrix() -> list[tuple[str, str, str]]:
    import gguf

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from llama_tree import llama_imatrix

    from k3lab.kimi_k3.calibration_text import FILE
    from k3lab.kimi_k3.synth import synthesize

    judge = llama_imatrix()
    results: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        tmp = Path(tmp).resolve()
        synthesize("layer", tmp / "src")
        subprocess.run([sys.executable, "-m", "k3lab", "convert", "--meta", str(tmp / "src"), "--out-dir",
                        str(tmp / "set"), "--quiet"], check=True, capture_output=True)  # fmt: skip
        first = next((tmp / "set").glob("*.gguf"))
        size = first.stat().st_size
        (tmp / "calib.txt").write_bytes(FILE.read_bytes())
        cores = str(os.cpu_count())
        rss_512 = 0
        for n_ctx, chunks in CASES:
            flags = ["-c", str(n_ctx), "--chunks", str(chunks), "--parse-special"]
            llama = [str(judge), "-m", str(first), "-f", "calib.txt", "-o", "ref.gguf", "-t", cores, *flags]
            ours = [sys.executable, "-m", "k3lab", "imatrix", str(tmp / "set"), "--calibration", "calib.txt",
                    "--out", "ours.gguf", "--threads", cores, "--quiet", *flags]  # fmt: skip
            os.sync()
            t_llama, rss_llama, _ = _run_timed_in(llama, tmp)
            os.sync()
            t_ours, rss_ours, _ = _run_timed_in(ours, tmp)
            rss_512 = rss_ours if n_ctx == 512 else rss_512
            a, b = gguf.GGUFReader(tmp / "ours.gguf"), gguf.GGUFReader(tmp / "ref.gguf")
            same = {t.name: bytes(t.data) for t in a.tensors} == {t.name: bytes(t.data) for t in b.tensors}
            results += [
                (f"imatrix, layer set ({size / 1e9:.2f} GB), {chunks} chunks of {n_ctx}: k3lab imatrix",
                 f"{t_ours:.1f} s", f"{t_ours / t_llama:.2f}x llama-imatrix ({t_llama:.1f} s); "
                 f"{'every entry the same bits' if same else 'ENTRIES DIFFER'}"),
                ("  peak RSS", f"{rss_ours / 2**20:.0f} MiB",
                 f"llama-imatrix {rss_llama / 2**20:.0f} MiB (it maps the whole set)"),
            ]  # fmt: skip
        results += _forecast(tmp, rss_512)
    return results


def _graph_bytes(
    kvs: dict, step: object, weights: dict[str, tuple[str, tuple[int, ...]]]
) -> tuple[int, int, int]:
    """A chunk of 512's graph at the real shapes, built without memory: (what ggml's allocator takes
    for it, the inputs of its products over a batch of 4 chunks, the largest weight ggml repacks)."""
    import numpy as np

    from k3lab.formats.ggml import TYPE_IDS
    from k3lab.formats.ggml_compute import Graph, Tensor, _Context
    from k3lab.formats.ggml_lib import lib, row_size
    from k3lab.formats.ggml_weights import repacked
    from k3lab.kimi_k3.calibration import CALIBRATION
    from k3lab.pipeline.calibrating.batches import ubatches

    class Shapes:
        def __init__(self) -> None:
            # (memory asked for, never touched: the system gives address space, not pages; the weights
            # then have an address, so ggml's allocator leaves them out as it leaves out real ones)
            size = sum(row_size(TYPE_IDS[ty], ne[0]) * math.prod(ne[1:]) + 64 for ty, ne in weights.values())
            self.ctx = _Context(size, len(weights))
            self.t = {n: Tensor(self.ctx.new(TYPE_IDS[ty], ne)) for n, (ty, ne) in weights.items()}

        def tensor(self, name: str) -> Tensor:
            return self.t[name]

        def has(self, name: str) -> bool:
            return name in self.t

    width = int(kvs["kimi-k3.embedding_length"])
    shapes = Shapes()
    try:
        with Graph(measure=True) as g:
            inputs = {n: g.input(np.zeros((512, width), np.float32)) for n in step.reads}  # type: ignore[attr-defined]
            slices = [(a, b) for a, b, _ in ubatches(0, 100, 512)]
            CALIBRATION.build(kvs, step, g, shapes, inputs, slices)  # type: ignore[arg-type]
            held = 4 * sum(int(lib().base.ggml_nbytes(p.x.ptr)) for p in g.products)
            staging = max((lib().base.ggml_nbytes(t.ptr) for n, t in shapes.t.items()
                           if repacked(TYPE_IDS[weights[n][0]], weights[n][1])), default=0)  # fmt: skip
            return g.reserve(), held, int(staging)
    finally:
        shapes.ctx.close()


def _forecast(tmp: Path, rss_512: int) -> list[tuple[str, str, str]]:
    """The real model: a MoE layer's time per 100 chunks of 512 on this machine's cores, the whole
    model on one machine and on a worker per layer, memory per task, the state between layers."""
    from k3lab.imatrix import command_values, compute
    from k3lab.kimi_k3.calibration import CALIBRATION
    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.calibrating.sets import local_set
    from k3lab.pipeline.state import OutputFolder
    from k3lab.request import Request

    # the set's steps, timed one by one (in this process: the MoE layer's step alone)
    stamps: list[tuple[float, str]] = []
    args = command_values(str(tmp / "calib.txt"), 512, 8, out=str(tmp / "t.gguf"))
    args.parse_special = True
    compute(Request(out_dir=str(tmp / "set")), args, lambda line: stamps.append((time.perf_counter(), line)))
    stamps.append((time.perf_counter(), "end"))
    steps = {stamps[i][1]: stamps[i + 1][0] - stamps[i][0] for i in range(len(stamps) - 1)}
    moe = max(v for k, v in steps.items() if "layer" in k)  # (the MoE layer: the slowest step)
    here = local_set(MODEL, OutputFolder(tmp / "set"))
    kvs = here.kvs
    moe_layer = max(
        (s for s in CALIBRATION.steps(kvs) if s.layer >= 0),
        key=lambda s: sum(here.tensors[n].record.nbytes for n in here.tensors if s.owns(n)),
    )
    mine = [(n, tuple(t.record.ne)) for n, t in here.tensors.items() if moe_layer.owns(n)]
    weights_here = sum(here.tensors[n].record.nbytes for n, _ in mine)
    per_token_here = _touched_per_token(mine, int(kvs["kimi-k3.expert_used_count"]))

    full = _full_checkpoint(tmp)
    subprocess.run([sys.executable, "-m", "k3lab", "plan", "--meta", str(full), "--out-dir", str(tmp / "fullplan")],
                   check=True, capture_output=True)  # fmt: skip
    folder = OutputFolder(tmp / "fullplan")
    plan = folder.plans.require(MODEL)
    real_kvs = {kv.key: kv.value for kv in folder.plans.kvs(plan)}
    real_steps = CALIBRATION.steps(real_kvs)
    topk = int(real_kvs["kimi-k3.expert_used_count"])
    tensors = [(t.name, tuple(t.info.ne)) for f in plan.files for t in f.tensors]  # type: ignore[attr-defined]
    nbytes = {t.name: t.nbytes for f in plan.files for t in f.tensors}
    layers = [s for s in real_steps if s.layer >= 0 and s.writes]
    per_layer = {s.name: [(n, ne) for n, ne in tensors if s.owns(n)] for s in layers}
    worst = max(layers, key=lambda s: _touched_per_token(per_layer[s.name], topk))
    scale = _touched_per_token(per_layer[worst.name], topk) / per_token_here
    per_chunk = moe / 8
    hundred = per_chunk * scale * 100
    total = sum(
        per_chunk * _touched_per_token(per_layer[s.name], topk) / per_token_here * 100 for s in layers
    )
    biggest_step = max(layers, key=lambda s: sum(nbytes[n] for n, _ in per_layer[s.name]))
    biggest = sum(nbytes[n] for n, _ in per_layer[biggest_step.name])
    types = {t.name: t.info.type.name for f in plan.files for t in f.tensors}
    shapes = {n: (types[n], ne) for n, ne in per_layer[biggest_step.name]}
    graph, held, staging = _graph_bytes(real_kvs, biggest_step, shapes)
    overhead = max(0, rss_512 - weights_here)  # (k3lab imatrix's peak at 512: one step held at a time)
    width = int(real_kvs["kimi-k3.embedding_length"])
    alive = 1 + len({n for s in real_steps for n in s.writes if n.startswith("bank.")})
    state = alive * 100 * 512 * width * 4
    cores = os.cpu_count()
    return [
        ("Kimi-K3 imatrix, a MoE layer per 100 chunks of 512 (forecast)", f"{hundred / 3600:.1f} h",
         f"on this machine's {cores} cores: {per_chunk:.1f} s per chunk measured on the set's MoE layer, "
         f"x{scale:.1f} the weights a token passes through in Kimi-K3's heaviest layer"),
        ("Kimi-K3 imatrix, the whole model, 100 chunks (forecast)", f"{total / 3600:.0f} h",
         f"one machine of {cores} cores, layer after layer; on {len(layers)} such workers (a layer each, "
         f"k3lab imatrix --scheduler) about {max(total / len(layers), hundred) / 3600:.1f} h plus a wave's fill"),
        ("  memory per task (forecast)", f"{(biggest + staging + graph + held) / 1e9:.1f} GB",
         f"the heaviest layer's weights ({biggest / 1e9:.1f} GB) + the largest expert stack once more while "
         f"ggml repacks it ({staging / 1e9:.1f} GB) + a chunk's graph ({graph / 1e9:.1f} GB) + a batch's "
         f"products' inputs ({held / 1e9:.1f} GB), from the real shapes (measured on the set here: "
         f"{overhead / 1e9:.2f} GB besides its weights)"),
        ("  state between layers, 100 chunks (forecast)", f"{state / 1e9:.1f} GB",
         f"{alive} arrays of [100 x 512 x {width}] float32 at once (x and the AttnRes bank), on the client's disk"),
    ]  # fmt: skip
