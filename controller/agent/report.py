"""What the agent says: status and conditions on its objects, Events, metrics and log lines.

Everything a person or Prometheus reads about a node comes from here (one object's status, Events and lines
through `object_status.ObjectStatus`, which `Reporter` builds on); nothing here decides. `outcome()`
turns one result of the deletion pipeline (`controller/node/reaper.py`) into status, an Event, metrics and a
line, and tells the runtime what follows (`After`): remove the finalizer, retry later, or nothing.
"""

from __future__ import annotations

import contextlib
import errno as E
import logging
import os
import time
from datetime import UTC, datetime
from enum import Enum

from controller.agent.object_status import ObjectStatus, conditions
from controller.node import orphans
from controller.node.inuse import Usage
from controller.node.reaper import Deleted, Held, Outcome, Reaper, Refused, Restored, Stuck
from controller.node.store import Tombstone
from controller.observe import logs
from controller.rules import objects
from controller.rules.contracts import FINALIZER, Condition, Phase, Reason
from controller.rules.objects import Obj, finalizers

log = logging.getLogger("sandkeep.agent")


class After(Enum):
    NOTHING = "nothing"
    FINISH = "finish"  # the directory is gone, or is not this object's: remove the finalizer
    RETRY = "retry"  # held or unread: process the object again after its backoff


def errno_name(code: int | None) -> str:
    return E.errorcode.get(code or 0, str(code))


def stuck_message(sandbox: str, node: str, tombstone: str, errno: int | None, path: str | None) -> str:
    """The TombstoneStuck condition's words (`doctor` reads the errno and path back from them)."""
    return (
        f"sandbox {sandbox} on node {node}: tombstone {tombstone} could not be deleted: "
        f"{errno_name(errno)} at {path}. Retried every pass; fix the cause "
        "(e.g. `chattr -i`, a mount, a file owned by another account) and it goes."
    )


