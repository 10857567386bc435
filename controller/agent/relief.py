"""Releasing for space: above its high watermark the agent releases this node's oldest releasable sandboxes.

Once per pass, after every object was processed: `pressure.choose` (pure) picks what to release from
the root's statvfs, the measured sizes and what the pass saw (pins, holds, deletions under way). Each
chosen sandbox is then read fresh, checked again (`decide.release_refusal`), checked for use again on
the node, and its object DELETEd with uid and resourceVersion preconditions, through the same
`Kube.delete_sandbox` the controller's expiry uses; a pin or any change landing after the fresh read
is a 409 and the sandbox stays. From there it is an ordinary deletion (the finalizer, the pipeline),
counted in `sandkeep_deletions_total{reason="DiskPressure"}`. Why the agent asks and not the
controller: docs/architecture.md, "Releasing for space". With the cluster's dry-run on (`settings.dryRun`,
`SANDKEEP_DRY_RUN`) the DELETE goes with `dryRun=All` and a `WouldDelete` Event says what would go.

When the disk stays above high with only pinned or held sandboxes left, the agent says so: the
`sandkeep_pressure_unrelieved` gauge, a rate-limited log line, and a report on its heartbeat Lease
(`sandkeep.io/pressure`) naming the largest pinned and held sandboxes, which `sandkeep doctor` shows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from controller.agent.decide import Key, candidate, dry_run, release_refusal
from controller.agent.report import Reporter
from controller.agent.state import Part, Shared
from controller.api.kube import KubeError
from controller.node.inuse import Usage
from controller.node.treesize import TreeSize
from controller.observe import logs
from controller.rules.contracts import Reason
from controller.rules.objects import Obj
from controller.rules.pressure import Candidate, Disk, Plan, Watermarks, choose, percent
from controller.rules.sizes import human_size

log = logging.getLogger("sandkeep.agent")
InUseBatch = Callable[[dict[Key, Path]], dict[Key, Usage]]


def usage_words(node: str, root: Path, disk: Disk, marks: Watermarks) -> str:
    """The node's usage as a person reads it in an Event or a report."""
    floor = f", at least {human_size(marks.min_free_bytes)} free" if marks.min_free_bytes else ""
    return (
        f"node {node}'s root {root} is {percent(disk.used, disk.size):.1f}% used "
        f"({human_size(disk.used)} of {human_size(disk.size)}, {human_size(disk.available)} available); "
        f"high watermark {marks.high:g}%, low {marks.low:g}%{floor}"
    )


def unrelieved_report(node: str, disk: Disk, marks: Watermarks, plan: Plan) -> Obj:
    """What the heartbeat Lease carries for `doctor` while nothing more can be released."""
    return {
        "node": node,
        "usedPercent": round(percent(disk.used, disk.size), 1),
        "high": marks.high,
        "low": marks.low,
        "projectedPercent": round(percent(plan.projected_used, disk.size), 1),
        "blocked": [
            {
                "sandbox": "/".join(b.key),
                "bytes": b.size or 0,
                "why": "pinned" if b.pinned else "held",
                "holders": list(b.holders[:5]) if b.held else [],
            }
            for b in plan.blocked
        ],
    }


def _bytes(size: TreeSize | None) -> int | None:
    return None if size is None else size.bytes


