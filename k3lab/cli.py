"""The ``k3lab`` command: it parses arguments, makes a ``request.Request`` of them, and hands them
to the command's function (``cli_commands``), which calls what notebooks call too and prints it."""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from k3lab import __version__, request, values
from k3lab.cli_commands import (
    _batch,
    _check_logits,
    _check_vision,
    _convert,
    _front,
    _imatrix,
    _plan,
    _publish,
    _quantize,
    _verify,
)
from k3lab.cli_flags import (  # noqa: F401 (EXAMPLES: the reference page's)
    CHUNK,
    CHUNKS,
    EXAMPLES,
    EXPERTS,
    FILES_HELP,
    FIT_FLAGS,
    JOBS,
    KL_FLAGS,
    POSITIVE,
    PUSH_FLAGS,
    REPO,
    RUN_FLAGS,
    SAMPLE,
    SECONDS,
    SEED,
    SOURCE_FLAGS,
    VARIANT_FLAGS,
    _flags,
)
from k3lab.errors import K3LabError, printable
from k3lab.request import Request


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument as one line (``k3lab: error: argument --jobs: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"k3lab: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="k3lab", description="Kimi-K3 to GGUF, losslessly, file by file; and a look inside.")
    p.add_argument("--version", action="version", version=f"k3lab {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, func: Callable, help: str, model: bool = True) -> argparse.ArgumentParser:
        c = sub.add_parser(
            name,
            help=help,
            description=help[0].upper() + help[1:] + ".",
            epilog="example:\n  " + EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.set_defaults(func=func)
        if model:
            c.add_argument("--model", default="kimi-k3", help="kimi-k3 (default), or a module with a MODEL")
        return c

    s = command(
        "synth",
        _front("k3lab.kimi_k3.synth.report", "synth_cli"),
        "write a synthetic Kimi-K3 checkpoint",
        model=False,
    )
    s.add_argument(
        "--preset",
        choices=["tiny", "widths", "tiny-f32", "testmodel", "layer", "full"],
        default="tiny",
        help="tiny: 4 MiB, MXFP4 experts (the default); widths: Kimi-K3's row widths in miniature (what "
        "llama.cpp's quantiser decides by), 8 MB; tiny-f32: tiny's size, float32 and plain experts; "
        "testmodel: the published Kimi-K3-0.40B's config (1.6 GB, float32, one file); layer: MoE layers "
        "at the real expert size (300 MB); full: the real 93-layer model, headers only (data as holes)",
    )
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--seed", type=SEED, default=0, help="the values' seed: the same seed, the same bytes")
    s.add_argument("--experts", type=EXPERTS, help="override the number of routed experts")
    s.add_argument(
        "--draw",
        choices=["trained", "normal", "fan-in", "near-ties"],
        default="trained",
        help="how values are drawn: like a trained model's (default), every matrix N(0, 0.02), "
        "N(0, 1/sqrt(fan-in)), or N(0, 0.02) with routers in near ties",
    )
    s.add_argument(
        "--layout",
        metavar="moonshot|one-file|by-size:BYTES",
        help="the files: Moonshot's (a layer per shard; the default but for testmodel, one file), one "
        "model.safetensors (no index), or size-based shards as transformers' save_pretrained writes "
        "them (by-size:5000000000)",
    )

    tok = lambda req, a: print(request.tokenizer(req, a.out, print))  # noqa: E731
    t = command("tokenizer", tok, "the vocabulary and hyperparameters as a standalone GGUF (no tensors)")
    template = dict(RUN_FLAGS["--chat-template"], help="a Jinja chat template to embed in the tokenizer GGUF")
    _flags(t, {"--meta": SOURCE_FLAGS["--meta"], "--chat-template": template}, meta=True)
    t.add_argument("--out", required=True, help="output .gguf")

    pl = command("plan", _plan, "what the conversion will write, from config, index and headers alone")
    _flags(pl, SOURCE_FLAGS, RUN_FLAGS, meta=True)
    pl.add_argument("--out-dir", help="also save the plan there (.k3lab/plan.json), as convert does")
    pl.add_argument("--jobs", type=JOBS, default=1, help="for the disk and memory forecast")
    pl.add_argument("--json", action="store_true", help="machine-readable output")

    c = command(
        "convert",
        _convert,
        "the text model to GGUF, output file by output file (one file when the set fits in 50G)",
    )
    _flags(c, SOURCE_FLAGS, RUN_FLAGS, PUSH_FLAGS, meta=True)
    c.add_argument("--out-dir", required=True, help="the output folder (made if missing; resumable)")
    c.add_argument("--files", "--shards", dest="shards", metavar="LIST", help=FILES_HELP)
    c.add_argument("--jobs", type=JOBS, default=1, help="output files converted in parallel processes")
    c.add_argument("--force", action="store_true", help="redo complete files; replace another set's")
    c.add_argument("--quiet", action="store_true", help="errors and one summary line only")
    c.add_argument(
        "--scheduler", help="one task per output file on this Dask scheduler instead of local processes"
    )
    c.add_argument("--push-to", metavar="ORG/NAME", type=REPO, help="publish every file to this Hub repo")
    c.add_argument("--keep-local", action="store_true", help="keep each file after uploading it")
    c.add_argument(
        "--text-only", action="store_true", help="publish the split set alone (no mmproj, tokenizer)"
    )

    _flags(c, VARIANT_FLAGS)
    c.add_argument(
        "--imatrix-from",
        metavar="TEXT",
        help="the variants' imatrix: computed from this calibration text once the "
        "set is whole (`k3lab imatrix`: a file, ORG/NAME:PATH, or `own` for k3lab's), then the variants made with it",
    )

    q = command(
        "quantize", _quantize, "quantised variants of a converted set, file by file, by llama.cpp's ggml"
    )
    q.add_argument("out_dir", metavar="SET", help="the folder of a converted set (variants go to SET/LABEL/)")
    q.add_argument(
        "--type",
        dest="variants",
        metavar="TYPE[,TYPE...]",
        help="llama-quantize's types (Q2_K, IQ2_XXS, Q4_K_M ...) or k3lab's recipes (MoE-Q2_K ...): a variant each "
        "(or --fit SIZE)",
    )
    _flags(q, {k: v for k, v in VARIANT_FLAGS.items() if k != "--variants"})
    q.add_argument("--files", "--shards", dest="shards", metavar="LIST", help=FILES_HELP)
    q.add_argument("--jobs", type=JOBS, default=1, help="files quantised in parallel processes")
    q.add_argument("--scheduler", help="one task per file on this Dask scheduler (the set's folder shared)")
    q.add_argument("--force", action="store_true", help="redo complete variant files")
    q.add_argument("--quiet", action="store_true", help="errors and one summary line only")
    q.add_argument(
        "--dry-run",
        action="store_true",
        help="plan only: each variant's size, bits per weight and llama-quantize command (a saved plan is "
        "enough: `k3lab plan --out-dir` of the real model's headers gives the real model's figures)",
    )
    q.add_argument(
        "--push-to", metavar="ORG/NAME", type=REPO, help="publish each variant file to this repo (LABEL/)"
    )
    q.add_argument("--keep-local", action="store_true", help="keep each variant file after uploading it")
    _flags(q, FIT_FLAGS, KL_FLAGS)
    _flags(q, {"--retry-budget": SOURCE_FLAGS["--retry-budget"]}, PUSH_FLAGS)

    im = command(
        "imatrix",
        _imatrix,
        "the importance matrix of a converted set, llama-imatrix's, a layer at a time (here or on Dask)",
    )
    im.add_argument(
        "out_dir",
        nargs="?",
        metavar="SET|ORG/NAME",
        help="the folder of a converted set, or a set k3lab published",
    )
    im.add_argument("--revision", help="with ORG/NAME: the set's branch, tag or commit (default: main)")
    im.add_argument("--calibration", metavar="TEXT", help="a text file, or ORG/NAME:PATH[@REVISION] on the Hub "
                    "(default: k3lab's own calibration text: chat, code, many languages, Kimi-K3's chat format)")  # fmt: skip
    im.add_argument(
        "--chunk-size", "-c", type=CHUNK, default=512, help="tokens per chunk (llama-imatrix's -c; 512)"
    )
    im.add_argument(
        "--chunks", type=CHUNKS, help="at most this many chunks (llama-imatrix's --chunks; default: all)"
    )
    im.add_argument(
        "--out",
        help="the imatrix file (default: SET/imatrix.gguf; with ORG/NAME needed: its folder keeps the state)",
    )
    im.add_argument(
        "--output-format", choices=["gguf", "dat"], default="gguf", help="llama-imatrix's formats"
    )
    im.add_argument("--process-output", action="store_true", help="also output.weight (llama-imatrix's)")
    im.add_argument(
        "--in-file", action="append", metavar="FILE", help="an imatrix to add to this one (repeatable)"
    )
    im.add_argument("--parse-special", action="store_true", help="special tokens in the text are tokens")
    im.add_argument(
        "--until-covered",
        action="store_true",
        help="more chunks (--chunks, then twice as many ...) until "
        "every expert is reached or the text ends: the fewest that cover them",
    )
    im.add_argument(
        "--show-statistics",
        action="store_true",
        help="llama-imatrix's: the figures of the one --in-file "
        "(per tensor and layer), and which experts the text never reached; nothing computed",
    )
    im.add_argument("--threads", type=JOBS, help="ggml's threads (default: every core)")
    im.add_argument(
        "--scheduler", metavar="ADDR", help="a Dask scheduler: a wave of steps at once, one per worker"
    )
    _flags(im, {"--retry-budget": SOURCE_FLAGS["--retry-budget"]})
    im.add_argument("--quiet", action="store_true", help="errors and one summary line only")

    pu = command("publish", _publish, "push a converted set (and its mmproj, tokenizer) to a Hub repo")
    pu.add_argument("out_dir", help="the output folder of a conversion")
    pu.add_argument("push_to", metavar="ORG/NAME", type=REPO, help="the Hub repo (made if missing)")
    pu.add_argument("--force", action="store_true", help="replace another set, or files k3lab did not make")
    _flags(pu, {"--retry-budget": SOURCE_FLAGS["--retry-budget"]}, PUSH_FLAGS)
    pu.set_defaults(keep_local=True)

    b = command("batch", _batch, "run a notebook once per output file with papermill, on Dask")
    b.add_argument("--notebook", help="default: notebooks/03-convert-a-file.ipynb")
    _flags(b, {k: SOURCE_FLAGS[k] for k in ("--meta", "--src")}, meta=True)
    _flags(b, {k: RUN_FLAGS[k] for k in ("--split-max-size", "--split-max-tensors")})
    b.add_argument("--out-dir", required=True, help="the output folder the notebooks convert into")
    b.add_argument("--files", "--shards", dest="shards", metavar="LIST", help=FILES_HELP)
    b.add_argument("--scheduler", help="address of a running Dask scheduler (default: a LocalCluster)")
    b.add_argument("--workers", type=JOBS, default=2, help="LocalCluster worker processes")
    b.add_argument("--run-id", help="the run's folder name under --runs-dir (default: a timestamp)")
    b.add_argument(
        "--runs-dir",
        default="papermill_runs",
        help="where executed notebooks are kept (default: papermill_runs)",
    )
    b.add_argument(
        "--cell-timeout",
        type=SECONDS,
        metavar="S",
        default=600.0,
        help="seconds one cell may run before its notebook is stopped (default 600)",
    )
    b.add_argument(
        "--notebook-timeout",
        type=SECONDS,
        metavar="S",
        default=3600.0,
        help="seconds one notebook may run in all (default 3600)",
    )

    vi = command(
        "vision", lambda req, a: print(request.vision(req, a.out)), "the vision tower as an mmproj GGUF"
    )
    _flags(vi, SOURCE_FLAGS, meta=True)
    vi.add_argument("--out", required=True, help="e.g. OUT_DIR/mmproj-Kimi-K3-BF16.gguf")

    cl = command("check-logits", _check_logits, "NumPy reference on the source vs llama.cpp on the GGUF")
    _flags(cl, SOURCE_FLAGS, meta=True)
    cl.add_argument("--gguf", required=True, help="the converted set's (first) GGUF file")
    cl.add_argument("--prompt", help="text to tokenize (default: a built-in mixed prompt)")
    cl.add_argument("--tokens", help="token ids instead of a prompt, e.g. '1,2,3'")
    cl.add_argument("--threshold", type=POSITIVE, default=1e-4, help="whole-model NMSE shown as good")
    cl.add_argument("--mode", choices=["ggml", "f32"], default="ggml", help="ggml: round as llama.cpp does")
    cl.add_argument("--blocks", action="store_true", help="print every position and every stage")
    judge = "also judge the reference by Moonshot's own forward (pip install 'k3lab[judge]')"
    cl.add_argument("--judge", choices=["moonshot"], help=judge)
    cl.add_argument(
        "--generate",
        type=values.argument(values.count, 0, 256),
        default=8,
        metavar="N",
        help="also decode the prompt and N generated tokens one at a time, each position against llama.cpp's "
        "prefill (and Moonshot's forward, with --judge); 0: not (default 8)",
    )

    command(
        "setup-judge",
        _front("k3lab.kimi_k3.moonshot", "setup_command"),
        "Moonshot's own modeling code where check-logits --judge moonshot finds it (from llmcompressor's "
        "wheel, its SHA-256 checked)",
        model=False,
    )

    cv = command(
        "check-vision", _check_vision, "the mmproj, read as a runtime reads it, vs the source's tower"
    )
    _flags(cv, SOURCE_FLAGS, meta=True)
    cv.add_argument("--mmproj", required=True, help="the mmproj GGUF `k3lab vision` wrote")
    cv.add_argument("--image", help="a PNG or JPEG (default: the sample the package ships)")
    cv.add_argument("--threshold", type=POSITIVE, default=1e-4, help="largest relative error per stage")

    v = command(
        "verify",
        _verify,
        "check a set (a folder, or ORG/NAME on the Hub) against its manifest and, given one, its source",
    )
    v.add_argument("out_dir", metavar="OUT_DIR|ORG/NAME", help="a converted folder, or a set on the Hub")
    v.add_argument("--manifest", help="the manifest to check against (default: OUT_DIR/MANIFEST.json)")
    _flags(v, SOURCE_FLAGS)  # with --src or --repo: re-derive every tensor from it
    v.add_argument(
        "--source-revision", help="with ORG/NAME: the revision of --repo (--revision is the set's)"
    )
    v.add_argument("--all", action="store_true", help="every tensor's bytes (a folder: the default)")
    v.add_argument("--sample", type=SAMPLE, help="N random tensors per file (of 16 MiB or less)")
    v.add_argument("--tensors", metavar="GLOB", help="the tensors whose names match GLOB")
    v.add_argument("--seed", type=SEED, help="the sample's seed (default: random, printed)")
    v.add_argument("--quiet", action="store_true", help="no progress bar")

    lb = command("lab", _front("k3lab.lab", "lab_cli"), "JupyterLab on the notebooks (saved without outputs)")
    lb.set_defaults(passes_unknown=True)  # other arguments go to `jupyter lab` as they are

    command(
        "tensor-map",
        lambda req, a: print(request.tensor_map(req), end=""),
        "the HF -> GGUF tensor table (TENSOR_MAP.md) from the rule table",
    )

    d = command(
        "demo", _front("k3lab.demo", "demo_command"), "the main job, end to end, on the built-in tiny model"
    )
    d.add_argument("--workdir", default="k3-demo", help="where the demo writes (default: ./k3-demo)")
    d.add_argument("--seed", type=SEED, default=0, help="the synthetic checkpoint's seed (default 0)")
    d.add_argument("--jobs", type=JOBS, default=2, help="output files converted in parallel (default 2)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, or a bad argument (one line said)
        return int(e.code or 0)
    if unknown and not getattr(args, "passes_unknown", False):
        print(f"k3lab: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    args.jupyter_args = unknown
    from k3lab.pipeline.progress import Stopped, stop_on_sigterm

    if threading.current_thread() is threading.main_thread():
        stop_on_sigterm()
    try:
        return int(args.func(Request.of(args), args) or 0)
    except K3LabError as e:  # one line (a run with several failed files: one line each)
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"k3lab: error: {printable(line)}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # the machine's, not the input's: a full disk, a missing folder, a permission
        print(f"k3lab: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("k3lab: interrupted; finished files are kept, unfinished ones removed", file=sys.stderr)
        return 130
    except Stopped as e:
        print(f"k3lab: stopped by {e}; finished files are kept, unfinished ones removed", file=sys.stderr)
        return 143


if __name__ == "__main__":  # (the installed `k3lab` command is k3lab.entry's: main, then a quick exit)
    sys.exit(main())
