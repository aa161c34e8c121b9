"""``python -m k3lab``: the ``k3lab`` command, as installed (``entry.run``: main, then a quick exit)."""

from __future__ import annotations

from k3lab.entry import run

run()
