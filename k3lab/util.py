"""Small helpers shared by the pipeline and the front."""

from __future__ import annotations


def si_bytes(n: float) -> str:
    """Bytes in SI units (kB, MB, GB: powers of 1000), as tqdm's byte bars count them: what is shown
    beside a bar uses the bar's units (tqdm scales a rate by 1000 whatever its ``unit_divisor``)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
