"""The memory forecast: the peak RSS of the process converting each output file, from the plan alone
(what ``k3lab plan`` prints and a cluster is sized by)."""

from __future__ import annotations

from typing import Any

from k3lab.formats.direct_io import READ_HELD
from k3lab.formats.gguf_stream import KV
from k3lab.formats.safetensors import TensorEntry
from k3lab.pipeline.streams import job_memory

# a converting process's Python, numpy, gguf, huggingface_hub and the plan before any tensor
# (104 MiB measured converting a tiny shard without experts; `benchmarks/run.py fullscale`)
BASE_RSS = 104 * 1024 * 1024


def file_memory(tensors: list[Any], entries: list[list[TensorEntry]]) -> int:
    """Forecast peak RSS of the process converting these planned tensors, each with its source
    entries (file 1 adds its vocabulary later)."""
    jobs = [t.job(es) for t, es in zip(tensors, entries)]
    # (and the direct reads' buffers no stream holds: read ahead, or free for the next read)
    return BASE_RSS + READ_HELD + job_memory(jobs)


def vocab_memory(kvs: list[KV]) -> int:
    """What file 1's metadata costs while it is written (the strings and gguf-py's packed copy)."""
    # (a GGUF array holds one type: the 163,840 token strings are summed at C speed)
    strings = sum(
        sum(map(len, kv.value)) for kv in kvs if isinstance(kv.value, list) and _all_strings(kv.value)
    )
    items = sum(len(kv.value) for kv in kvs if isinstance(kv.value, list))
    return 3 * strings + 120 * items


def _all_strings(values: list) -> bool:
    return set(map(type, values)) == {str}
