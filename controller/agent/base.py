"""What every part of the `Agent` class works on (`AgentBase`): its attributes, set once by `Agent.__init__`,
and the few steps the passes and the deletions all take (the Pods on this node, a key's
retry with backoff, many keys at a time, a failure said and retried).

The Agent is one object in parts, each a class of its own module by job: `runtime.py` (the watch, the
queue, the passes, one object), `deletion.py` (the shared deletion pipeline in the reap threads, in-use) and
`heartbeat.py` (the Lease, health).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from controller.agent.adoption import Adopter
from controller.agent.capture import Capture
from controller.agent.decide import Key
from controller.agent.quarantine import Quarantine
from controller.agent.relief import Relief
from controller.agent.report import Reporter
from controller.agent.settings import PARALLEL, AgentSettings
from controller.agent.sizer import Sizer
from controller.agent.state import AgentState
from controller.api import listwatch
from controller.api.kube import Kube, KubeError
from controller.api.workqueue import WorkQueue
from controller.node.capture import Volumes
from controller.node.reaper import Reaper
from controller.node.store import Root
from controller.observe import logs, metrics
from controller.rules.contracts import Reason
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.agent")


class AgentBase:
    """The Agent's attributes, for every part of it; `Agent.__init__` sets them all."""

    s: AgentSettings
    kube: Kube
    root: Root
    m: metrics.AgentMetrics
    state: AgentState
    queue: WorkQueue[Key]
    loop: asyncio.AbstractEventLoop | None
    # A delete's Deleting report, waiting (a timer) or under way (its apply), until its outcome is said.
    deleting: dict[Key, asyncio.TimerHandle | asyncio.Future[Any]]
    sizer: Sizer
    report: Reporter
    adopter: Adopter
    identity: str
    ignore: set[int]
    relief: Relief
    volumes: Volumes
    capture: Capture
    last_published: str | None
    watch: listwatch.ListWatch
    watching: asyncio.Task[None] | None
    stopping: asyncio.Event
    started: float
    last_pass: float | None
    reaper: Reaper
    quarantine: Quarantine
    reap_pool: ThreadPoolExecutor

    def _later(self, key: Key) -> float:
        """Process `key` again after its backoff (doubling while it stays held or failing; every pass
        processes it too); one pending retry per object, however often it is asked for."""
        return self.queue.add_rate_limited(key)

    async def _each(self, keys: list[Key], fn: Callable[[Key], Awaitable[None]], limit: int = PARALLEL) -> None:
        """Run `fn` for every key, at most `limit` at a time: API latency, not CPU, bounds a pass over
        thousands of objects. Keys are distinct, so no object is ever worked on twice at once. A stop
        request ends the pass early: every step is idempotent, so the next agent picks up the rest."""
        pending = iter(keys)

        async def worker() -> None:  # `limit` workers take the keys in turn: no task per key is ever made
            for key in pending:
                if self.stopping.is_set():
                    return
                await fn(key)

        await asyncio.gather(*(worker() for _ in range(min(limit, len(keys)))))

    async def _guarded(self, raising: bool, fn: Callable[[Any], Awaitable[None]], arg: Any) -> None:
        try:
            await fn(arg)
        except Exception as err:  # retried with backoff: a warning per attempt, further apart each time
            if raising:
                raise
            for key in arg if isinstance(arg, list) else [arg]:
                delay = self._later(key)
                logs.say(
                    log,
                    "process_failed",
                    level=logging.WARNING,
                    reason=Reason.AGENT_ERROR,
                    object="/".join(key),
                    error=repr(err)[:500],
                    retry_in=f"{delay:.1f}s",
                )

    def _pods(self) -> list[Obj] | None:
        """The Pods on this node. None: unlisted."""
        try:
            pods = self.kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={self.s.node}"})
        except KubeError as err:
            # Without the Pod list a mount cannot be ruled out: holds come from /proc alone this pass.
            self.report.say_limited("pods", "pods_unlisted", reason=Reason.IN_USE_UNKNOWN, error=str(err)[:200])
            return None
        items: list[Obj] = pods.get("items", [])
        return items

    @staticmethod
    def _pod_paths(pods: list[Obj] | None) -> list[tuple[str, Path]] | None:
        """hostPath volumes of these Pods (this node's): a Pod that mounts a sandbox uses it. None: unlisted."""
        if pods is None:
            return None
        out = []
        for pod in pods:
            meta = pod.get("metadata", {})
            for vol in (pod.get("spec") or {}).get("volumes") or []:
                hp = (vol.get("hostPath") or {}).get("path")
                if hp:
                    out.append((f"{meta.get('namespace')}/{meta.get('name')}", Path(hp)))
        return out
