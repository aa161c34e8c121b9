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
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in v.items())
    return html.escape(str(v))


def html_table(rows: list[dict[str, Any]], max_height: int = 420) -> str:
    """Rows as an HTML table for a notebook (no pandas needed): numbers readable (thousands
    separators, 4 significant digits), every row there, in a box that scrolls both ways instead of
    running off the page."""
    if not rows:
        return "<p><i>(no rows)</i></p>"
    cols = list(rows[0])
    head = "".join(
        f"<th style='position:sticky;top:0;background:var(--jp-layout-color1,#fff)'>{c}</th>" for c in cols
    )
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return (
        f"<div style='max-height:{max_height}px;overflow:auto;max-width:100%'>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        f"<p style='font-size:smaller'>{len(rows):,} rows</p>"
    )
