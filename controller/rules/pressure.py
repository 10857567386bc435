"""Which sandboxes a filling node releases, and when. Pure: no I/O, no clock, no client.

The kubelet starts evicting Pods when its root has less than 10% available (`nodefs.available<10%`);
its image garbage collector frees images between a high and a low watermark (85% / 80% used) before
that. sandkeep does the same for retained workspaces: above `high` percent used (or below an optional
floor of free bytes), sandboxes are released oldest deadline first (lowest priority first) until the
projected usage, from their measured sizes, is under `low`. Pinned and held sandboxes are never chosen;
when they are all that is left, the plan says so and names the largest of them.

"Used" is the size minus what an unprivileged writer can still use (`f_bavail`), as the kubelet reads
"available": the root-reserved blocks count as used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

Key = tuple[str, str]
BLOCKED_SHOWN = 5  # how many of the largest pinned/held sandboxes an unrelieved plan names


@dataclass(frozen=True)
class Watermarks:
    high: float  # used percent above which releasing starts
    low: float  # used percent releasing brings the projection under
    min_free_bytes: int = 0  # optional floor: fewer bytes available than this also counts as over high

    def problem(self) -> str | None:
        """Why these watermarks cannot work, in words for a person; None when they can."""
        if not (0 < self.low <= 100 and 0 < self.high <= 100):
            return f"watermarks are used percentages in (0, 100]: got high {self.high}, low {self.low}"
        if self.low >= self.high:
            return (
                f"the low watermark ({self.low}%) must be below the high one ({self.high}%): releasing starts "
                "above high and stops under low"
            )
        if self.min_free_bytes < 0:
            return f"the free-bytes floor cannot be negative: got {self.min_free_bytes}"
        return None


@dataclass(frozen=True)
class Disk:
    size: int  # bytes
    available: int  # bytes an unprivileged writer can still use

    @property
    def used(self) -> int:
        return self.size - self.available

    @classmethod
    def of(cls, vfs: os.statvfs_result) -> Disk:
        return cls(vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize)


@dataclass(frozen=True)
class Candidate:
    key: Key
    size: int | None  # measured bytes; None: not measured yet (never chosen: it would project nothing)
    deadline: datetime | None  # None: no usable deadline, the oldest there is
    pinned: bool = False
    held: bool = False  # in use, or use cannot be ruled out
    deleting: bool = False  # already on its way out: its bytes are projected as freed, it is never chosen
    priority: int = 0  # lower is released first (a SandboxPolicy's pressure priority)
    holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    over: bool  # the disk is above high (or under the floor): releasing is called for
    release: tuple[Key, ...]  # what to release, in order
    projected_used: int  # bytes used once the deleting and the released are gone
    relieved: bool  # the projection is under low (and meets the floor); always True when not over
    blocked: tuple[Candidate, ...] = ()  # not relieved: the largest pinned/held sandboxes in the way


def percent(used: int, size: int) -> float:
    return 100.0 * used / size if size > 0 else 0.0


def is_over(disk: Disk, marks: Watermarks) -> bool:
    return disk.used * 100 > marks.high * disk.size or disk.available < marks.min_free_bytes


def _under(used: int, disk: Disk, marks: Watermarks) -> bool:
    return used * 100 < marks.low * disk.size and disk.size - used >= marks.min_free_bytes


def _age(cand: Candidate) -> tuple[int, float, Key]:
    when = -math.inf if cand.deadline is None else cand.deadline.timestamp()
    return cand.priority, when, cand.key


def oldest_first(sandboxes: Iterable[Candidate]) -> list[Candidate]:
    """The order sandboxes are released in: lowest priority first, then oldest deadline (none: oldest)."""
    return sorted(sandboxes, key=_age)


def choose(disk: Disk, marks: Watermarks, sandboxes: Iterable[Candidate]) -> Plan:
    """What to release now: nothing below `high`; above it, the oldest releasable ones (lowest priority
    first, then oldest deadline) until the projected usage is under `low`, stopping at the first that gets
    there. Bytes of sandboxes already deleting are projected as freed first, so a pass that follows one
    whose deletions are still running releases nothing more for the same shortfall."""
    if disk.size <= 0 or not is_over(disk, marks):
        return Plan(False, (), max(disk.used, 0), True)
    every = list(sandboxes)
    used = disk.used - sum(c.size or 0 for c in every if c.deleting and not c.held)
    chosen: list[Key] = []
    releasable = oldest_first(c for c in every if not (c.pinned or c.held or c.deleting) and c.size is not None)
    for cand in releasable:
        if _under(used, disk, marks):
            break
        chosen.append(cand.key)
        used -= cand.size or 0
    relieved = _under(used, disk, marks)
    blocked: tuple[Candidate, ...] = ()
    if not relieved:
        kept = [c for c in every if (c.pinned or c.held) and not c.deleting]
        blocked = tuple(sorted(kept, key=lambda c: (-(c.size or 0), c.key))[:BLOCKED_SHOWN])
    return Plan(True, tuple(chosen), used, relieved, blocked)
