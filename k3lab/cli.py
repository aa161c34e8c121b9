"""The ``k3lab`` command: argument parsing only; every subcommand calls a function notebooks call too."""

from __future__ import annotations

import argparse
import math
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from k3lab.errors import K3LabError

MAX_JOBS = 256  # processes on one machine

if TYPE_CHECKING:
    from k3lab.pipeline.running.runner import RunOptions
    from k3lab.pipeline.sources.base import SourceSpec


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument as one line (``k3lab: error: argument --jobs: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"k3lab: error: {message}\n")


def _count(low: int, high: int) -> Callable[[str], int]:
    """An integer argument within [low, high], written in ASCII digits."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]{1,12}", text.strip()):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number {low}..{high}")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


MAX_SECONDS = 7 * 86400.0  # a week: no wait k3lab takes is meant to be longer


def _seconds(text: str) -> float:
    """A number of seconds, 0 to a week (0 means zero: no wait, no retry)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value <= MAX_SECONDS) or not re.fullmatch(r"[0-9.e+-]+", text.strip().lower()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 to {MAX_SECONDS:.0f})")
    return value


def _positive(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number above 0")
    return value


def _repo_id(text: str) -> str:
    """A Hub repo as ORG/NAME (huggingface_hub's rules for the name)."""
    if text.count("/") == 1 and re.fullmatch(
        r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}", text
    ):
        if ".." not in text and "--" not in text and not text.endswith((".", "-", ".git")):
            return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a Hub repo: give ORG/NAME (letters, digits, '.', '_', '-')"
    )


