"""The mix that loses least for a size (`quantize --fit`): the cost table against ggml's own round trip,
the solver against every mix of small problems, the variant against llama-quantize given the
`--tensor-type-file` it writes (byte for byte), never over its budget, and at equal size against
llama.cpp's own ftype in llama.cpp (KL from the lossless set); bad budgets in one line."""

from __future__ import annotations

import itertools
import random
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, convert
from llama_support import needs_llama

from k3lab.cli import main
from k3lab.kimi_k3.synth import synthesize
from k3lab.pipeline.quantizing.costs import Option, TensorCost
from k3lab.pipeline.quantizing.fit import fit

IMATRIX = ROOT / "tests" / "data" / "imatrix-widths.gguf"


def test_the_solver_is_within_one_step_of_the_best_mix_and_never_over_budget() -> None:
    """Against every mix of 600 small random problems: never over the budget, and never worse than
    the best mix by more than one tensor's step (the one its last move overshoots by)."""
    rng = random.Random(0)
    exact = checked = 0
    for _ in range(600):
        tables = [
            TensorCost(f"t{i}", "L", (1,), [Option("L", 1000, 0.0)]
                       + [Option(f"T{j}", rng.randint(50, 999), rng.random() * 10) for j in range(4)])
            for i in range(4)
        ]  # fmt: skip
        budget = rng.randint(600, 3900)
        if budget < sum(min(o.nbytes for o in t.options) for t in tables):
            continue
        got = fit(tables, budget)
        assert got.nbytes <= budget
        best = min(
            sum(o.cost for o in mix)
            for mix in itertools.product(*(t.options for t in tables))
            if sum(o.nbytes for o in mix) <= budget
        )
        step = max(max(o.cost for o in t.options) for t in tables)
        assert got.loss <= best + step + 1e-9
        checked += 1
        exact += abs(got.loss - best) < 1e-9
    print(f"the solver: the best mix in {exact} of {checked} problems, within one step in all")
    assert exact > 0.8 * checked


@pytest.fixture(scope="module")
def widths_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("fit-widths") / "src"
    synthesize("widths", src, seed=0)
    out = tmp_path_factory.mktemp("fit-widths-set")
    assert convert(src, out, per_layer=False) == 0
    return out


@needs_llama
def test_a_cost_is_ggmls_round_trip_weighted_by_the_imatrix(widths_set: Path, tmp_path: Path) -> None:
    """One tensor's cost of one type recomputed by hand: its sampled rows widened by ggml, quantised
    with its imatrix and dequantised by ggml, the squared errors weighted by the imatrix's columns."""
    from k3lab.formats.ggml import TYPE_IDS, ggml
    from k3lab.pipeline.quantizing.costs import load_table, sample_rows, table_path
    from k3lab.pipeline.state import OutputFolder

    set_dir = tmp_path / "set"
    shutil.copytree(widths_set, set_dir)
    assert main(["quantize", str(set_dir), "--fit", "4000000", "--imatrix", str(IMATRIX), "--quiet"]) == 0
    import json

    body = json.loads((table_path(OutputFolder(set_dir).state, 1)).read_text().split("\n", 1)[1])
    tables = load_table(table_path(OutputFolder(set_dir).state, 1), body["proof"])
    assert tables
    t = next(
        t
        for t in tables
        if t.name.startswith("blk.2.") and len(t.ne) == 2 and "Q4_K" in {o.type for o in t.options}
    )
    option = next(o for o in t.options if o.type == "Q4_K")
    import gguf

    reader = gguf.GGUFReader(next(set_dir.glob("*.gguf")))
    raw = next(x for x in reader.tensors if x.name == t.name)
    lib = ggml()
    width, height = t.ne[0], t.ne[1]
    rows = sample_rows(height)
    data = np.asarray(raw.data).reshape(height, -1).view(np.uint8)
    w = np.empty((len(rows), width), np.float32)
    for j, r in enumerate(rows):
        lib.to_float(TYPE_IDS[t.type], np.ascontiguousarray(data[r]), w[j])
    im_reader = gguf.GGUFReader(IMATRIX)
    sums = np.asarray(
        next(x for x in im_reader.tensors if x.name == t.name + ".in_sum2").data, np.float32
    ).reshape(-1)
    count = float(
        np.asarray(next(x for x in im_reader.tensors if x.name == t.name + ".counts").data).reshape(-1)[0]
    )
    im = (sums / np.float32(count)).astype(np.float32)
    q = np.empty(len(rows) * lib.traits(TYPE_IDS["Q4_K"]).row_bytes(width), np.uint8)
    lib.quantize(TYPE_IDS["Q4_K"], w, q, im)
    back = np.empty(w.size, np.float32)
    lib.to_float(TYPE_IDS["Q4_K"], q, back)
    want = float((((back.reshape(w.shape) - w).astype(np.float64) ** 2) * im).sum()) * height / len(rows)
    assert option.cost == pytest.approx(want, rel=1e-9)
    assert option.nbytes == height * lib.traits(TYPE_IDS["Q4_K"]).row_bytes(width)


