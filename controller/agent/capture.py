"""Capture (issue 27): each pass, every captured volume whose Pod has ended is kept as a sandbox or deleted.

First in a pass, before leftover tombstones are cleared (an interrupted keep may have left its workspace in a
retain's staging directory, and `Volumes.keep` moves it back first). For each volume no longer mounted:
its Pod is looked up in this node's Pods (one list, by uid, only when some volume waits for a decision), and
`rules.capture.decide` says keep, delete or look again; then `Volumes.keep` or `.discard`, and an Event on the
Pod says what became of its workspace and why. The sandbox kept is adopted by the same pass, like any other.
A volume still mounted is in use: never touched. One whose Pod never unpublished it (the kubelet or the agent
was down, the node rebooted, the Pod was force-deleted) is decided once its Pod is gone or in a final phase.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from controller.agent.report import Reporter
from controller.agent.state import Part, Shared
from controller.node.capture import Busy, Kept, Lost, Record, State, Volume, Volumes
from controller.node.fsdelete import DeleteResult
from controller.observe import logs
from controller.rules.capture import Decision, decide, origin_of, pod_volume
from controller.rules.contracts import Reason
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.agent")
# An entry without a record is a publish that stopped before writing one (nothing was ever mounted from it):
# deleted once this old and still empty, so it is never a publish in progress.
BROKEN_AFTER = timedelta(minutes=10)


def _pod_ref(record: Record) -> Obj:
    """The Pod an Event is about, from the record (the kubelet's names): it may be gone from the API."""
    meta = {"name": record.pod_name, "namespace": record.pod_namespace, "uid": record.pod_uid}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


class Capture(Part):
    def __init__(
        self, shared: Shared, report: Reporter, volumes: Volumes, pods: Callable[[], list[Obj] | None]
    ) -> None:
        super().__init__(shared)
        self.report = report
        self.volumes = volumes
        self.pods = pods  # this node's Pods (one list request); None: could not be listed

    async def tend(self) -> None:
        """Decide and act on every captured volume that is no longer mounted (see the module's note). Whatever
        fails here is said and tried again next pass; the rest of the pass goes on."""
        now = datetime.now(UTC)
        try:
            pending = await asyncio.to_thread(self._pending, now)
        except Exception as err:
            self._failed("capture", "the volumes directory", err)
            return
        if not pending:
            return
        listed = await asyncio.to_thread(self.pods) if any(v.record for v in pending) else []
        if listed is None:  # a Pod that cannot be read is not a Pod that is gone: decided next pass
            self.report.say_limited("capture-pods", "capture_waits", reason=Reason.CAPTURE_FAILED, why="no Pod list")
            return
        by_uid = {p.get("metadata", {}).get("uid"): p for p in listed}
        for volume in pending:
            try:
                await self._one(volume, by_uid, now)
            except Exception as err:
                self._failed(f"capture:{volume.entry}", volume.record.volume_id if volume.record else volume.entry, err)

    def _failed(self, subject: str, volume: str, err: Exception) -> None:
        self.report.say_limited(
            subject,
            "capture_failed",
            reason=Reason.CAPTURE_FAILED,
            volume=volume,
            error=repr(err)[:300],
            action="retried every pass",
        )

    def _pending(self, now: datetime) -> list[Volume]:
        """The volumes a pass acts on: no longer mounted, or decided and not finished, or left without a record."""
        out = []
        points = self.volumes.mount_points()  # once for every record: a node with many Pods has many mounts
        for volume in self.volumes.records():
            record = volume.record
            if record is None:
                old = volume.changed is not None and now - volume.changed > BROKEN_AFTER
                if old and self.volumes.workspace_empty(volume.entry) is not False:
                    out.append(volume)
                elif old:
                    self.report.say_limited(
                        f"capture:{volume.entry}",
                        "capture_unreadable",
                        reason=Reason.CAPTURE_FAILED,
                        entry=str(self.volumes.path / volume.entry),
                        why=volume.why,
                        action="its workspace holds files and no record says whose: look at it, then remove it",
                    )
            elif record.sandbox is not None:  # a reopen: never kept nor discarded; its unpublish removes it
                if not self.volumes.mounted(record, points):
                    out.append(volume)  # unless that never came: released once its Pod is gone (`_released`)
            elif record.state in (State.KEEPING, State.KEPT) or not self.volumes.mounted(record, points):
                out.append(volume)
        return out

    async def _one(self, volume: Volume, pods: dict[object, Obj], now: datetime) -> None:
        record = volume.record
        if record is None:
            await asyncio.to_thread(self.volumes.discard, volume.entry)
            logs.say(log, "capture_cleared", reason=Reason.DELETED, entry=volume.entry, why=volume.why)
            return
        if record.sandbox is not None:
            await self._released(record, volume.entry, pods.get(record.pod_uid))
            return
        if record.state in (State.KEEPING, State.KEPT):  # decided before a crash: finish that decision
            if record.origin is not None:  # written with the decision, always
                kept = await asyncio.to_thread(self.volumes.keep, volume.entry, record.origin, record.why or "")
                await self._said(record, record.why or "", kept)
            return
        ended = record.ended_at() if record.state is State.UNPUBLISHED else None
        pod = pods.get(record.pod_uid)
        decision = decide(record.keep, pod, waited=None if ended is None else now - ended)
        if decision is None:
            return
        if decision.keep:
            origin = origin_of(
                pod,
                decision.outcome,
                pod_name=record.pod_name,
                pod_uid=record.pod_uid,
                node=self.s.node,
                volume=pod_volume(record.target_path),
            )
            result = await asyncio.to_thread(self.volumes.keep, volume.entry, origin, decision.why)
            await self._said(record, decision.why, result)
        else:
            deleted = await asyncio.to_thread(self.volumes.discard, volume.entry)
            await self._discarded(record, decision, deleted)

    async def _released(self, record: Record, entry: str, pod: Obj | None) -> None:
        """A reopen no longer mounted whose Pod is gone or ended (the node rebooted, the Pod was force-deleted
        with the kubelet down): its record goes, and with it the hold on the sandbox. The sandbox is untouched."""
        if pod is not None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            return  # its Pod may still mount it (a publish being retried): the hold stays
        if await asyncio.to_thread(self.volumes.forget, entry) is True:
            sandbox = f"{record.pod_namespace}/{record.sandbox}"
            pod_name = f"{record.pod_namespace}/{record.pod_name}"
            logs.say(log, "reopen_released", reason=Reason.POD_MOUNT, pod=pod_name, sandbox=sandbox, why="pod ended")

    async def _said(self, record: Record, why: str, result: Kept | Busy | Lost | None) -> None:
        """The Event and log line of a keep."""
        pod = f"{record.pod_namespace}/{record.pod_name}"
        if isinstance(result, Kept):
            where = f"{result.namespace}/{result.name}"
            logs.say(log, "workspace_kept", reason=Reason.WORKSPACE_KEPT, pod=pod, sandbox=where, why=why)
            message = f"workspace kept as RetainedSandbox {where} on node {self.s.node}: {why}"
            await self.report.event(_pod_ref(record), Reason.WORKSPACE_KEPT, message)
        elif isinstance(result, Lost):
            logs.say(log, "workspace_lost", level=logging.WARNING, reason=Reason.WORKSPACE_NOT_KEPT, pod=pod)
            message = f"workspace not kept on node {self.s.node}: {result.why} ({why})"
            await self.report.event(_pod_ref(record), Reason.WORKSPACE_NOT_KEPT, message, "Warning")

    async def _discarded(self, record: Record, decision: Decision, deleted: DeleteResult | Busy | None) -> None:
        if not isinstance(deleted, DeleteResult):
            return  # mounted again meanwhile (Busy), or already gone: nothing to say
        pod = f"{record.pod_namespace}/{record.pod_name}"
        logs.say(
            log, "workspace_not_kept", reason=Reason.WORKSPACE_NOT_KEPT, pod=pod, why=decision.why, deleted=deleted.ok
        )
        tail = "deleted" if deleted.ok else f"being deleted ({deleted.describe()}; retried every pass)"
        message = f"workspace not kept: {decision.why}; its files are {tail} on node {self.s.node}"
        await self.report.event(_pod_ref(record), Reason.WORKSPACE_NOT_KEPT, message)