def _synth(args: argparse.Namespace) -> int:
    from k3lab.synth import synthesize
    from k3lab.synth.report import describe

    result = synthesize(args.preset, args.out, seed=args.seed, experts=args.experts, draw=args.draw)
    print(describe(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from k3lab.demo import run_demo

    return run_demo(args.workdir, seed=args.seed, jobs=args.jobs)


def _model() -> Any:
    from k3lab.kimi_k3.model import MODEL

    return MODEL


def _tokenizer(args: argparse.Namespace) -> int:
    from k3lab.kimi_k3.tokenizer import chat_template_choice
    from k3lab.pipeline.writing.single import convert_tokenizer

    template, line = chat_template_choice(args.meta, args.chat_template)
    print(line)
    print(convert_tokenizer(_model(), args.meta, args.out, template))
    return 0


def _source_spec(args: argparse.Namespace, out_dir: str | Path | None = None) -> SourceSpec:
    """Where the checkpoint is, for every command alike: --src (local, default --meta) or --repo
    (the Hub); never both. A Hub source downloads into --scratch (default OUT_DIR/.k3lab/scratch,
    or a temporary folder for commands that write no folder)."""
    import os

    from k3lab.formats.safetensors import INDEX_NAME
    from k3lab.pipeline.sources.base import SourceSpec
    from k3lab.pipeline.sources.hub import hub_spec
    from k3lab.pipeline.writing.folder import OutputFolder

    model = _model()
    repo = getattr(args, "repo", None)
    if repo and args.src:
        raise K3LabError("--repo and --src name two sources: give one")
    for flag in ("scratch", "revision", "keep_source", "retry_budget"):
        if getattr(args, flag, None) and not repo:
            raise K3LabError(f"--{flag.replace('_', '-')} is for streaming from the Hub: it needs --repo")
    if repo:
        scratch = args.scratch or (OutputFolder(out_dir).scratch if out_dir else None)
        return hub_spec(
            args.meta,
            repo,
            revision=args.revision,
            scratch=scratch,
            endpoint=os.environ.get("HF_ENDPOINT"),
            token=os.environ.get("HF_TOKEN"),
            keep_source=args.keep_source,
            retry_budget=getattr(args, "retry_budget", None),
            meta_files=model.meta_files,
            optional_meta=model.optional_meta,
        )
    if args.src is None and not Path(args.meta, INDEX_NAME).exists():
        raise K3LabError(f"{args.meta}: no {INDEX_NAME}; give --src, or --repo to stream from the Hub")
    return SourceSpec.local(args.meta, args.src or args.meta)


def _run_options(args: argparse.Namespace, say: bool = False) -> RunOptions:
    """--outtype, --name, --force, and the chat template to embed (the choice printed when ``say``)."""
    from k3lab.kimi_k3.tokenizer import chat_template_choice
    from k3lab.pipeline.running.runner import RunOptions

    template, line = chat_template_choice(args.meta, args.chat_template)
    if say:
        print(line)
    return RunOptions(args.outtype, getattr(args, "name", None), template, getattr(args, "force", False))


def _plan(args: argparse.Namespace) -> int:
    import json

    from k3lab.pipeline.planning.plan_table import describe_plan
    from k3lab.pipeline.planning.planner import build_plan
    from k3lab.pipeline.running.runner import start_run
    from k3lab.pipeline.sources import open_source
    from k3lab.pipeline.writing.folder import check_basename

    model = _model()
    spec = _source_spec(args, args.out_dir)
    options = _run_options(args)

    def show(plan: Any) -> None:
        print(json.dumps(plan.to_json(), indent=1) if args.json else describe_plan(plan, args.jobs))

    if args.out_dir:  # saved there, as convert would
        say = lambda line: print(f"k3lab: {line}", file=sys.stderr)  # noqa: E731  (what a moved source changes)
        with start_run(model, spec, args.out_dir, options, say=say) as (plan, _, _):
            show(plan)
        return 0
    basename = check_basename(model.default_basename if options.basename is None else options.basename)
    source = open_source(spec, fresh=True)
    source.fetch_meta()
    cfg = model.load_config(Path(args.meta))
    show(build_plan(model, cfg, source, options.outtype, basename, options.chat_template))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from k3lab.pipeline.running.runner import convert_shards
    from k3lab.util import human_bytes

    if args.scheduler and args.jobs != 1:
        raise K3LabError(
            "--jobs and --scheduler both say where to run: give one (Dask workers set their own)"
        )
    spec = _source_spec(args, args.out_dir)
    options = _run_options(args, say=not args.quiet)
    publication = _publication(args, args.out_dir, args.repo)
    results = convert_shards(
        _model(),
        spec,
        args.out_dir,
        args.shards,
        jobs=args.jobs,
        quiet=args.quiet,
        scheduler=args.scheduler,
        options=options,
        publication=publication,
    )
    written = [r for r in results if not r.skipped]
    workers = sorted({r.worker for r in written})
    print(
        f"{len(written)} written, {len(results) - len(written)} already complete; "
        f"{human_bytes(sum(r.nbytes for r in results))} "
        + (f"published to {publication.target.where()}" if publication else f"in {args.out_dir}")
        + (f"; written by {len(workers)} processes ({', '.join(workers)})" if len(workers) > 1 else "")
    )
    return 0


def _publication(args: argparse.Namespace, out_dir: str, source_repo: str | None) -> Any:
    """--push-to and its flags as a Publication (None without --push-to)."""
    import os

    from k3lab.card import publication
    from k3lab.pipeline.publishing.publish import PushTarget

    if not args.push_to:
        for flag in ("push_branch", "private", "keep_local", "commit_every"):
            if getattr(args, flag, None):
                raise K3LabError(f"--{flag.replace('_', '-')} is for publishing: it needs --push-to")
        return None
    target = PushTarget(
        args.push_to,
        args.push_branch or "main",
        args.private,
        getattr(args, "keep_local", True),
        os.environ.get("HF_ENDPOINT"),
        os.environ.get("HF_TOKEN"),
        PushTarget.retry_budget if getattr(args, "retry_budget", None) is None else args.retry_budget,
    )
    return publication(target, str(out_dir), source_repo, args.commit_every, getattr(args, "force", False))


def _publish(args: argparse.Namespace) -> int:
    from k3lab.pipeline.publishing.publish import publish_folder

    args.repo = None
    publication = _publication(args, args.out_dir, None)
    pushed, kept, commit = publish_folder(
        _model(), args.out_dir, publication, lambda line: print(f"k3lab: {line}", file=sys.stderr)
    )
    print(
        f"{pushed} uploaded, {kept} already in {publication.target.where()}; "
        + (f"commit {commit}" if commit else "nothing to commit")
    )
    return 0


def _retry_budget_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--retry-budget",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="how long the Hub may keep failing (in a row, per file) before a file is given up (default 900)",
    )


def _push_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--push-branch", help="the branch to publish to (default: main; made if missing)")
    p.add_argument("--private", action="store_true", help="make the repo private when creating it")
    p.add_argument(
        "--commit-every",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="commit uploaded files at most this often (default 300; a killed run keeps what was committed)",
    )


def _verify(args: argparse.Namespace) -> int:
    import tempfile

    from k3lab.pipeline.checking.verify import verify

    rederive = args.src is not None or args.repo is not None
    if rederive and args.meta is None:
        if args.repo:
            raise K3LabError("--repo needs --meta (a folder for the config, index and tokenizer files)")
        args.meta = args.src
    with tempfile.TemporaryDirectory(prefix="k3lab-verify-") as tmp:
        if args.repo and not args.scratch:
            args.scratch = tmp  # the shards come and go one at a time, outside the folder verified
        spec = _source_spec(args) if rederive else None
        report = verify(args.out_dir, args.manifest, spec, _model(), quiet=args.quiet)
    for line in report.lines():
        print(line)
    status = "OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)"
    print(
        f"verify {status}: {report.files} files, {report.tensors} tensors, {report.bytes} bytes checked"
        + (" and re-derived from the source" if rederive else "")
    )
    return 0 if report.ok else 1


def _lab(args: argparse.Namespace) -> int:
    from k3lab.lab import run_lab

    return run_lab(args.jupyter_args)


def _tensor_map(args: argparse.Namespace) -> int:
    from k3lab.tensor_map import tensor_map_markdown

    print(tensor_map_markdown(), end="")
    return 0


def _vision(args: argparse.Namespace) -> int:
    from k3lab.pipeline.writing.single import convert_single

    print(convert_single(_model(), _source_spec(args, Path(args.out).parent), args.out))
    return 0


def _check_logits(args: argparse.Namespace) -> int:
    import tempfile

    from k3lab.kimi_k3.logits import check_logits, check_stages
    from k3lab.pipeline.sources import open_source

    tokens = [int(t) for t in args.tokens.replace(",", " ").split()] if args.tokens else None
    with tempfile.TemporaryDirectory(prefix="k3lab-logits-") as tmp:
        if args.repo and not args.scratch:
            args.scratch = tmp
        source = open_source(_source_spec(args), fresh=True)
        source.fetch_meta()
        try:
            report = check_logits(source, args.gguf, args.prompt, tokens, args.threshold, args.mode)
            if args.blocks:
                print(report.table())
            print(f"whole model, for information: {report.summary()}")
            stages = check_stages(source, args.gguf, report.tokens, args.mode)
        finally:
            source.close()
    print(stages.table(every=args.blocks))
    ok = not stages.failed
    print(f"check-logits {'OK' if ok else 'FAILED'}: the verdict is the stage check")
    return 0 if ok else 1


def _batch(args: argparse.Namespace) -> int:
    from k3lab.pipeline.running.batch import run_batch, summary
    from k3lab.pipeline.running.runner import start_run

    spec = _source_spec(args, args.out_dir)
    with start_run(_model(), spec, args.out_dir, shards=args.shards) as (plan, token, numbers):
        run_dir, results = run_batch(
            args.notebook,
            args.meta,
            args.src or args.meta,
            args.out_dir,
            numbers,
            args.scheduler,
            args.workers,
            args.run_id,
            args.runs_dir,
            run_token=token,
        )
    print(summary(run_dir, results))
    return 0 if all(r.status == "ok" for r in results) else 1


def _source_flags(p: argparse.ArgumentParser, meta_required: bool = True) -> None:
    """Where the checkpoint is: the same flags for every command that reads one."""
    p.add_argument(
        "--meta", required=meta_required, help="folder with config.json, the index and the tokenizer files"
    )
    p.add_argument("--src", help="folder with the safetensors shards (default: --meta)")
    p.add_argument(
        "--repo",
        type=_repo_id,
        help="stream from this Hugging Face repo (e.g. moonshotai/Kimi-K3) instead of --src",
    )
    p.add_argument("--revision", help="branch, tag or commit of --repo (default: main)")
    p.add_argument(
        "--scratch", default=None, help="where --repo downloads shards (default: OUT_DIR/.k3lab/scratch)"
    )
    p.add_argument("--keep-source", action="store_true", help="keep downloaded shards in --scratch")
    _retry_budget_flag(p)


def _common_source(p: argparse.ArgumentParser) -> None:
    _source_flags(p)
    p.add_argument(
        "--outtype",
        choices=["auto", "bf16", "f16", "f32"],
        default="auto",
        help="auto keeps MXFP4 and BF16 as they are; the float types convert every float matrix",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to embed in file 1 (wins over the source's own)",
    )


def build_parser() -> argparse.ArgumentParser:
    from k3lab.synth import PRESETS

    p = _Parser(prog="k3lab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser("synth", help="write a synthetic Kimi-K3 checkpoint")
    s.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--seed", type=_count(0, 2**32 - 1), default=0)
    s.add_argument(
        "--experts", type=_count(1, 4096), default=None, help="override the number of routed experts"
    )
    s.add_argument(
        "--draw",
        choices=["trained", "normal", "fan-in", "near-ties"],
        default="trained",
        help="how values are drawn: like a trained model's (default), or plain random (see synth/generate.py)",
    )
    s.set_defaults(func=_synth)

    t = sub.add_parser(
        "tokenizer", help="the vocabulary and hyperparameters as a standalone GGUF (no tensors)"
    )
    t.add_argument(
        "--meta", required=True, help="folder with config.json, tiktoken.model, tokenizer_config.json"
    )
    t.add_argument("--out", required=True, help="output .gguf")
    t.add_argument(
        "--chat-template", metavar="FILE", help="a Jinja chat template to embed (wins over the source's own)"
    )
    t.set_defaults(func=_tokenizer)

    pl = sub.add_parser("plan", help="what the conversion will write, from config, index and headers alone")
    _common_source(pl)
    pl.add_argument("--out-dir", help="also save the plan there (.k3lab/plan.json), as convert does")
    pl.add_argument("--name", default=None, help="output basename (default: the model's, Kimi-K3)")
    pl.add_argument("--jobs", type=_count(1, MAX_JOBS), default=1, help="for the disk and memory forecast")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=_plan)

    c = sub.add_parser("convert", help="convert the text model to a GGUF split set, shard by shard")
    _common_source(c)
    c.add_argument("--out-dir", required=True)
    c.add_argument("--shards", default=None, help="N, A-B or a comma mix (default: all)")
    c.add_argument(
        "--jobs", type=_count(1, MAX_JOBS), default=1, help="shards converted in parallel processes"
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="redo files that are already complete (with --push-to: also replace another set the repo holds)",
    )
    c.add_argument("--name", default=None, help="output basename (default: the model's, Kimi-K3)")
    c.add_argument("--quiet", action="store_true", help="errors and one summary line only")
    c.add_argument("--scheduler", help="fan the shards out on this Dask scheduler instead of local processes")
    c.add_argument(
        "--push-to",
        metavar="ORG/NAME",
        type=_repo_id,
        help="publish every file to this Hub repo from the machine that made it (workers share nothing but the Hub)",
    )
    c.add_argument(
        "--keep-local", action="store_true", help="with --push-to: keep each file after uploading it"
    )
    _push_flags(c)
    c.set_defaults(func=_convert)

    pu = sub.add_parser("publish", help="push a converted set (and its mmproj, tokenizer) to a Hub repo")
    pu.add_argument("out_dir", help="the output folder of a conversion")
    pu.add_argument("push_to", metavar="ORG/NAME", type=_repo_id)
    pu.add_argument("--force", action="store_true", help="replace another set the repo holds")
    _retry_budget_flag(pu)
    _push_flags(pu)
    pu.set_defaults(func=_publish, keep_local=True)

    b = sub.add_parser("batch", help="run a notebook once per shard with papermill, on Dask")
    b.add_argument(
        "--notebook",
        default=str(Path(__file__).resolve().parent.parent / "notebooks" / "03-convert-shard.ipynb"),
        help="default: the repository's notebooks/03-convert-shard.ipynb",
    )
    b.add_argument("--meta", required=True)
    b.add_argument("--src", help="folder with the safetensors shards (default: --meta)")
    b.add_argument("--out-dir", required=True)
    b.add_argument("--shards", default=None, help="N, A-B or a comma mix (default: all)")
    b.add_argument("--scheduler", help="address of a running Dask scheduler (default: a LocalCluster)")
    b.add_argument("--workers", type=_count(1, MAX_JOBS), default=2, help="LocalCluster worker processes")
    b.add_argument("--run-id", help="default: a timestamp")
    b.add_argument("--runs-dir", default="papermill_runs")
    b.set_defaults(func=_batch)

    vi = sub.add_parser("vision", help="the MoonViT tower and projector as an mmproj GGUF")
    _source_flags(vi)
    vi.add_argument("--out", required=True, help="e.g. OUT_DIR/mmproj-Kimi-K3-BF16.gguf")
    vi.set_defaults(func=_vision)

    cl = sub.add_parser("check-logits", help="NumPy reference on the source vs llama.cpp on the GGUF")
    _source_flags(cl)
    cl.add_argument("--gguf", required=True, help="the first file of the converted split set")
    cl.add_argument("--prompt", help="text to tokenize (default: a built-in mixed prompt)")
    cl.add_argument("--tokens", help="token ids instead of a prompt, e.g. '1,2,3'")
    cl.add_argument(
        "--threshold",
        type=_positive,
        default=1e-4,
        help="whole-model per-position NMSE shown as good (information)",
    )
    cl.add_argument(
        "--mode",
        choices=["ggml", "f32"],
        default="ggml",
        help="ggml: round activations as llama.cpp's kernels do (sharp); f32: the model as written",
    )
    cl.add_argument(
        "--blocks",
        action="store_true",
        help="print every position and every stage (by default: the summary and any failing stage)",
    )
    cl.set_defaults(func=_check_logits)

    v = sub.add_parser("verify", help="check a converted set against its manifest (and the source)")
    v.add_argument("out_dir")
    v.add_argument("--manifest", help="default: OUT_DIR/MANIFEST.json")
    _source_flags(v, meta_required=False)  # with --src or --repo: re-derive every tensor from it
    v.add_argument("--quiet", action="store_true")
    v.set_defaults(func=_verify)

    lb = sub.add_parser(
        "lab", help="JupyterLab on the notebooks (from anywhere, as root too; saved without outputs)"
    )
    lb.set_defaults(func=_lab, passes_unknown=True)  # other arguments go to `jupyter lab` as they are

    tm = sub.add_parser("tensor-map", help="the HF -> GGUF tensor table (TENSOR_MAP.md) from the rule table")
    tm.set_defaults(func=_tensor_map)

    d = sub.add_parser("demo", help="the main job, end to end, on the built-in tiny model")
    d.add_argument("--workdir", default="k3-demo", help="where the demo writes (default: ./k3-demo)")
    d.add_argument("--seed", type=_count(0, 2**32 - 1), default=0)
    d.add_argument("--jobs", type=_count(1, MAX_JOBS), default=2)
    d.set_defaults(func=_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from k3lab.pipeline.running.task import Stopped, stop_on_sigterm

    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, or a bad argument (one line said)
        return int(e.code or 0)
    if unknown and not getattr(args, "passes_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.jupyter_args = unknown
    if threading.current_thread() is threading.main_thread():
        stop_on_sigterm()
    try:
        return int(args.func(args) or 0)
    except K3LabError as e:  # one line (a run with several failed files: one line each)
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"k3lab: error: {line}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
