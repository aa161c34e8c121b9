"""Controls and the view they drive, with no Output widget: the default view is displayed as plain
outputs, so a headless run (papermill's, a batch's) gets it whole and never waits on a front end
that is not there (an Output widget's capture can leave nbclient waiting forever); in a browser each
change replaces those outputs in place, by their display ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def live_view(render: Callable[..., list[Any]], controls: dict[str, Any]) -> list[Any]:
    """Show ``controls`` (ipywidgets, by the name of the argument each gives ``render``) and what
    ``render(**values)`` returns (a list: figures, HTML), redrawn in place on every change. Returns
    the first view's items (what a headless run computed)."""
    import ipywidgets as widgets
    from IPython.display import display

    def values() -> dict[str, Any]:
        return {name: w.value for name, w in controls.items()}

    display(widgets.HBox(list(controls.values())))
    first = render(**values())
    handles = [display(item, display_id=True) for item in first]

    def redraw(_: Any = None) -> None:
        for handle, item in zip(handles, render(**values())):
            handle.update(item)

    for w in controls.values():
        w.observe(redraw, "value")
    return first
