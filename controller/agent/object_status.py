"""What the agent says about one live object: its status (presence, size, use, and while deleting its phase and
tombstone) written by server-side apply only when it changes anything, its Events (once per reason and message),
and lines rate-limited per subject. `report.Reporter` builds on it (outcomes of the deletion pipeline, metrics).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from typing import Any

from controller.agent.decide import size_partial, status_changed
from controller.agent.state import Part
from controller.api.kube import AGENT_MANAGER, KubeError
from controller.node.inuse import Usage
from controller.observe import logs
from controller.rules import objects
from controller.rules.contracts import Condition, Phase, Reason
from controller.rules.objects import Obj
from controller.rules.sizes import human_size

log = logging.getLogger("sandkeep.agent")


def conditions(obj: Obj) -> list[Obj]:
    return list((obj.get("status") or {}).get("conditions") or [])


class ObjectStatus(Part):
    """One live object: its lines, its Events, its status."""

    # --- lines and Events ------------------------------------------------------------------------------

    def say_limited(self, subject: str, event: str, level: int = logging.WARNING, **kv: Any) -> None:
        """Log `event` about `subject` when first seen and then at most once per relog period; a subject
        whose event or reason changes (adoption failed, then its namespace went missing) is news at once."""
        now, what = time.monotonic(), f"{event} {kv.get('reason')}"
        last = self.state.said.get(subject)
        if last is not None and last[1] == what and now - last[0] < self.s.relog_every.total_seconds():
            return
        self.state.said[subject] = (now, what)
        logs.say(log, event, level=level, **kv)

    async def event(self, obj: Obj, reason: Reason, message: str, type_: str = "Normal") -> None:
        """Post an Event once per (object, reason, message): a retry is not news."""
        uid = obj["metadata"].get("uid", "")
        if self.state.events.get((uid, str(reason))) == message:
            return
        self.state.events[(uid, str(reason))] = message
        await asyncio.to_thread(self.kube.post_event, obj, reason, message, type_, "sandkeep-agent")

    def check_spec_path(self, obj: Obj) -> None:
        """spec.workspace.path is never used for disk work; one pointing elsewhere is reported, not followed."""
        key = objects.key_of(obj)
        given = ((obj.get("spec") or {}).get("workspace") or {}).get("path")
        mine = self.root.sandbox_path(*key)
        if given and not (given == str(mine) or given.startswith(f"{mine}/")):
            self.say_limited(
                f"path:{key}",
                "spec_path_refused",
                reason=Reason.PATH_OUTSIDE_ROOT,
                object=f"{key[0]}/{key[1]}",
                path=given,
                action=f"the agent only ever works on {mine}; fix spec.workspace.path",
            )

    # --- status ----------------------------------------------------------------------------------------

    def disk_condition(self, obj: Obj) -> Obj:
        path = self.root.sandbox_path(*objects.key_of(obj))
        where = f"{path} on node {self.s.node}"
        status: bool | str
        try:
            present = stat.S_ISDIR(os.lstat(path).st_mode)
            status, reason, message = (
                (True, Reason.RETAINED, where)
                if present
                else (False, Reason.LOST, f"{where}: it is not a directory (never followed)")
            )
        except FileNotFoundError:
            status, reason, message = False, Reason.LOST, f"{where}: it does not exist"
        except OSError as err:
            status, reason, message = "Unknown", Reason.MANIFEST_UNREAD, f"{path}: {os.strerror(err.errno or 0)}"
        return objects.condition(Condition.DISK_PRESENT, status, reason, message, previous=conditions(obj))

    def in_use_condition(self, obj: Obj, usage: Usage | None) -> Obj:
        prev = conditions(obj)
        if usage is not None and usage.in_use is False and usage.reason is not None:  # e.g. OrphansPending
            return objects.condition(Condition.IN_USE, False, usage.reason, "; ".join(usage.holders), previous=prev)
        if usage is None or usage.in_use is False:
            return objects.condition(
                Condition.IN_USE, False, Reason.RETAINED, "nothing on the node uses it", previous=prev
            )
        status: bool | str = True if usage.in_use else "Unknown"
        assert usage.reason is not None
        return objects.condition(Condition.IN_USE, status, usage.reason, "; ".join(usage.holders), previous=prev)

    def observed_status(self, obj: Obj) -> Obj:
        """What the agent reports about a live object: presence, size, use."""
        key = objects.key_of(obj)
        usage = self.state.usage.get(key)
        status: Obj = {
            "inUse": bool(usage is not None and usage.holds),
            "conditions": [self.disk_condition(obj), self.in_use_condition(obj, usage)],
        }
        if usage is not None and usage.holders:
            status["heldBy"] = list(usage.holders)
        size = self.sizes().get(key)
        if size is not None and key in self.state.present:
            status["sizeBytes"], status["fileCount"] = size.bytes, size.files
            status["size"] = human_size(size.bytes)
            partial = size_partial("/".join(key), self.s.node, size, self.s.size_budget)
            if partial is not None:
                reason, message = partial
                cond = objects.condition(Condition.SIZE_PARTIAL, True, reason, message, previous=conditions(obj))
                status["conditions"].append(cond)
                self.say_limited(f"size:{key}", "size_partial", reason=reason, object="/".join(key), bytes=size.bytes)
        who = self.owners().get(key)
        if who is not None and key in self.state.present:
            status["owner"] = {"uid": who[0], "gid": who[1]}
        return status

    def deleting_status(
        self,
        obj: Obj,
        phase: Phase,
        *,
        extra: list[Obj] | None = None,
        held_by: list[str] | None = None,
        usage: Usage | None = None,
        tombstone: str | None = None,
    ) -> Obj:
        status: Obj = {
            "phase": str(phase),
            "inUse": bool(usage is not None and usage.holds) or bool(held_by),
            "conditions": [self.disk_condition(obj), self.in_use_condition(obj, usage), *(extra or [])],
        }
        if held_by:
            status["heldBy"] = held_by[:32]
        if tombstone:
            status["tombstone"] = tombstone
        return status

    async def apply(self, obj: Obj, status: Obj, *, deleting: bool = False) -> Obj:
        """Server-side apply of the agent's part of status, only when it changes anything."""
        if not status_changed(obj, status, deleting=deleting):
            return obj
        try:
            updated: Obj = await asyncio.to_thread(self.kube.apply_status, obj, status, AGENT_MANAGER)
        except KubeError as err:
            if err.not_found:  # gone unseen (its finalizer removed by someone else): nothing left to report on
                self.state.forget(obj)
                return obj
            raise
        self.state.remember(updated)
        return updated
