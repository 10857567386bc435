"""Byte counts for people: `1.5G` beside the exact `sizeBytes` (the RetainedSandbox SIZE column, `sandkeep ls`)."""

from __future__ import annotations


def human_size(size: int) -> str:
    """Binary units as `du -h` writes them: whole bytes below 1K, one decimal above (`512B`, `3.4K`, `1.5G`)."""
    value = float(max(size, 0))
    for unit in ("B", "K", "M", "G"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}T"
