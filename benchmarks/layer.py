"""The `layer` row: one `layer` shard (real expert dims 3584/3072) with 16 and 64 experts: conversion wall
time (manifest hashing included) as a ratio to `cp` and to `cp && sync` of the same source file (k3lab
fsyncs what it writes), hashing overhead, and peak RSS of the converting process"""

from __future__ import annotations

from benchmarks.common import _layer_row, row


@row
def bench_layer() -> list[tuple[str, str, str]]:
    return _layer_row(16) + _layer_row(64)
