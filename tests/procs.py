"""Process helpers the tests share: whether a pid still runs (a zombie does not)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """True while `pid` runs: not gone, not a zombie or dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] not in "ZX"
