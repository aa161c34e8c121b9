"""The `fullscale` row: on `synth --preset full` (the real 96-shard headers; data as sparse holes, so
reading costs no disk): planning once vs loading the saved plan, the fixed cost of a task before its
first byte, re-running a complete shard, one MoE shard vs `dd conv=fsync` of the same size, --jobs 1 vs
--jobs 2 on two MoE shards, and peak RSS per shard kind vs the plan's forecast. Needs ~40 GB free disk
(output files are deleted as it goes); K3LAB_FULL=DIR reuses a synthesised full checkpoint."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from benchmarks.common import (
    FULL_TASK_SETUP,
    LAYER_ROUNDS,
    ROUNDS,
    _dd_seconds,
    _fresh,
    _median,
    _run_timed,
    _timed,
    row,
)
from k3lab.kimi_k3.model import MODEL
from k3lab.pipeline.state import OutputFolder


@row
def bench_fullscale() -> list[tuple[str, str, str]]:
    import subprocess
    import tempfile

    from k3lab.kimi_k3.synth import synthesize

    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        src = Path(os.environ.get("K3LAB_FULL") or Path(tmp) / "full")
        if not (src / "config.json").exists():
            synthesize("full", src)
        out = Path(tmp) / "out"
        k3 = [sys.executable, "-m", "k3lab"]
        base = [*k3, "convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]

        t_plan, rss_plan, _ = _run_timed([*k3, "plan", "--meta", str(src), "--out-dir", str(out)])
        t_load, rss_load, _ = _run_timed([*k3, "plan", "--meta", str(src), "--out-dir", str(out)])
        rows += [
            (
                "full: plan 94 headers once, save .k3lab/plan.json",
                f"{t_plan:.1f} s",
                f"peak RSS {rss_plan / 2**20:.0f} MiB",
            ),
            (
                "  load the saved plan (inputs unchanged)",
                f"{t_load:.2f} s",
                f"peak RSS {rss_load / 2**20:.0f} MiB; {t_plan / t_load:.0f}x faster",
            ),
        ]
        r = subprocess.run(
            [sys.executable, "-c", FULL_TASK_SETUP, str(out), str(src), "2"],
            check=True,
            capture_output=True,
            text=True,
        )
        imports, setup = map(float, r.stdout.split())
        rows.append(
            (
                "  task fixed cost before its first byte (MoE shard)",
                f"{setup:.3f} s",
                f"load plan + read its header; imports {imports:.2f} s",
            )
        )

        saved = OutputFolder(out).plans.require(MODEL)
        forecast = {f.number: f.memory for f in saved.files}
        nbytes = {f.number: f.nbytes for f in saved.files}
        kinds = {
            1: "shard 1 (dense FFN, KDA, vocabulary)",
            4: "shard 4 (MoE, MLA)",
            94: "shard 94 (embeddings, lm_head)",
        }
        for k, label in kinds.items():
            os.sync()
            t, rss, _ = _run_timed([*base, "--shards", str(k)])
            rows.append(
                (
                    f"  peak RSS {label}",
                    f"{rss / 2**20:.0f} MiB",
                    f"forecast {forecast[k] / 2**20:.0f} MiB ({100 * (forecast[k] / rss - 1):+.0f}%); {t:.1f} s",
                )
            )
            if k == 1:
                t_again, rss_again, _ = _run_timed([*base, "--shards", "1"])
                rows.append(
                    (
                        "  re-run on the complete shard 1",
                        f"{t_again:.2f} s",
                        f"peak RSS {rss_again / 2**20:.0f} MiB (whole command)",
                    )
                )
            for f in out.glob("*.gguf"):
                f.unlink()
        # the three speed figures, each in paired rounds (k3lab then its peer, same cache state) and
        # as medians: this machine is shared, and dd of the same bytes varies by 2x between runs
        size = nbytes[2]
        moe, dd, direct = [], [], []
        for _ in range(ROUNDS):
            _fresh(out)
            moe.append(_run_timed([*base, "--shards", "2", "--force"])[0])
            _fresh(out)  # k3lab's file goes first: the disk needs room for dd's
            dd.append(_dd_seconds(Path(tmp), size))
            direct.append(_dd_seconds(Path(tmp), size, "oflag=direct"))
        rows += [
            (
                f"  MoE shard 2 ({size / 1e9:.1f} GB out): convert + hash + fsync (whole command)",
                f"{_median(moe):.1f} s",
                f"{ROUNDS} runs {', '.join(f'{t:.1f}' for t in moe)} s",
            ),
            (
                "    vs dd conv=fsync of the same size (paired, medians)",
                f"{_median([m / d for m, d in zip(moe, dd)]):.2f}x dd",
                f"dd {', '.join(f'{t:.1f}' for t in dd)} s; target <= 1.3x",
            ),
            (
                "    vs dd oflag=direct conv=fsync (the disk's own write speed)",
                f"{_median([m / d for m, d in zip(moe, direct)]):.2f}x disk",
                f"dd {', '.join(f'{t:.1f}' for t in direct)} s: "
                f"{_median([size / d for d in direct]) / 1e9:.2f} GB/s",
            ),
        ]
        # a one-layer shard of real data (64 real-size experts, 1.1 GB): the whole command, start-up
        # included, against cp && sync of the same file
        layer = Path(tmp) / "layer64"
        synthesize("layer", layer, experts=64)
        shard = next(layer.glob("model-00002-of-*.safetensors"))  # (layer 1, Moonshot's name)
        lout = Path(tmp) / "lout"
        lbase = [
            *k3,
            "convert",
            "--meta",
            str(layer),
            "--out-dir",
            str(lout),
            "--quiet",
            "--split-max-tensors",
            "1",
        ]
        lbase += ["--shards", "2"]
        subprocess.run([*lbase], check=True, capture_output=True)  # the plan, made once
        conv, cps = [], []
        for _ in range(LAYER_ROUNDS):
            _fresh(lout)
            conv.append(_run_timed([*lbase, "--force"])[0])
            _fresh(lout)
            cps.append(_timed(["sh", "-c", f"cp {shard} {tmp}/copy && sync {tmp}/copy"]))
            Path(tmp, "copy").unlink()
        rows.append(
            (
                f"  layer shard ({shard.stat().st_size / 1e9:.2f} GB), whole command vs cp && sync",
                f"{_median([c / p for c, p in zip(conv, cps)]):.2f}x cp+sync",
                f"k3lab {', '.join(f'{t:.2f}' for t in conv)} s, cp+sync {', '.join(f'{t:.2f}' for t in cps)} s; "
                "target <= 1.5x",
            )
        )
        # two MoE shards, one process vs two, and the disk's own speed for their bytes: where one
        # process already writes at the disk's speed, a second has nothing left to gain
        walls: dict[int, list[float]] = {1: [], 2: []}
        floor = []
        for _ in range(max(2, ROUNDS - 1)):
            for jobs in (1, 2):
                _fresh(out)
                walls[jobs].append(_run_timed([*base, "--shards", "2-3", "--jobs", str(jobs), "--force"])[0])
            _fresh(out)
            floor.append(_dd_seconds(Path(tmp), nbytes[2] + nbytes[3], "oflag=direct"))
        rows += [
            (
                "  shards 2-3: --jobs 2 vs --jobs 1 (paired, medians)",
                f"{_median([a / b for a, b in zip(walls[1], walls[2])]):.2f}x faster",
                f"--jobs 1 {', '.join(f'{t:.1f}' for t in walls[1])} s, --jobs 2 "
                f"{', '.join(f'{t:.1f}' for t in walls[2])} s (2 cores); target >= 1.6x where the disk allows",
            ),
            (
                "    each vs the disk: dd oflag=direct of their 2 files' bytes",
                " / ".join(f"{_median([w / f for w, f in zip(walls[j], floor)]):.2f}x" for j in (1, 2)),
                f"--jobs 1 / --jobs 2; dd {', '.join(f'{t:.1f}' for t in floor)} s: the disk allows at most "
                f"{_median([a / f for a, f in zip(walls[1], floor)]):.2f}x for any --jobs",
            ),
        ]
        _fresh(out)
        shutil.rmtree(out, ignore_errors=True)
    return rows