class Reporter(ObjectStatus):
    """What the agent says about its node: an object's status (`ObjectStatus`), each outcome of the deletion
    pipeline, the node's metrics."""

    # --- one outcome of the deletion pipeline ------------------------------------------------------------

    async def outcome(self, obj: Obj | None, tombstone: str | None, outcome: Outcome) -> After:
        """Say one pipeline outcome where a person looks; what follows for the object."""
        ours = obj is not None and objects.is_deleting(obj) and FINALIZER in finalizers(obj)
        mine = obj if ours else None
        ref = "/".join(objects.key_of(obj)) if mine is not None and obj is not None else None
        if isinstance(outcome, Deleted):
            self.m.deletion_duration.labels(self.s.node).observe(outcome.seconds)
            self.m.deletions.labels(self.s.node, str(outcome.reason)).inc()
            self.state.said.pop(f"stuck:{outcome.tombstone}", None)
            logs.say(
                log, "deleted", reason=outcome.reason, object=ref, tombstone=outcome.tombstone, files=outcome.files
            )
        elif isinstance(outcome, Stuck):
            if outcome.tried:
                await self._stuck(mine, outcome)
            return After.NOTHING
        elif isinstance(outcome, Restored):
            self.say_limited(
                f"restore:{outcome.tombstone}",
                "tombstone_restored",
                reason=outcome.reason,
                object="/".join(outcome.key),
                tombstone=outcome.tombstone,
            )
            if outcome.reason != Reason.MANIFEST_CHANGED:
                return After.NOTHING  # a kept object's tombstone put back: nothing to finish
        elif isinstance(outcome, Refused) and outcome.reason != Reason.LOST and obj is not None:
            # Another run retained under this name since the object was made: not this object's to delete.
            self.say_limited(
                f"other-run:{obj['metadata']['uid']}",
                "deletion_skipped",
                reason=outcome.reason,
                object="/".join(objects.key_of(obj)),
                action="the directory holds another run; it stays on disk and is adopted as its own object",
            )
        elif isinstance(outcome, Held):
            return await self._held(mine, tombstone or outcome.tombstone, outcome)
        return After.FINISH if ours else After.NOTHING

    async def _held(self, obj: Obj | None, tombstone: str | None, held: Held) -> After:
        """A deletion (or a tombstone) that waits: say why where a person looks, and try again later."""
        if held.reason == Reason.TOMBSTONE_FOREIGN:
            self.say_limited(
                f"foreign:{tombstone}",
                "tombstone_skipped",
                level=logging.INFO,
                reason=held.reason,
                tombstone=tombstone,
                pid=held.pid,
            )
            return After.NOTHING
        if held.tombstone is not None and held.reason != Reason.MANIFEST_UNREAD:
            self.say_limited(
                f"restore:{held.tombstone}",
                "tombstone_held",
                reason=held.reason,
                object="/".join(held.key) if held.key else None,
                tombstone=held.tombstone,
            )
            return After.NOTHING
        if obj is None:
            return After.NOTHING
        key = objects.key_of(obj)
        if held.survivors or held.refused:
            await self._held_by_orphans(obj, held)
        elif held.usage is not None or held.reason in (Reason.IN_USE, Reason.IN_USE_UNKNOWN, Reason.POD_MOUNT):
            usage = held.usage or Usage(None, (held.error or "the in-use check failed",), Reason.IN_USE_UNKNOWN)
            await self._held_in_use(obj, usage)
        elif held.reason != Reason.MANIFEST_UNREAD:  # the rename failed: counted, said, retried
            self.m.deletion_failures.labels(self.s.node, str(held.reason)).inc()
            self.say_limited(
                f"rename:{obj['metadata']['uid']}",
                "rename_failed",
                reason=held.reason,
                object="/".join(key),
                error=held.error,
            )
            await self.apply(obj, self.deleting_status(obj, Phase.DELETING), deleting=True)
        return After.RETRY  # a manifest that could not be read just now: decided again on a read that works

    async def _held_by_orphans(self, obj: Obj, held: Held) -> None:
        """Held by what the orphan records name: survivors of SIGKILL, processes not proven the recorded
        command's (never signalled), or records not trusted; condition OrphansSurvived says which."""
        key = objects.key_of(obj)
        where = f"sandbox {key[0]}/{key[1]} on node {self.s.node}: deletion held"
        result = orphans.ReapResult(survivors=held.survivors, refused=held.refused)
        message = orphans.held_message(where, result, self.s.orphan_timeout.total_seconds())
        cond = objects.condition(Condition.ORPHANS_SURVIVED, True, held.reason, message, previous=conditions(obj))
        held_by = [str(h)[:256] for h in (*held.survivors, *held.refused)]  # heldBy items are at most 512 long
        status = self.deleting_status(obj, Phase.HELD, extra=[cond], held_by=held_by)
        await self.apply(obj, status, deleting=True)
        await self.event(obj, held.reason, message, "Warning")
        self.say_limited(
            f"survivors:{obj['metadata']['uid']}",
            "deletion_held",
            reason=held.reason,
            object="/".join(key),
            survivors=" ".join(str(s.pid) for s in held.survivors) or None,
            records=len(held.refused) or None,
        )

    async def _held_in_use(self, obj: Obj, usage: Usage) -> None:
        key = objects.key_of(obj)
        message = (
            f"sandbox {key[0]}/{key[1]} on node {self.s.node}: deletion held, "
            f"{'in use' if usage.in_use else 'use cannot be ruled out'} by {'; '.join(usage.holders)}. "
            "It is deleted once nothing uses it (checked again at least every pass)."
        )
        status = self.deleting_status(obj, Phase.HELD, held_by=list(usage.holders), usage=usage)
        await self.apply(obj, status, deleting=True)
        await self.event(obj, usage.reason or Reason.IN_USE, message, "Warning")
        self.say_limited(
            f"held:{obj['metadata']['uid']}",
            "deletion_held",
            reason=usage.reason,
            object="/".join(key),
            holders=len(usage.holders),
        )

    async def _stuck(self, obj: Obj | None, stuck: Stuck) -> None:
        """A tombstone that would not go: metrics, a rate-limited line, and for an object Stuck + an Event.

        Retried by the next pass's tombstone sweep; the metric and the condition are always current.
        """
        self.m.deletion_failures.labels(self.s.node, str(stuck.cause)).inc()
        errno = errno_name(stuck.errno)
        if obj is None:
            self.say_limited(
                f"stuck:{stuck.tombstone}",
                "tombstone_stuck",
                reason=stuck.reason,
                tombstone=stuck.tombstone,
                errno=errno,
                path=stuck.path,
                orphan=True,
            )
            return
        key = objects.key_of(obj)
        message = stuck_message(f"{key[0]}/{key[1]}", self.s.node, stuck.tombstone, stuck.errno, stuck.path)
        cond = objects.condition(Condition.TOMBSTONE_STUCK, True, stuck.cause, message, previous=conditions(obj))
        status = self.deleting_status(obj, Phase.STUCK, extra=[cond], tombstone=stuck.tombstone)
        await self.apply(obj, status, deleting=True)
        await self.event(obj, Reason.TOMBSTONE_STUCK, message, "Warning")
        self.say_limited(
            f"stuck:{stuck.tombstone}",
            "tombstone_stuck",
            reason=stuck.reason,
            object=f"{key[0]}/{key[1]}",
            tombstone=stuck.tombstone,
            errno=errno,
            path=stuck.path,
        )

    # --- the node's metrics ----------------------------------------------------------------------------

    def node_metrics(self, tombstones: list[Tombstone], reaper: Reaper) -> None:
        node = self.s.node
        now = datetime.now(UTC)
        live = {t.name for t in self.root.tombstones()}
        reaper.forget(live)
        remaining = [t for t in tombstones if t.name in live]
        ages = [t.age(now).total_seconds() for t in remaining if t.age(now) >= self.s.stuck_after]
        self.m.tombstones.labels(node).set(len(remaining))
        self.m.tombstones_stuck.labels(node).set(len(ages))
        self.m.tombstone_stuck_oldest.labels(node).set(max(ages, default=0))
        phases: dict[str, int] = {}
        sizes: dict[str, int] = {}
        known = self.sizes()
        for key, obj in self.state.objects.items():
            phase = (obj.get("status") or {}).get("phase") or "Unknown"
            phases[phase] = phases.get(phase, 0) + 1
            measured = known.get(key)
            sizes[phase] = sizes.get(phase, 0) + (measured.bytes if measured is not None else 0)
        self.m.sandboxes.clear()
        self.m.retained_bytes.clear()
        for phase, n in phases.items():
            self.m.sandboxes.labels(node, phase).set(n)
            self.m.retained_bytes.labels(node, phase).set(sizes[phase])
        self.m.in_use_holds.labels(node).set(sum(1 for u in self.state.usage.values() if u.holds))
        with contextlib.suppress(OSError):
            vfs = os.statvfs(self.root.path)
            self.m.root_size.labels(node).set(vfs.f_blocks * vfs.f_frsize)
            self.m.root_avail.labels(node).set(vfs.f_bavail * vfs.f_frsize)


def orphan_report(reaper: Reaper) -> list[Obj]:
    """Stuck tombstones with no object, for `doctor` (published on the heartbeat Lease)."""
    now = time.monotonic()
    out = []
    for name, info in sorted(reaper.stuck.items()):
        if info.key is None:
            failing = int(now - info.first_failed)
            out.append({"name": name, "errno": errno_name(info.errno), "path": info.path, "failingFor": failing})
    return out
