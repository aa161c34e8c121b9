"""The ``k3lab`` command: argument parsing only; every subcommand calls a function notebooks call too."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import K3LabError


def _synth(args: argparse.Namespace) -> int:
    from .synth import synthesize
    from .synth.report import describe

    result = synthesize(args.preset, args.out, seed=args.seed, experts=args.experts)
    print(describe(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.workdir, seed=args.seed, jobs=args.jobs)


def _tokenizer(args: argparse.Namespace) -> int:
    from .tokenizer import write_tokenizer_gguf

    print(write_tokenizer_gguf(args.meta, args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .synth import PRESETS

    p = argparse.ArgumentParser(prog="k3lab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("synth", help="write a synthetic Kimi-K3 checkpoint")
    s.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--experts", type=int, default=None, help="override the number of routed experts")
    s.set_defaults(func=_synth)

    t = sub.add_parser(
        "tokenizer", help="the vocabulary and hyperparameters as a standalone GGUF (no tensors)"
    )
    t.add_argument(
        "--meta", required=True, help="folder with config.json, tiktoken.model, tokenizer_config.json"
    )
    t.add_argument("--out", required=True, help="output .gguf")
    t.set_defaults(func=_tokenizer)

    d = sub.add_parser("demo", help="the main job, end to end, on the built-in tiny model")
    d.add_argument("--workdir", default="k3-demo", help="where the demo writes (default: ./k3-demo)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--jobs", type=int, default=2)
    d.set_defaults(func=_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except K3LabError as e:
        print(f"k3lab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("k3lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
