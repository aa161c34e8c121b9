"""What each ``k3lab`` command does with its parsed arguments: make the call of ``k3lab.request``
(or ``k3lab.variants``) that notebooks make too, and print what it returns. ``cli`` parses."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3lab import request, values
from k3lab.errors import K3LabError
from k3lab.request import Request


def _say(line: str) -> None:
    print(f"k3lab: {line}", file=sys.stderr, flush=True)


def _plan(req: Request, args: argparse.Namespace) -> int:
    import json

    from k3lab.pipeline.planning.plan_table import describe_plan

    plan = request.plan(req, _say)
    print(json.dumps(plan.to_json(), indent=1) if args.json else describe_plan(plan, req.jobs))
    return 0


def _convert(req: Request, args: argparse.Namespace) -> int:
    from k3lab.util import human_bytes
    from k3lab.variants import VariantRequest

    if args.imatrix_from:
        from k3lab import imatrix

        made = imatrix.convert_then_variants(
            req, VariantRequest.of(args), args.imatrix_from, None if req.quiet else _say
        )
        _print_imatrix(made.imatrix)
        _say_variants(made.variants, req.out_dir or "", True)
        return 0
    results = request.convert(req, None if req.quiet else _say, variants=VariantRequest.of(args).build())
    written = [r for r in results if not r.skipped]
    workers = sorted({r.worker for r in written})
    branch = req.push_branch or "main"
    check = f"k3lab verify {req.push_to}" + (f" --revision {branch}" if branch != "main" else "")
    where = f"published to {req.push_to}@{branch} (check it: {check})" if req.push_to else f"in {req.out_dir}"
    print(
        f"{len(written)} written, {len(results) - len(written)} already complete; "
        f"{human_bytes(sum(r.nbytes for r in results))} {where}"
        + (f"; written by {len(workers)} processes ({', '.join(workers)})" if len(workers) > 1 else "")
    )
    _say_variants(results, req.out_dir or "")
    return 0


def _quantize(req: Request, args: argparse.Namespace) -> int:
    from k3lab.variants import VariantRequest, describe, forecast, quantize

    if args.dry_run:
        print(describe(forecast(req, VariantRequest.of(args))))
        return 0
    if args.fit or args.fit_ram or args.fit_vram or args.fit_context:
        from k3lab.variants import fit

        fitted, made = fit(req, VariantRequest.of(args), args.fit, args.fit_rows, None if req.quiet else _say,
                           args.fit_floor, args.fit_ram, args.fit_vram, args.fit_context)  # fmt: skip
        where = "" if fitted.on_gpu is None else f" ({fitted.on_gpu:,} on the GPU, the rest in RAM)"
        print(
            f"fitted: {fitted.nbytes:,} bytes{where}, loss {fitted.loss:.4g} (the sum of every tensor's measured cost)"
        )
        _say_variants(made, req.out_dir or "", True)
        return 0

    _say_variants(
        quantize(req, VariantRequest.of(args), None if req.quiet else _say), req.out_dir or "", True
    )
    return 0


def _imatrix(req: Request, args: argparse.Namespace) -> int:
    from k3lab import imatrix

    if args.show_statistics:
        if req.out_dir or len(args.in_file or ()) != 1:
            raise K3LabError("--show-statistics reads one imatrix: give --in-file FILE alone (no SET)")
        stats = imatrix.statistics(args.in_file[0])
        print(stats.table())
        print("\n".join(stats.coverage.lines()))
        return 0
    _print_imatrix(imatrix.compute(req, args, None if req.quiet else _say))
    return 0


def _print_imatrix(result: Any) -> None:
    reached = sum(int((e.counts > 0).sum()) for e in result.entries.values() if e.counts.size > 1)
    experts = sum(e.counts.size for e in result.entries.values() if e.counts.size > 1)
    print(
        f"imatrix: {len(result.entries)} entries from {result.chunks} chunks of {result.chunk_size} tokens "
        f"({result.steps_done} steps computed, {result.steps_skipped} already done; {result.seconds:.1f} s)"
        + (f"; {reached} of {experts} expert rows reached" if experts else "")
        + f" in {result.path}"
    )


def _say_variants(results: list, out_dir: str, always: bool = False) -> None:
    """One line per variant: files written, its size, and where (with the command that checks it)."""
    from k3lab.util import human_bytes

    made: dict[str, list] = {}
    for r in results:
        for v in r.variants:
            made.setdefault(v.label, []).append(v)
    for label, files in made.items():
        written = sum(not v.skipped for v in files)
        where = str(Path(out_dir) / label)
        print(
            f"{label}: {written} written, {len(files) - written} already complete; "
            f"{human_bytes(sum(v.nbytes for v in files))} in {where} (check it: k3lab verify {where})"
        )


def _publish(req: Request, args: argparse.Namespace) -> int:
    pushed, kept, commit, where = request.publish(req, _say)
    print(
        f"{pushed} uploaded, {kept} already in {where}; "
        + (f"commit {commit}" if commit else "nothing to commit")
    )
    return 0


def _verify(req: Request, args: argparse.Namespace) -> int:
    verified = request.verify(
        req, args.manifest, args.all, args.sample, args.tensors, args.seed, args.source_revision
    )
    print("\n".join(verified.lines()))
    return 0 if verified.report.ok else 1


def _check_logits(req: Request, args: argparse.Namespace) -> int:
    tokens = values.token_ids(args.tokens, "--tokens") if args.tokens else None
    report, stages = request.check_logits(
        req, args.gguf, args.prompt, tokens, args.threshold, args.mode, args.judge, args.generate
    )
    if args.blocks:
        print(report.table())
    print(f"whole model, for information: {report.summary()}")
    print(stages.table(every=args.blocks))
    print(f"check-logits {'FAILED' if stages.failed else 'OK'}: the verdict is the stage check")
    return 1 if stages.failed else 0


def _check_vision(req: Request, args: argparse.Namespace) -> int:
    check = request.check_vision(req, args.mmproj, args.image, args.threshold)
    print(check.summary())
    print(check.table())
    print(f"check-vision {'FAILED at ' + check.failed[0] if check.failed else 'OK'}")
    return 1 if check.failed else 0


def _batch(req: Request, args: argparse.Namespace) -> int:
    from k3lab.pipeline.running.batch import summary

    timeouts = (args.cell_timeout, args.notebook_timeout)
    run_dir, results = request.batch(req, args.notebook, args.workers, args.run_id, args.runs_dir, timeouts)
    print(summary(run_dir, results))
    return 0 if all(r.status == "ok" for r in results) else 1


def _front(module: str, function: str) -> Callable[[Request, argparse.Namespace], int]:
    """A command of the front that is one call (imported when run: `k3lab --help` loads none)."""

    def run(req: Request, args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(module), function)(req, args) or 0)

    return run
