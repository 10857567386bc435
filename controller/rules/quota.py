"""Which sandboxes a namespace over its quota releases. Pure: no I/O, no clock, no client.

A SandboxPolicy's quota (`maxCount`, `maxBytes`) bounds what its namespace keeps retained on all nodes
together: a namespace is a cluster-wide thing, and the controller, which alone sees every node's
sandboxes and their measured sizes (`status.sizeBytes`), decides and asks. Over quota, the namespace's
oldest releasable sandboxes (the same order as disk pressure, `pressure.oldest_first`) are released
until both counts are within it. Pinned and held sandboxes are never chosen; a sandbox already being
deleted counts as gone; one not measured yet frees no bytes, so it is chosen only for the count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from controller.rules.policy import Quota
from controller.rules.pressure import BLOCKED_SHOWN, Candidate, Key, oldest_first
from controller.rules.sizes import human_size


@dataclass(frozen=True)
class Usage:
    count: int
    bytes: int

    def over(self, quota: Quota) -> bool:
        return (quota.max_count is not None and self.count > quota.max_count) or (
            quota.max_bytes is not None and self.bytes > quota.max_bytes
        )

    def words(self, quota: Quota) -> str:
        """`12 sandboxes (5.2G) against a quota of 10 sandboxes, 5.0G`, for Events and log lines."""
        limits = []
        if quota.max_count is not None:
            limits.append(f"{quota.max_count} sandboxes")
        if quota.max_bytes is not None:
            limits.append(human_size(quota.max_bytes))
        return f"{self.count} sandboxes ({human_size(self.bytes)}) against a quota of {', '.join(limits) or 'none'}"


@dataclass(frozen=True)
class Plan:
    before: Usage  # what the namespace keeps now, sandboxes already deleting left out
    release: tuple[Key, ...]  # what to release, in order
    after: Usage  # what it keeps once those are gone
    within: bool  # `after` is within the quota (always True when `before` was)
    blocked: tuple[Candidate, ...] = ()  # still over: the largest pinned or held sandboxes in the way


def choose(quota: Quota, sandboxes: Iterable[Candidate]) -> Plan:
    """What to release now: nothing within the quota; over it, the oldest releasable ones until the
    namespace's count and bytes are both within, stopping at the first that gets there."""
    kept = [c for c in sandboxes if not c.deleting]
    count, size = len(kept), sum(c.size or 0 for c in kept)
    before = Usage(count, size)
    chosen: list[Key] = []
    for cand in oldest_first(c for c in kept if not (c.pinned or c.held)):
        if not Usage(count, size).over(quota):
            break
        count_over = quota.max_count is not None and count > quota.max_count
        if cand.size is None and not count_over:
            continue  # unmeasured: releasing it frees no bytes the plan can count on
        chosen.append(cand.key)
        count, size = count - 1, size - (cand.size or 0)
    after = Usage(count, size)
    within = not after.over(quota)
    blocked: tuple[Candidate, ...] = ()
    if not within:
        held = [c for c in kept if c.pinned or c.held]
        blocked = tuple(sorted(held, key=lambda c: (-(c.size or 0), c.key))[:BLOCKED_SHOWN])
    return Plan(before, tuple(chosen), after, within, blocked)
