"""The Agent's `status.sessions`: which session Pods on this node see their sandbox's workspace
(`agent/sessions.py` compares, by device and inode), written with the agent's own sessions field manager.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from controller.agent import sessions
from controller.agent.base import AgentBase
from controller.agent.decide import Key
from controller.api.kube import AGENT_MANAGER, now_utc
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules import objects
from controller.rules.contracts import MountCheck, Reason
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.agent")


class SessionStatus(AgentBase):
    """Verifying session Pods' mounts, for the controller's exec grant."""

    async def verify_sessions(self, pods: list[Obj] | None, keys: Iterable[Key] | None = None) -> None:
        """Write `status.sessions` of these sandboxes (all: None) from the session Pods on this node."""
        if pods is None or not self.s.sessions_namespace:
            return
        by_uid = sessions.session_pods(pods, self.s.sessions_namespace)
        if by_uid and sessions.own_cgroup(Path("/proc")) is None:  # every answer stays Unknown: say why
            self.report.say_limited(
                "cgroups",
                "session_cgroups_unknown",
                reason=Reason.CGROUPS_UNKNOWN,
                action="the agent's own /proc/self/cgroup names no v1 memory or v2 path: run it as the chart does",
            )
        for key in list(self.state.objects) if keys is None else keys:
            obj = self.state.objects.get(key)
            if obj is None or objects.is_deleting(obj):
                continue
            current = (obj.get("status") or {}).get("sessions") or []
            mine = by_uid.get(obj["metadata"]["uid"], [])
            if not mine and not current:
                continue
            known = {e.get("podUID"): e for e in current}
            proc, root = Path("/proc"), Path(self.root.path)
            found = await asyncio.to_thread(sessions.entries, obj, mine, root, proc, now_utc(), known)
            if found == current:
                continue
            manager = AGENT_MANAGER + sessions.SESSIONS_MANAGER_SUFFIX
            updated = await asyncio.to_thread(self.kube.apply_status, obj, {"sessions": found}, manager)
            self.state.remember(updated)
            for entry in found:
                if known.get(entry["podUID"], {}).get("mount") != entry["mount"]:
                    level, reason = sessions.MOUNT_LOG[MountCheck(entry["mount"])]
                    logs.say(
                        log,
                        "session_mount_checked",
                        level=level,
                        reason=reason,
                        object="/".join(key),
                        pod=entry["pod"],
                        mount=entry["mount"],
                    )

    def _unverified(self, keys: list[Key]) -> list[Key]:
        """The keys whose sandbox the controller asked to verify a session Pod of, not yet settled."""
        out = []
        for key in keys:
            obj = self.state.objects.get(key)
            asked = objects.annotations_of(obj or {}).get(c.ANN_VERIFY_SESSION)
            if obj is None or not asked:
                continue
            settled = {
                e.get("podUID")
                for e in (obj.get("status") or {}).get("sessions") or []
                if e.get("mount") != MountCheck.UNKNOWN
            }
            if asked not in settled:
                out.append(key)
        return out
