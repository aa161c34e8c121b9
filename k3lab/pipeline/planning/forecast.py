"""The memory forecast: the peak RSS of the process converting each output file, from the plan alone
(what ``k3lab plan`` prints and a cluster is sized by)."""

from __future__ import annotations

from typing import Any

from k3lab.formats.gguf_stream import KV
from k3lab.formats.safetensors import TensorEntry
from k3lab.pipeline.streams import job_memory

# a converting process's Python, numpy, gguf, huggingface_hub and the plan before any tensor
# (104 MiB measured converting a tiny shard without experts; `benchmarks/run.py fullscale`)
BASE_RSS = 104 * 1024 * 1024


def file_memory(tensors: list[Any], entries: list[TensorEntry]) -> int:
    """Forecast peak RSS of the process converting these planned tensors (file 1 adds its
    vocabulary later)."""
    by_name = {e.name: e for e in entries}
    jobs = [t.job([by_name[n] for n in t.sources]) for t in tensors]
    return BASE_RSS + job_memory(jobs)


def vocab_memory(kvs: list[KV]) -> int:
    """What file 1's metadata costs while it is written (the strings and gguf-py's packed copy)."""
    strings = sum(len(v) for kv in kvs if isinstance(kv.value, list) for v in kv.value if isinstance(v, str))
    items = sum(len(kv.value) for kv in kvs if isinstance(kv.value, list))
    return 3 * strings + 120 * items