@needs_llama
def test_fit_is_llama_quantize_with_its_type_file_within_budget_and_better_than_the_ftype(
    widths_set: Path, tmp_path: Path, capsys
) -> None:
    """--fit at Q2_K's size: never over it, llama-quantize's bytes given the --tensor-type-file it
    wrote (the command its manifest records, run as it is), and less KL from the lossless set in
    llama.cpp than Q2_K of the same size."""
    from k3lab.explore.variants import kl_divergence

    set_dir = tmp_path / "set"
    shutil.copytree(widths_set, set_dir)
    assert main(["quantize", str(set_dir), "--type", "Q2_K", "--imatrix", str(IMATRIX), "--quiet"]) == 0
    budget = sum(p.stat().st_size for p in (set_dir / "Q2_K").glob("*.gguf"))
    assert main(["quantize", str(set_dir), "--fit", str(budget), "--label", "fit", "--imatrix", str(IMATRIX),
                 "--quiet"]) == 0  # fmt: skip
    made = sorted((set_dir / "fit").glob("*.gguf"))
    assert sum(p.stat().st_size for p in made) <= budget
    import json

    command = json.loads((set_dir / "fit" / "MANIFEST.json").read_text())["made_as"].splitlines()[0]
    argv = shlex.split(command)
    assert "--tensor-type-file" in argv and argv[argv.index("--tensor-type-file") + 1].endswith(
        "fit.tensor-types.txt"
    )
    from llama_tree import llama_quantize

    ref = tmp_path / "ref.gguf"
    argv[0], argv[-2] = str(llama_quantize()), str(ref)
    done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=900, cwd=set_dir)
    assert done.returncode == 0, done.stdout[-2000:]
    assert ref.read_bytes() == made[0].read_bytes()
    base = next(set_dir.glob("*.gguf"))
    ours, theirs = (
        kl_divergence(base, made[0], "fit"),
        kl_divergence(base, next((set_dir / "Q2_K").glob("*.gguf")), "Q2_K"),
    )
    print(ours.line(), theirs.line(), sep="\n")
    assert ours.mean < theirs.mean
    capsys.readouterr()
    for flags, said in (
        (["--fit", "1000"], "the smallest mix of these types is"),
        (["--fit", "100G"], "fits already: nothing to lose"),
        (["--fit", "3M", "--type", "Q2_K"], "--fit chooses every tensor's type"),
        (["--fit", "3M", "--fit-floor", "Q9_Z"], "--fit-floor 'Q9_Z'"),
    ):
        assert (
            main(["quantize", str(set_dir), *flags, "--imatrix", str(IMATRIX), "--label", "bad", "--quiet"])
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (flags, err)
        assert not (set_dir / "bad").exists() and not (set_dir / "bad.tensor-types.txt").exists()


def _llama_quantize_made_it(set_dir: Path, label: str, tmp_path: Path) -> None:
    """The variant LABEL is what llama-quantize makes, run as its manifest records it."""
    import json

    from llama_tree import llama_quantize

    made = sorted((set_dir / label).glob("*.gguf"))
    argv = shlex.split(json.loads((set_dir / label / "MANIFEST.json").read_text())["made_as"].splitlines()[0])
    ref = tmp_path / f"{label}-ref.gguf"
    argv[0], argv[-2] = str(llama_quantize()), str(ref)
    done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=900, cwd=set_dir)
    assert done.returncode == 0, done.stdout[-2000:]
    assert ref.read_bytes() == made[0].read_bytes()


