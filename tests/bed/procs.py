"""Process helpers the tests share: whether a pid still runs (a zombie does not), and the pids no agent may inspect."""

from __future__ import annotations

from pathlib import Path

from controller.node.inuse import uninspectable_pids

# What the tests pass to every agent and sweep as `--ignore-pid`: the processes on this machine even root
# cannot read (docs/development.md, "Processes the agent cannot inspect").
IGNORE = sorted(uninspectable_pids())


def alive(pid: int) -> bool:
    """True while `pid` runs: not gone, not a zombie or dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] not in "ZX"
