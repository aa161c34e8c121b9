"""The figures the README and docs/ give for the real model are what `k3lab plan` makes of the real
96-shard headers now (`synth --preset full`): the output files, the data, the disk a streaming process
and a publishing one need, the peak memory of a converting process. A change that moves one of them
fails here until the pages say the new figure."""

from __future__ import annotations

import pytest
from conftest import ROOT

from k3lab import request
from k3lab.pipeline.planning.plan_table import streaming_disk
from k3lab.request import Request
from k3lab.util import human_bytes


@pytest.fixture(scope="module")
def real_plan(full_src):
    return request.plan(Request(meta=str(full_src[0])))  # (the real headers; the data are holes)


def _says(page: str, *figures: str) -> None:
    text = " ".join((ROOT / page).read_text().split())  # (a figure may wrap)
    for figure in figures:
        assert figure in text, f"{page} does not say {figure!r} (what `k3lab plan` of the real headers makes)"


def test_the_pages_say_the_real_models_figures(real_plan) -> None:
    stream = streaming_disk(real_plan)
    largest_file = max(f.nbytes for f in real_plan.files)
    total = sum(f.nbytes for f in real_plan.files)
    peak = max(f.memory for f in real_plan.files)
    files = f"{len(real_plan.files)} output files"
    _says(
        "README.md",
        human_bytes(stream),  # source shards on disk per streaming process
        human_bytes(2 * largest_file),  # publishing: one written, one uploading
        human_bytes(peak),  # per converting process
        f"{human_bytes(total)} of tensor data",
    )
    _says("docs/converting.md", files, human_bytes(stream), human_bytes(peak))
    _says("docs/publishing.md", human_bytes(stream + 2 * largest_file))  # two shards' worth and two files
    _says("docs/benchmarks.md", human_bytes(stream))


def test_the_pages_say_the_real_models_variants(full_src, tmp_path_factory) -> None:
    """The variants' sizes and bits per weight the pages give are what `k3lab quantize --dry-run` makes
    of the plan of the real headers now."""
    import math

    from llama_support import HAVE_LLAMA

    if not HAVE_LLAMA:
        pytest.skip("the variants' plans need llama.cpp's ggml (llama-cpp-python)")
    from k3lab.variants import VariantRequest, forecast

    out = tmp_path_factory.mktemp("full-plan")
    request.plan(Request(meta=str(full_src[0]), out_dir=str(out)))
    asked = "MXFP4-Q8_0,MoE-Q3_K,MoE-Q2_K,Q2_K,MoE-IQ2_XXS,IQ2_XXS,MoE-IQ1_S"
    for vp in forecast(Request(out_dir=str(out)), VariantRequest(asked)):
        weights = sum(math.prod(t.ne) for f in vp.files for t in f.tensors)
        row = f"| `{vp.label}` | {human_bytes(vp.nbytes)} | {8 * vp.nbytes / weights:.3f} |"
        _says("docs/variants.md", row)
        if vp.label in ("MXFP4-Q8_0", "MoE-Q2_K", "MoE-IQ2_XXS", "MoE-IQ1_S"):
            _says("README.md", f"| `{vp.label}` | {human_bytes(vp.nbytes)} |")
        if vp.label in ("MXFP4-Q8_0", "MoE-IQ1_S"):  # the smallest and the largest
            _says("docs/running.md", f"{human_bytes(vp.nbytes)} (`{vp.label}`)")
