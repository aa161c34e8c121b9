"""Looking inside: the data behind the notebooks, as plain functions returning plain values.

Every function reads a checkpoint (or a converted set) and returns rows, arrays or dicts; the plots
live in ``plots.py`` and the story in ``notebooks/``. One module per job: ``paths`` (where a
notebook's paths start, where it writes its result), ``opening`` (a checkpoint and its plan, through
the same request as the CLI), ``layouts`` (01), ``scales`` (02, 03), ``vision`` and ``chat`` (04), ``sets``
(05), ``forwards`` (05: Moonshot's forward, the reference and llama.cpp, layer by layer), ``variants``
(06: what each quantised variant does), ``costs`` (06: each tensor's cost per type, the size-loss curve), ``divergence`` (llama-perplexity's KL figures), ``tables`` (HTML tables), ``live`` (controls and the view they drive), ``parameters`` (a
notebook's parameters checked as the CLI checks flags). A notebook imports ``k3lab.explore`` and finds them all here.
"""

from __future__ import annotations

from k3lab.explore.costs import COST_LADDER, cost_grid, cost_tables, loss_curve, variant_losses
from k3lab.explore.divergence import KLStats, kl_stats
from k3lab.explore.imatrix import column_importance, ensure_imatrix, statistics, stats_rows
from k3lab.explore.layouts import (
    derive_tensor,
    file_layers,
    first_mxfp4_layer,
    first_shard,
    output_file,
    planned_by_source,
    shard_rows,
)
from k3lab.explore.live import live_view
from k3lab.explore.opening import (
    check_vision,
    convert,
    ensure_demo,
    fetched,
    make_mmproj,
    open_checkpoint,
    open_conversion,
    source_spec,
)
from k3lab.explore.parameters import check_index, check_parameters
from k3lab.explore.paths import HOME_ENV, home, resolve, save_result
from k3lab.explore.sets import manifest_summary, repo_summary, verify
from k3lab.explore.tables import html_table
from k3lab.explore.variants import (
    choices,
    kl_divergence,
    layer_errors,
    make_variants,
    open_variants,
    sizes,
)
from k3lab.kimi_k3.explore.chat import chat_differences, chat_three_ways, marked_html, tokens_html
from k3lab.kimi_k3.explore.forwards import Forwards, three_forwards
from k3lab.kimi_k3.explore.scales import (
    PROJ_NAMES,
    ScaleStats,
    expert_codes,
    first_block,
    moe_layers,
    nearest_moe_layers,
    scale_stats,
)
from k3lab.kimi_k3.explore.vision import image_way_in, tokenize_with_merges, vision_blocks, weight_stats

__all__ = [
    "COST_LADDER",
    "KLStats",
    "kl_stats",
    "cost_grid",
    "cost_tables",
    "loss_curve",
    "variant_losses",
    "column_importance",
    "ensure_imatrix",
    "statistics",
    "stats_rows",
    "Forwards",
    "three_forwards",
    "chat_differences",
    "chat_three_ways",
    "marked_html",
    "tokens_html",
    "HOME_ENV",
    "PROJ_NAMES",
    "ScaleStats",
    "check_index",
    "check_parameters",
    "check_vision",
    "convert",
    "derive_tensor",
    "ensure_demo",
    "expert_codes",
    "fetched",
    "first_block",
    "file_layers",
    "first_mxfp4_layer",
    "first_shard",
    "home",
    "image_way_in",
    "live_view",
    "html_table",
    "make_mmproj",
    "manifest_summary",
    "moe_layers",
    "nearest_moe_layers",
    "open_checkpoint",
    "open_conversion",
    "output_file",
    "planned_by_source",
    "repo_summary",
    "resolve",
    "save_result",
    "scale_stats",
    "shard_rows",
    "source_spec",
    "tokenize_with_merges",
    "verify",
    "vision_blocks",
    "weight_stats",
    "choices",
    "kl_divergence",
    "layer_errors",
    "make_variants",
    "open_variants",
    "sizes",
]