class Relief(Part):
    def __init__(
        self, shared: Shared, report: Reporter, in_use_now: Callable[[dict[Key, Path]], dict[Key, Usage]]
    ) -> None:
        super().__init__(shared)
        self.report = report
        self.in_use_now = in_use_now  # one Pod list and one /proc pass for every sandbox asked about
        self.released: dict[str, Reason] = {}  # uid -> the cause its deletion is counted under
        self.published = ""  # the `sandkeep.io/pressure` report: "" while relieved

    def cause_of(self, uid: str) -> Reason:
        return self.released.get(uid, Reason.DELETED)

    def forget(self, uids: set[str]) -> None:
        for uid in [u for u in self.released if u not in uids]:
            del self.released[uid]

    def candidates(self, now: datetime) -> list[Candidate]:
        sizes = self.sizes()
        return [  # a partial size (too slow to measure whole) is what was counted: a lower bound, never skipped
            candidate(obj, _bytes(sizes.get(key)), self.state.usage.get(key), now)
            for key, obj in self.state.objects.items()
            if key in self.state.present
        ]

    async def relieve(self) -> None:
        """One pressure pass: choose, release each chosen one after a fresh read, say what is left."""
        node, marks = self.s.node, self.s.watermarks()
        try:
            disk = Disk.of(await asyncio.to_thread(os.statvfs, self.root.path))
        except OSError as err:
            self.report.say_limited("pressure", "pressure_unread", reason=Reason.DISK_PRESSURE, error=str(err))
            return
        plan = choose(disk, marks, self.candidates(datetime.now(UTC)))
        words = usage_words(node, self.root.path, disk, marks)
        try:
            await self.release(plan.release, words)
        except (KubeError, OSError) as err:  # said, and tried again next pass; the pass itself goes on
            self.report.say_limited(
                "pressure-failed", "release_failed", reason=Reason.DISK_PRESSURE, error=repr(err)[:300]
            )
        unrelieved = plan.over and not plan.relieved
        self.m.pressure_unrelieved.labels(node).set(1 if unrelieved else 0)
        if not unrelieved:
            self.published = ""
            return
        report = unrelieved_report(node, disk, marks, plan)
        self.published = json.dumps(report, sort_keys=True)
        self.report.say_limited(
            "pressure-unrelieved",
            "pressure_unrelieved",
            reason=Reason.PRESSURE_UNRELIEVED,
            usage=words,
            blocked=" ".join(f"{b['sandbox']}({b['why']},{human_size(b['bytes'])})" for b in report["blocked"]),
            action="unpin, stop what holds them, or free space elsewhere; see docs/runbooks.md",
        )

    async def release(self, keys: Sequence[Key], words: str) -> int:
        """Release `keys` in order: each read fresh and checked again, then their use asked once for all
        of them, then each one's preconditioned DELETE. The first refusal ends it (the picture changed: the
        next pass chooses again). Returns how many were asked for.

        One /proc pass for the whole batch, after the fresh reads (one per sandbox cost 100 ms a release);
        a holder arriving after it holds the deletion instead, and the pipeline asks again before renaming.
        """
        now = datetime.now(UTC)
        fresh: list[tuple[Key, Obj]] = []
        for key in keys:
            cached = self.state.objects.get(key)
            if cached is None:
                break
            read = await asyncio.to_thread(self.kube.get_sandbox, *key)
            refusal = release_refusal(read, cached["metadata"]["uid"], now)
            if read is not None:
                self.state.remember(read)
            if refusal is not None or read is None:
                logs.say(log, "release_skipped", reason=Reason.DISK_PRESSURE, object="/".join(key), why=refusal)
                break
            fresh.append((key, read))
        paths = {key: self.root.sandbox_path(*key) for key, _ in fresh}
        usage = await asyncio.to_thread(self.in_use_now, paths) if paths else {}
        asked = 0
        for key, obj in fresh:
            if usage[key].holds:
                logs.say(log, "release_skipped", reason=usage[key].reason, object="/".join(key), why="in use")
                break
            if not await self._release_one(key, obj, words):
                break
            asked += 1
        return asked

    async def _release_one(self, key: Key, fresh: Obj, words: str) -> bool:
        """The DELETE of one sandbox read fresh, with uid and resourceVersion preconditions; True: asked."""
        uid = fresh["metadata"]["uid"]
        if self.s.dry_run or dry_run(fresh):  # the cluster's dry-run, or the namespace's SandboxPolicy's
            return await self._would_release(fresh, key)
        try:
            answer = await asyncio.to_thread(self.kube.delete_sandbox, fresh)
        except KubeError as err:
            if err.conflict or err.not_found:  # a pin (or any change) landed after the fresh read: it wins
                logs.say(log, "release_conflict", reason=Reason.CONFLICT, object="/".join(key))
                return False
            raise
        self.released[uid] = Reason.DISK_PRESSURE
        if isinstance(answer, dict) and answer.get("metadata", {}).get("uid") == uid:
            self.state.remember(answer)  # deleting now: the next pass projects its bytes as freed
        size = _bytes(self.sizes().get(key)) or 0
        rv = fresh["metadata"]["resourceVersion"]
        message = (
            f"{key[0]}/{key[1]} released for disk pressure ({human_size(size)}): {words}; oldest unpinned, "
            f"unheld sandboxes go first until under the low watermark; delete requested (resourceVersion {rv})"
        )
        self.m.pressure_releases.labels(self.s.node).inc()
        await self.report.event(fresh, Reason.DISK_PRESSURE, message, "Warning")
        logs.say(log, "released", reason=Reason.DISK_PRESSURE, object="/".join(key), bytes=size, usage=words)
        return True

    async def _would_release(self, fresh: Obj, key: Key) -> bool:
        """Dry-run: the same DELETE, checked by the API server (`dryRun=All`) and not done; said once."""
        try:
            await asyncio.to_thread(self.kube.delete_sandbox, fresh, dry_run=True)
        except KubeError as err:
            if err.conflict or err.not_found:
                return False
            raise
        message = (
            f"{key[0]}/{key[1]} would be released for disk pressure: node {self.s.node}'s root is above its high "
            f"watermark ({self.s.pressure_high:g}%); dry-run is on, nothing is deleted"
        )
        await self.report.event(fresh, Reason.WOULD_DELETE, message, "Normal")
        self.report.say_limited(
            f"would-release:{fresh['metadata']['uid']}",
            "would_release",
            level=logging.INFO,
            reason=Reason.DISK_PRESSURE,
            object="/".join(key),
        )
        return True
