"""The `fit` row: what `quantize --fit-ram` chooses for Kimi-K3 on common machines, from the plan of the
real headers (`synth --preset full`; K3LAB_FULL=DIR reuses one) and the losses per weight measured on
synth's `widths` preset (every real width, a few layers and experts; its imatrix: tests/data), foretold
per tensor (`pipeline.quantizing.forecast`): each machine's mix, its size, the bits per weight of the
routed experts and of the rest, and its predicted loss (a forecast on random weights: the real set's own
`--fit` measures). `python benchmarks/fit_table.py` prints the table docs/variants.md holds."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import row  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GB = 1000**3
MACHINES = [  # (RAM, VRAM or None, context)
    (384 * GB, None, 32768), (512 * GB, None, 32768), (768 * GB, None, 32768), (1000 * GB, None, 32768),
    (384 * GB, 24 * GB, 32768), (512 * GB, 24 * GB, 32768), (384 * GB, 80 * GB, 32768), (512 * GB, 80 * GB, 32768),
]  # fmt: skip


def _reference(folder: object, imatrix: object) -> tuple[object, object, dict]:
    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.quantizing.fit import reference_plan

    plan = folder.plans.require(MODEL)  # type: ignore[attr-defined]
    kvs = folder.plans.kvs(plan)  # type: ignore[attr-defined]
    ref = reference_plan(plan, kvs, imatrix)
    return plan, ref, {kv.key: kv.value for kv in kvs}


def _share(kvs: dict) -> float:
    return int(kvs["kimi-k3.expert_used_count"]) / int(kvs["kimi-k3.expert_count"])


def machine_rows(tmp: Path) -> list[dict]:
    """Each machine's fitted mix for the real model."""
    import subprocess

    from k3lab.errors import K3LabError
    from k3lab.kimi_k3.model import MODEL
    from k3lab.kimi_k3.synth import synthesize
    from k3lab.pipeline.quantizing.costs import set_tables
    from k3lab.pipeline.quantizing.fit import CPU_MOE, Budget, fit_machine, floor_bits, floored
    from k3lab.pipeline.quantizing.forecast import foretold, rates
    from k3lab.pipeline.quantizing.imatrix_files import open_imatrix
    from k3lab.pipeline.state import OutputFolder

    k3 = [sys.executable, "-m", "k3lab"]
    widths_src, widths = tmp / "widths-src", tmp / "widths"
    synthesize("widths", widths_src, seed=0)
    subprocess.run(
        [*k3, "convert", "--meta", str(widths_src), "--out-dir", str(widths), "--quiet"], check=True
    )
    use = open_imatrix(str(ROOT / "tests" / "data" / "imatrix-widths.gguf"))
    wfolder = OutputFolder(widths)
    _, wref, wkvs = _reference(wfolder, use)
    measured = rates(set_tables(wfolder, wref)[0], _share(wkvs))

    full = Path(os.environ.get("K3LAB_FULL") or tmp / "full")
    if not (full / "config.json").exists():
        synthesize("full", full)
    real = tmp / "real"
    subprocess.run(
        [*k3, "plan", "--meta", str(full), "--out-dir", str(real)], check=True, capture_output=True
    )
    _, ref, kvs = _reference(OutputFolder(real), None)  # (an imatrix of these widths: none yet)
    tables, fixed = foretold(ref, measured, _share(kvs))
    fixed_gpu = sum(
        t.nbytes for f in ref.files for t in f.tensors if not t.quantized and not CPU_MOE.search(t.name)
    )
    weights = {t.name: math.prod(t.ne) for t in tables}
    out = []
    for ram, vram, n_ctx in MACHINES:
        budget = Budget(ram, vram, MODEL.context_bytes(kvs, n_ctx))
        try:
            got = fit_machine(floored(tables, floor_bits("Q2_K")), budget, fixed, fixed_gpu)
        except K3LabError as e:
            out.append({"ram": ram, "vram": vram, "ctx": n_ctx, "none": str(e)})
            continue
        by = {t.name: next(o for o in t.options if o.type == got.types[t.name]) for t in tables}
        exp = [n for n in by if CPU_MOE.search(n)]
        rest = [n for n in by if not CPU_MOE.search(n)]
        bpw = [8 * sum(by[n].nbytes for n in ns) / sum(weights[n] for n in ns) for ns in (exp, rest)]
        types = {}
        for n in exp:
            types[by[n].type] = types.get(by[n].type, 0) + by[n].nbytes
        out.append({"ram": ram, "vram": vram, "ctx": n_ctx, "size": got.nbytes, "gpu": got.on_gpu, "loss": got.loss,
                    "experts_bpw": bpw[0], "rest_bpw": bpw[1], "cache": budget.context,
                    "expert_types": sorted(types, key=types.get, reverse=True)[:3]})  # fmt: skip
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| machine | context | mix size | on the GPU | routed experts | the rest | predicted loss |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]  # fmt: skip
    for r in rows:
        machine = f"{r['ram'] // GB} GB" + (f" + {r['vram'] // GB} GB GPU" if r["vram"] else "")
        if "none" in r:
            lines.append(f"| {machine} | {r['ctx']:,} | no mix fits: {r['none'].split(': ', 1)[1]} | | | | |")
            continue
        gpu = f"{r['gpu'] / GB:.1f} GB" if r["gpu"] is not None else "-"
        lines.append(f"| {machine} | {r['ctx']:,} | {r['size'] / GB:.1f} GB | {gpu} | {r['experts_bpw']:.2f} bpw "
                     f"({', '.join(r['expert_types'])}) | {r['rest_bpw']:.2f} bpw | {r['loss']:.4g} |")  # fmt: skip
    return "\n".join(lines)


@row
def bench_fit() -> list[tuple[str, str, str]]:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        rows = machine_rows(Path(tmp))
    return [
        (f"fit {r['ram'] // GB}G" + (f"+{r['vram'] // GB}G" if r["vram"] else ""), "none", r["none"])
        if "none" in r else
        (f"fit {r['ram'] // GB}G" + (f"+{r['vram'] // GB}G" if r["vram"] else ""), f"{r['size'] / GB:.1f} GB",
         f"experts {r['experts_bpw']:.2f} bpw, rest {r['rest_bpw']:.2f} bpw, predicted loss {r['loss']:.4g}")
        for r in rows
    ]  # fmt: skip


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        print(markdown(machine_rows(Path(tmp))))
