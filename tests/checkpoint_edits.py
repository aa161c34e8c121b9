"""Editing a checkpoint's files as another tool would, and killing a run at a chosen write: what the
hostile-input and layout tests do to a synthetic checkpoint."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from k3lab.formats.safetensors import build_header


def read_tensors(path: Path) -> list[list]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = info["data_offsets"]
        out.append([name, info["dtype"], tuple(info["shape"]), raw[8 + n + a : 8 + n + b]])
    return out


def write_tensors(path: Path, tensors: list[list]) -> None:
    path.write_bytes(build_header([(n, d, s) for n, d, s, _ in tensors]) + b"".join(t[3] for t in tensors))


# a k3lab command killed by SIGKILL at its N-th os.replace (after a file, a record, the plan...)
KILL_AT = """
import os, signal, sys
point, real, seen = int(sys.argv[1]), os.replace, [0]
def replace(a, b, **kw):
    seen[0] += 1
    if seen[0] == point:
        os.kill(os.getpid(), signal.SIGKILL)
    real(a, b, **kw)
os.replace = replace
from k3lab.cli import main
sys.exit(main(sys.argv[2:]))
"""
