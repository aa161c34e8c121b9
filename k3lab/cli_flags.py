"""The command line's flag tables and argument types, shared by the commands that take them (``cli``
builds the parser from them), and each command's example (a test runs every one verbatim)."""

from __future__ import annotations

import argparse
from typing import Any

from k3lab import values

SAMPLE = values.argument(values.count, 1, 1000)
JOBS, SEED, EXPERTS = (
    values.argument(values.count, *n) for n in ((1, values.MAX_JOBS), (0, 2**32 - 1), (1, 4096))
)
CHUNK, CHUNKS = values.argument(values.count, 1, 1 << 20), values.argument(values.count, 1, 1 << 24)
SECONDS, REPO, POSITIVE = (values.argument(c) for c in (values.seconds, values.repo_id, values.positive))


# --- the parser -----------------------------------------------------------------------------------

SOURCE_FLAGS = {
    "--meta": dict(help="folder with config.json, the index and the tokenizer files"),
    "--src": dict(help="folder with the safetensors shards (default: --meta)"),
    "--repo": dict(type=REPO, help="stream from this Hub repo (e.g. moonshotai/Kimi-K3) instead of --src"),
    "--revision": dict(help="branch, tag or commit of --repo (default: main)"),
    "--scratch": dict(
        help="where --repo downloads shards (default: OUT_DIR/.k3lab/scratch; without an output folder, "
        "a temporary folder removed at the end)"
    ),
    "--keep-source": dict(action="store_true", help="keep downloaded shards in --scratch"),
    "--retry-budget": dict(
        type=SECONDS, metavar="S", help="how long the Hub may fail in a row (default 900)"
    ),
}
RUN_FLAGS = {
    "--outtype": dict(
        choices=["auto", "bf16", "f16", "f32"],
        default="auto",
        help="auto: the checkpoint's own types (MXFP4 stays, BF16/F32 kept); or every float as this type",
    ),
    "--chat-template": dict(metavar="FILE", help="a Jinja chat template to embed in file 1"),
    "--name": dict(help="output basename (default: the model's, Kimi-K3)"),
    "--split-max-size": dict(
        metavar="N[K|M|G]",
        help="at most this much tensor data per output file, whole layers only (default: the whole set "
        "in one file when it fits in 50G, else one layer per file)",
    ),
    "--split-max-tensors": dict(
        type=values.argument(values.count, 1, 10**9),
        metavar="N",
        help="at most N tensors per output file, whole layers only (1: one layer per file)",
    ),
}
FILES_HELP = "output files to write: N, A-B or a comma mix (default: all); --shards is its old name"
TYPE_FILE = (
    "\0file:"  # (an argument never holds a NUL: a --tensor-type-file entry among the --tensor-type ones)
)


