"""Rows as an HTML table for a notebook (no pandas needed)."""

from __future__ import annotations

import html
from typing import Any


def _cell(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):  # a shape: [7168, 2048], as Python and gguf-py print one
        return "[" + ", ".join(str(x) if isinstance(x, int) else _cell(x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in v.items())
    return html.escape(str(v))


def _td(v: Any) -> str:
    """A cell: numbers right-aligned, as numbers are read."""
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    return f"<td style='text-align:right'>{_cell(v)}</td>" if number else f"<td>{_cell(v)}</td>"


def html_table(rows: list[dict[str, Any]], max_height: int = 640) -> str:
    """Rows as an HTML table for a notebook (no pandas needed): one line per row, numbers readable
    (thousands separators, 4 significant digits, right-aligned; shapes as ``[a, b]``), every row
    there, in a box that scrolls both ways instead of running off the page."""
    if not rows:
        return "<p><i>(no rows)</i></p>"
    cols = list(rows[0])
    head = "".join(
        f"<th style='position:sticky;top:0;background:var(--jp-layout-color1,#fff)'>{c}</th>" for c in cols
    )
    body = "".join("<tr>" + "".join(_td(r.get(c, "")) for c in cols) + "</tr>" for r in rows)
    # one line per row (a long name scrolls sideways, never wraps a row over five lines)
    return (
        f"<div style='max-height:{max_height}px;overflow:auto;max-width:100%'>"
        f"<table style='white-space:nowrap'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        f"<p style='font-size:smaller'>{len(rows):,} rows</p>"
    )
