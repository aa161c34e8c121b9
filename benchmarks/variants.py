"""The `variants` row: a real-size MoE file (a `layer` checkpoint's layer 1: 16 experts at Kimi-K3's
dims, 318 MB) quantised by `k3lab quantize` and by llama.cpp's own `llama-quantize` (the vendored tree's
tool, built against the same libggml: `tests/llama_tree.py`), the whole set each time, the same cores,
in paired rounds: to Q2_K, and to IQ2_XXS with an imatrix llama-imatrix made on it; the bytes must be
equal. Then the forecast for the whole model per variant: the size from the plan of the real model's
headers (`synth --preset full`, K3LAB_FULL reuses one), the time from each target type's measured
speed on this machine (ggml's own kernel, all cores) over the weights it takes."""

from __future__ import annotations

import filecmp
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import _full_checkpoint, _median, row

ROUNDS = 3
TYPES = ("Q2_K", "IQ2_XXS")
FORECAST = ("MoE-IQ1_S", "IQ2_XXS", "MoE-IQ2_XXS", "Q2_K", "MoE-Q2_K", "MoE-Q3_K", "MXFP4-Q8_0")


def _judges() -> tuple[Path, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from llama_tree import llama_imatrix, llama_quantize

    return llama_quantize(), llama_imatrix()


def _speeds(types: set[str]) -> dict[str, float]:
    """Weights per second of each type's kernel on all cores (ggml_quantize_chunk on rows of 7168,
    with an imatrix), and of a copy (a type that stays)."""
    import time

    import numpy as np

    from k3lab.formats.ggml import TYPE_IDS, ggml
    from k3lab.pipeline.quantizing.quantize import _spans, threads

    lib, pool = ggml(), threads()
    rows = np.random.default_rng(0).standard_normal((1024, 7168), dtype=np.float32) * 0.02
    im = np.abs(np.random.default_rng(1).standard_normal(7168, dtype=np.float32)) + 0.1
    out = {}
    for name in types:
        tid = TYPE_IDS[name]
        buf = np.empty(1024 * lib.traits(tid).row_bytes(7168), dtype=np.uint8)
        step = lib.traits(tid).row_bytes(7168)
        t = time.perf_counter()
        jobs = [
            pool.pool.submit(lib.quantize, tid, rows[a:b], buf[a * step : b * step], im)
            for a, b in _spans(1024, pool.n)
        ]
        for j in jobs:
            j.result()
        out[name] = rows.size / (time.perf_counter() - t)
    return out


@row
def bench_variants() -> list[tuple[str, str, str]]:
    from k3lab.kimi_k3.synth import synthesize

    quantize, imatrix = _judges()
    results: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        tmp = Path(tmp).resolve()  # (the commands run in it: paths absolute)
        synthesize("layer", tmp / "src")
        subprocess.run([sys.executable, "-m", "k3lab", "convert", "--meta", str(tmp / "src"), "--out-dir",
                        str(tmp / "set"), "--split-max-tensors", "1", "--quiet"], check=True, capture_output=True)  # fmt: skip
        first = tmp / "set" / "Kimi-K3-MXFP4-00001-of-00003.gguf"
        size = (tmp / "set" / "Kimi-K3-MXFP4-00002-of-00003.gguf").stat().st_size
        calib = tmp / "calib.txt"
        calib.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 400))
        subprocess.run([str(imatrix), "-m", str(first), "-f", str(calib), "-o", str(tmp / "imatrix.gguf"), "-c", "64",
                        "--chunks", "16", "-t", str(os.cpu_count())], check=True, capture_output=True)  # fmt: skip
        for ftype in TYPES:
            im = ["--imatrix", "imatrix.gguf"] if ftype.startswith("IQ") else []
            times: dict[str, list[float]] = {"k3lab": [], "llama": []}
            rss = {"k3lab": 0, "llama": 0}
            same = True
            for _ in range(ROUNDS):
                ref = tmp / f"ref-{ftype}"
                ref.mkdir(exist_ok=True)
                llama = [str(quantize), "--keep-split", "--allow-requantize", *im, str(first),
                         str(ref / f"Kimi-K3-{ftype}.gguf"), ftype, str(os.cpu_count())]  # fmt: skip
                ours = [sys.executable, "-m", "k3lab", "quantize", str(tmp / "set"), "--type", ftype, *im,
                        "--force", "--quiet"]  # fmt: skip
                for key, cmd in (("llama", llama), ("k3lab", ours)):
                    os.sync()
                    seconds, peak, _ = _run_timed_in(cmd, tmp)
                    times[key].append(seconds)
                    rss[key] = max(rss[key], peak)
                same &= all(
                    filecmp.cmp(p, ref / p.name, shallow=False) for p in (tmp / "set" / ftype).glob("*.gguf")
                )
            k, ll = _median(times["k3lab"]), _median(times["llama"])
            results += [
                (f"MoE file ({size / 1e6:.0f} MB) to {ftype}{' + imatrix' if im else ''}: k3lab quantize",
                 f"{k:.1f} s", f"{k / ll:.2f}x llama-quantize ({ll:.1f} s), medians of {ROUNDS} paired; "
                 f"{'byte-identical' if same else 'BYTES DIFFER'}"),
                ("  peak RSS", f"{rss['k3lab'] / 2**20:.0f} MiB", f"llama-quantize {rss['llama'] / 2**20:.0f} MiB"),
            ]  # fmt: skip
        results += _forecast(tmp)
    return results


def _run_timed_in(cmd: list[str], cwd: Path) -> tuple[float, int, str]:
    """Wall seconds and peak RSS (bytes) of a command run in ``cwd`` (its output is bytes: llama.cpp
    prints token pieces that are not UTF-8)."""
    import time

    with tempfile.NamedTemporaryFile("r") as tf:
        t = time.perf_counter()
        subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", tf.name, *cmd], check=True, capture_output=True, cwd=cwd
        )
        return time.perf_counter() - t, int(tf.read().split()[-1]) * 1024, ""


def _forecast(tmp: Path) -> list[tuple[str, str, str]]:
    """The whole model per variant: its size (the plan of the real headers) and the time its tensors
    take at the speeds measured here."""
    from k3lab.pipeline.quantizing.variant import tensor_bytes
    from k3lab.request import Request
    from k3lab.variants import VariantRequest, forecast

    full = _full_checkpoint(tmp)
    subprocess.run([sys.executable, "-m", "k3lab", "plan", "--meta", str(full), "--out-dir", str(tmp / "fullplan")],
                   check=True, capture_output=True)  # fmt: skip
    plans = forecast(Request(out_dir=str(tmp / "fullplan")), VariantRequest(",".join(FORECAST)))
    speeds = _speeds({t.type for vp in plans for f in vp.files for t in f.tensors if t.quantized})
    rows = []
    for vp in plans:
        weights = sum(math.prod(t.ne) for f in vp.files for t in f.tensors)
        work = sum(math.prod(t.ne) / speeds[t.type] for f in vp.files for t in f.tensors if t.quantized)
        copied = sum(
            tensor_bytes(t.source_type, t.ne) for f in vp.files for t in f.tensors if not t.quantized
        )
        rows.append((
            f"Kimi-K3 as {vp.label} (forecast)", f"{vp.nbytes / 1e9:,.0f} GB",
            f"{8 * vp.nbytes / weights:.2f} bits/weight; {work / 3600:.1f} h of quantising on this machine's "
            f"{os.cpu_count()} cores ({copied / 1e9:,.0f} GB copied as they are)",
        ))  # fmt: skip
    return rows