class TypeFileAction(argparse.Action):
    """``--tensor-type-file FILE`` kept in order among the ``--tensor-type`` entries (llama-quantize
    reads both into one list, in the order given)."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option_string: Any = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.append(TYPE_FILE + str(value))
        setattr(namespace, self.dest, items)


VARIANT_FLAGS = {  # llama-quantize's own flags, with its meaning
    "--variants": dict(
        metavar="TYPE[,TYPE...]",
        help="also make these quantised variants of each file, right after it is converted, on the same "
        "worker (llama-quantize's types or k3lab's recipes; into OUT_DIR/LABEL/)",
    ),
    "--label": dict(help="the variant's name (its folder and files' type label; default: the type or recipe)"),
    "--imatrix": dict(
        metavar="FILE|ORG/NAME:PATH", help="llama-imatrix's importance matrix (GGUF or legacy .dat), local or on the Hub"
    ),
    "--tensor-type": dict(
        action="append", metavar="PATTERN=TYPE", help="llama-quantize's: tensors whose name the regex matches get TYPE "
        "(the first pattern that matches wins; repeatable)"
    ),
    "--include-weights": dict(
        action="append", metavar="NAME", help="llama-quantize's: the imatrix's entries whose names hold NAME, "
        "and no others (repeatable)"
    ),
    "--exclude-weights": dict(
        action="append", metavar="NAME", help="llama-quantize's: not the imatrix's entries whose names hold NAME"
    ),
    "--override-kv": dict(
        action="append", metavar="KEY=TYPE:VALUE", help="llama-quantize's: a metadata key of file 1 set (int, "
        "float, bool, str; repeatable)"
    ),
    "--tensor-type-file": dict(
        action=TypeFileAction, dest="tensor_type", metavar="FILE", help="llama-quantize's: PATTERN=TYPE "
        "entries separated by white space, taken where the flag stands among the --tensor-type ones"
    ),
    "--output-tensor-type": dict(metavar="TYPE", help="llama-quantize's: the type of output.weight"),
    "--token-embedding-type": dict(metavar="TYPE", help="llama-quantize's: the type of token_embd.weight"),
    "--pure": dict(action="store_true", help="llama-quantize's: no mix, every tensor the type's default"),
    "--leave-output-tensor": dict(action="store_true", help="llama-quantize's: output.weight as it is"),
    "--threads": dict(type=values.argument(values.count, 1, 1024), metavar="N",
                      help="threads quantising (default: the cores)"),
}  # fmt: skip
FIT_FLAGS = {  # quantize's: a mix computed from every tensor's measured cost
    "--fit": dict(metavar="SIZE", help="the mix that loses least within SIZE (500G, 470G...): every tensor's type "
                  "chosen from its measured cost, written as llama-quantize's --tensor-type-file (SET/LABEL.tensor-types.txt)"),
    "--fit-ram": dict(metavar="SIZE", help="the mix that loses least on a machine of SIZE memory (384G, 1000G...): the "
                      "files plus the cache of --fit-context's tokens; with --fit-vram, the routed experts in RAM "
                      "(llama.cpp's --cpu-moe), the rest and the cache on the GPU"),
    "--fit-vram": dict(metavar="SIZE", help="with --fit-ram: the GPU's memory (24G, 80G...)"),
    "--fit-context": dict(type=CHUNKS, metavar="N", help="with --fit-ram: the context the machine runs (llama.cpp's "
                          "-c; default the model's context length, as llama.cpp takes it without -c)"),
    "--fit-rows": dict(type=JOBS, metavar="N", help="rows of every matrix measured per type (default 16)"),
    "--fit-floor": dict(metavar="TYPE", default="Q2_K", help="with --fit: what every token passes through (all but "
                        "the routed experts) at this type's bits per weight or more (default Q2_K; none: no floor)"),
}  # fmt: skip
KL_FLAGS = {  # quantize's: each variant measured as llama-perplexity --kl-divergence measures it
    "--kl-text": dict(metavar="FILE", help="then measure each variant's KL from the lossless set on this text, as "
                      "llama-perplexity --kl-divergence reports it (llama.cpp runs both here: small sets); kept in its "
                      "manifest and on the card"),
    "--kl-context": dict(type=CHUNK, default=512, metavar="N", help="with --kl-text: llama-perplexity's -c"),
}  # fmt: skip
PUSH_FLAGS = {
    "--push-branch": dict(help="the branch to publish to (default: main; made if missing)"),
    "--private": dict(action="store_true", help="make the repo private when creating it"),
    "--commit-every": dict(type=SECONDS, metavar="S", help="commit uploads at most this often (default 300)"),
}


EXAMPLES = {  # one a user can run from a fresh clone after `k3lab demo` (tests run each verbatim)
    "synth": "k3lab synth --preset tiny --out k3-tiny",
    "tokenizer": "k3lab tokenizer --meta k3-demo/src --out k3-demo/Kimi-K3-tokenizer.gguf",
    "plan": "k3lab plan --meta k3-demo/src",
    "convert": "k3lab convert --meta k3-demo/src --out-dir k3-demo/out",
    "publish": "k3lab publish k3-demo/out your-name/Kimi-K3-GGUF",
    "quantize": "k3lab quantize k3-demo/out --type Q2_K",
    "imatrix": "k3lab imatrix k3-demo/out --chunk-size 64 --chunks 8",
    "batch": "k3lab batch --meta k3-demo/src --out-dir k3-demo/out",
    "vision": "k3lab vision --meta k3-demo/src --out k3-demo/out/mmproj-Kimi-K3-BF16.gguf",
    "check-logits": "k3lab check-logits --meta k3-demo/src --gguf k3-demo/out/Kimi-K3-8x1.9M-MXFP4.gguf",
    "check-vision": "k3lab check-vision --meta k3-demo/src --mmproj k3-demo/out/mmproj-Kimi-K3-BF16.gguf",
    "setup-judge": "k3lab setup-judge",
    "verify": "k3lab verify k3-demo/out --src k3-demo/src",
    "lab": "k3lab lab",
    "tensor-map": "k3lab tensor-map > TENSOR_MAP.md",
    "demo": "k3lab demo",
}


def _flags(p: argparse.ArgumentParser, *tables: dict[str, dict], **required: bool) -> None:
    for table in tables:
        for flag, kw in table.items():
            p.add_argument(flag, required=required.get(flag.lstrip("-").replace("-", "_"), False), **kw)
