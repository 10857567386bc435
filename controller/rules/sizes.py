"""Byte counts for people: `1.5G` beside the exact `sizeBytes` (the RetainedSandbox SIZE column, `sandkeep ls`),
and byte counts from people: a quota's `50Gi`."""

from __future__ import annotations

import re

from controller.rules.durations import Invalid


def human_size(size: int) -> str:
    """Binary units as `du -h` writes them: whole bytes below 1K, one decimal above (`512B`, `3.4K`, `1.5G`)."""
    value = float(max(size, 0))
    for unit in ("B", "K", "M", "G"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}T"


# Kubernetes quantity suffixes (resource.Quantity), the subset that makes sense for bytes.
_SUFFIXES = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
}
# [0-9], not \d: `\d` also matches `３`, which int() reads and the CRD's pattern refuses.
_QUANTITY = re.compile(r"([0-9]{1,19})(|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)")
MAX_BYTES = 2**63 - 1  # what a Kubernetes int64 (and so status.sizeBytes) can hold


def parse_size(text: object) -> int | Invalid:
    """A byte count as Kubernetes writes quantities (`500Mi`, `50Gi`, `2T`, `1000000`) -> int; else Invalid.

    Total: whole-string matches, ASCII digits only, no fractions or exponents, at most MAX_BYTES.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text if 0 <= text <= MAX_BYTES else Invalid(str(text), f"out of range: 0 to {MAX_BYTES} bytes")
    raw = str(text).strip(" \t\r\n") if isinstance(text, str) else ""
    match = _QUANTITY.fullmatch(raw)
    if match is None:
        return Invalid(raw, "not a size; use bytes or a quantity such as 500Mi, 50Gi or 2T")
    value = int(match.group(1)) * _SUFFIXES[match.group(2)]
    if value > MAX_BYTES:
        return Invalid(raw, f"too large; at most {MAX_BYTES} bytes")
    return value
