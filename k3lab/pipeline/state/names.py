"""The names on disk of an output folder (README, "On-disk state"):

OUT/NAME-TYPE-000NN-of-000MM.gguf  finished text files of a split set (``Kimi-K3-MXFP4-...``), or
                              OUT/NAME-SIZE-TYPE.gguf, the set's one file (``NAME.partial`` while written)
OUT/mmproj-*.gguf, tokenizer  the files beside the set (``vision``, ``tokenizer``, a publishing run)
OUT/MANIFEST.json             every record merged; rebuilt from the records, plain JSON
OUT/.k3lab/lock               held (``flock``) by the one run writing the folder: "PID TOKEN"
OUT/.k3lab/plan.json          the plan, naming the digest of file 1's KVs (written last)
OUT/.k3lab/kvs.json           file 1's planned metadata
OUT/.k3lab/00001.json ...     one record per finished text file; mmproj.json, tokenizer.json
OUT/.k3lab/scratch/           Hub downloads in flight (default ``--scratch``)
OUT/LABEL/                    a quantised variant of the set (``k3lab quantize``, ``convert --variants``):
                              its files, its MANIFEST.json, and LABEL/.k3lab/variant.json (its plan)
                              beside its records
"""

from __future__ import annotations

import re
from pathlib import Path

from k3lab.errors import K3LabError

STATE_DIR = ".k3lab"
LOCK_NAME, PLAN_NAME, KVS_NAME, SCRATCH_NAME = "lock", "plan.json", "kvs.json", "scratch"
VARIANT_NAME = "variant.json"  # a variant folder's plan
SPLIT_NAME = re.compile(r".+-\d{5}-of-\d{5}\.gguf")
RECORD_NAME = re.compile(r"(\d{5}|[a-z][a-z0-9_-]{0,31})\.json")


class FolderError(K3LabError):
    """The output folder, or a name in it, is not one k3lab may write (a symlinked ``.k3lab``, a
    ``--name`` with a path in it, an ``--out`` that is part of a split set)."""


def plain_name(name: str) -> str:
    """An output file's name: a plain file name, never a path."""
    if "/" in name or name in ("", ".", "..") or "\0" in name:
        raise FolderError(f"{name!r}: not a plain file name")
    return name


def text_record_name(number: int) -> str:
    return f"{number:05d}.json"


def record_names(state: Path) -> list[str]:
    """The names of record files in ``.k3lab/``, in the manifest's order: text files by number
    (``00001.json`` ...), then the others (``mmproj.json``, ``tokenizer.json``)."""
    names = [
        p.name
        for p in state.iterdir()
        if RECORD_NAME.fullmatch(p.name) and p.name not in (PLAN_NAME, KVS_NAME, VARIANT_NAME)
    ]
    return sorted(names, key=lambda n: (not n[0].isdigit(), n))