def _llama_cpp_context_bytes(gguf_file: Path, n_ctx: int) -> float:
    """What llama.cpp says it allocated for a context of n_ctx (its KV cache and recurrent states), in
    MiB as its log prints them (two decimals)."""
    import re

    script = (
        "import llama_cpp,sys\n"
        f"llama_cpp.Llama(model_path={str(gguf_file)!r}, n_ctx={n_ctx}, n_threads=1, verbose=True)\n"
    )
    done = subprocess.run(
        [__import__("sys").executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    sizes = re.findall(r"llama_(?:kv_cache|memory_recurrent): size = +([0-9.]+) MiB", done.stderr)
    assert len(sizes) == 2, done.stderr[-3000:]
    return sum(float(s) for s in sizes)


@needs_llama
def test_a_machine_fit_keeps_each_side_in_its_memory_with_llama_cpps_cache(
    widths_set: Path, tmp_path: Path, capsys
) -> None:
    """--fit-ram/--fit-vram/--fit-context: the cache counted is what llama.cpp allocates for that
    context (its own log, two contexts); the routed experts within the RAM, the rest plus the cache
    within the VRAM; llama-quantize's bytes given the type file; bad machines in one line, nothing made."""
    from gguf import GGUFReader

    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.quantizing.fit import CPU_MOE

    set_dir = tmp_path / "set"
    shutil.copytree(widths_set, set_dir)
    base = next(set_dir.glob("*.gguf"))
    kvs = {k: f.contents() for k, f in GGUFReader(base).fields.items()}
    for n_ctx in (1000, 5000):
        ours = MODEL.context_bytes(kvs, n_ctx) / 2**20
        assert abs(ours - _llama_cpp_context_bytes(base, n_ctx)) <= 0.011, n_ctx

    def sides(path: Path) -> tuple[int, int]:
        tensors = GGUFReader(path).tensors
        gpu = sum(int(t.n_bytes) for t in tensors if not CPU_MOE.search(t.name))
        return path.stat().st_size - gpu, gpu

    ram0, gpu0 = sides(base)
    cache = MODEL.context_bytes(kvs, 2048)
    header = GGUFReader(base).data_offset  # (in RAM: llama.cpp maps the file)
    ram, vram = header + (ram0 - header) // 2, gpu0 // 2 + cache
    assert main(["quantize", str(set_dir), "--fit-ram", str(ram), "--fit-vram", str(vram), "--fit-context",
                 "2048", "--label", "machine", "--imatrix", str(IMATRIX), "--quiet"]) == 0  # fmt: skip
    (made,) = sorted((set_dir / "machine").glob("*.gguf"))
    got_ram, got_gpu = sides(made)
    print(f"RAM {got_ram:,} of {ram:,}; GPU {got_gpu:,} + cache {cache:,} of {vram:,}")
    assert got_ram <= ram and got_gpu + cache <= vram
    assert got_ram > 0.9 * ram and got_gpu + cache > 0.9 * vram  # (each side spent, not left idle)
    _llama_quantize_made_it(set_dir, "machine", tmp_path)
    _the_manifest_predicts_the_tables_loss(set_dir, "machine")
    assert (
        main(
            [
                "quantize",
                str(set_dir),
                "--type",
                "Q2_K",
                "--label",
                "q2",
                "--imatrix",
                str(IMATRIX),
                "--quiet",
            ]
        )
        == 0
    )
    _the_manifest_predicts_the_tables_loss(set_dir, "q2")  # (any variant, once the tables are there)
    capsys.readouterr()
    for flags, said in (
        (["--fit", "3M", "--fit-vram", "1G"], "--fit-vram and --fit-context go with --fit-ram"),
        (["--fit", "3M", "--fit-ram", "1G"], "one of them"),
        (
            ["--fit-ram", "1G", "--fit-vram", str(cache)],
            f"--fit-vram {cache:,} bytes less the context's cache",
        ),
        (["--fit-ram", "1000", "--fit-vram", "1G"], "--fit-ram 1,000 bytes for the routed experts"),
    ):
        argv = ["quantize", str(set_dir), *flags, "--fit-context", "2048", "--label", "bad", "--quiet"]
        if flags[0] == "--fit" and "--fit-vram" not in flags:
            argv.remove("--fit-context"), argv.remove("2048")
        assert main([*argv, "--imatrix", str(IMATRIX)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (flags, err)
        assert not (set_dir / "bad").exists() and not (set_dir / "bad.tensor-types.txt").exists()


@needs_llama
def test_tables_foretold_from_measured_ones_keep_their_bytes_and_each_kinds_loss(widths_set: Path) -> None:
    """The forecast of the real model's tables (``forecast``), tried where the truth is known: foretold
    for the very set they were measured on, every option's bytes are the measured table's exactly and
    each kind's summed loss per type is the measured sum; a kind never measured is one line."""
    import math

    from k3lab.errors import K3LabError
    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.quantizing.costs import set_tables
    from k3lab.pipeline.quantizing.fit import reference_plan
    from k3lab.pipeline.quantizing.forecast import foretold, kind, rates
    from k3lab.pipeline.quantizing.imatrix_files import open_imatrix
    from k3lab.pipeline.state import OutputFolder

    folder = OutputFolder(widths_set)
    plan = folder.plans.require(MODEL)
    kvs = folder.plans.kvs(plan)
    use = open_imatrix(str(IMATRIX))
    ref = reference_plan(plan, kvs, use)
    measured, _ = set_tables(folder, ref)
    share = 2 / 4  # (the widths preset: 2 of 4 experts per token)
    got, _ = foretold(ref, rates(measured, share), share)
    by_name = {t.name: t for t in got}
    sums: dict[tuple[str, str], list[float]] = {}
    for t in measured:
        g = by_name[t.name]
        assert {o.type: o.nbytes for o in g.options} == {o.type: o.nbytes for o in t.options}, t.name
        for o, f in zip(sorted(t.options, key=lambda o: o.type), sorted(g.options, key=lambda o: o.type)):
            pair = sums.setdefault((kind(t.name), o.type), [0.0, 0.0])
            pair[0] += o.cost
            pair[1] += f.cost
    for key, (want, foretold_sum) in sums.items():
        assert math.isclose(want, foretold_sum, rel_tol=1e-9, abs_tol=1e-12), key
    rates_without = {k: v for k, v in rates(measured, share).items() if k != "ffn_down_exps.weight"}
    with pytest.raises(
        K3LabError, match=r"tensor blk\.\d+\.ffn_down_exps\.weight: no ffn_down_exps\.weight among"
    ):
        foretold(ref, rates_without, share)


def _the_manifest_predicts_the_tables_loss(set_dir: Path, label: str) -> None:
    """LABEL's manifest (and so its card row) states the loss the set's cost table gives the types
    its file holds, as gguf-py reads them: each quantised tensor's cost under its type, summed."""
    import json

    from gguf import GGUFReader

    from k3lab.pipeline.quantizing.quality import predicted_of
    from k3lab.pipeline.state.codec import read_state

    (table,) = (set_dir / ".k3lab" / "costs").glob("costs-*.json")
    costs = {t["name"]: {o[0]: o[2] for o in t["options"]} for t in read_state(table, "costs")["tensors"]}
    (made,) = (set_dir / label).glob("*.gguf")
    want = sum(costs[t.name][t.tensor_type.name] for t in GGUFReader(made).tensors if t.name in costs)
    stated = predicted_of(json.loads((set_dir / label / "MANIFEST.json").read_text())["made_as"])
    assert stated is not None and float(stated) == pytest.approx(want, rel=1e-3), (label, stated, want)


@pytest.mark.slow
@needs_llama
def test_on_the_040b_shape_the_fit_loses_less_than_the_ftype_and_the_recipe_of_their_size(
    tmp_path: Path,
) -> None:
    """docs/variants.md's proof where llama.cpp runs the model: on the published 0.40B's shape (F32, one
    file, its imatrix made by `k3lab imatrix`), at the size of llama.cpp's Q2_K and of k3lab's MoE-Q2_K
    recipe, the fitted mix moves llama.cpp's next-token distribution less (mean KL from the lossless
    set over 3,000 characters of text, as `llama-perplexity --kl-divergence` defines it) and keeps its
    top token at least as often; each fitted variant is llama-quantize's bytes given the type file it
    wrote. (With the head's cost summed over its rows, it lost to the recipe.)"""
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.fit_proof import measured

    rows = measured(tmp_path)
    print(*(" ".join(r) for r in rows), sep="\n")
    figures = {r[0]: r[2] for r in rows}

    def kl(label: str) -> tuple[float, float]:
        text = figures[f"0.40B {label}"]
        return float(text.split("KL mean ")[1].split(",")[0]), float(
            text.split("same top token ")[1].rstrip("%")
        )

    for kind in ("Q2_K", "MoE-Q2_K"):
        (theirs, their_top), (ours, our_top) = kl(kind), kl(f"fit-{kind}")
        assert ours < theirs and our_top >= their_top, (
            figures[f"0.40B {kind}"],
            figures[f"0.40B fit-{kind}"],
        )
        _llama_quantize_made_it(tmp_path / "set", f"fit-{kind}", tmp_path)  # (and llama-quantize's bytes)
