"""The Agent's heartbeat: its node's Lease renewed while passes keep completing (`healthy`, also /healthz),
with what `doctor` reads on it (stuck tombstones no object owns, pressure nothing relieves, quarantine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from controller.agent.base import AgentBase
from controller.agent.report import orphan_report
from controller.agent.settings import HEARTBEAT_EVERY
from controller.api import leases
from controller.api.kube import KubeError
from controller.rules import contracts as c
from controller.rules.contracts import Reason


class Heartbeat(AgentBase):
    """Health, and the heartbeat Lease."""

    def healthy(self) -> bool:
        """Live while passes keep completing: a wedged loop (or a pass stuck on a hung mount) fails /healthz."""
        budget = max(3 * self.s.scan_interval.total_seconds(), 300.0)
        last = self.last_pass if self.last_pass is not None else self.started
        watching_ok = self.watching is None or not self.watching.done()  # a dead watch leaves the cache stale
        return watching_ok and time.monotonic() - last < budget

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        """Renew the heartbeat Lease every HEARTBEAT_EVERY while passes keep completing (`healthy`).

        Apart from the passes, so a long first pass (adopting a full root) does not look like a dead
        agent; tied to `healthy`, so a wedged agent does stop reporting.
        """
        while not stop.is_set():
            if self.healthy():
                await self._heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=HEARTBEAT_EVERY)

    async def _heartbeat(self) -> None:
        """Renew this node's Lease; publish, for `doctor`, the stuck tombstones no object owns, the disk
        pressure nothing can relieve and the quarantined entries, when they change."""
        try:
            await asyncio.to_thread(
                leases.renew_heartbeat, self.kube, self.s.lease_namespace, self.s.node, self.identity
            )
            said = {
                c.ANN_ORPHAN_TOMBSTONES: json.dumps(orphan_report(self.reaper), sort_keys=True),
                c.ANN_PRESSURE: self.relief.published,
                c.ANN_QUARANTINE: self.quarantine.published,
            }
            report = json.dumps(said, sort_keys=True)
            if report != self.last_published:
                patch = {"metadata": {"annotations": said}}
                await asyncio.to_thread(
                    self.kube.request,
                    "PATCH",
                    leases.lease_path(self.s.lease_namespace, leases.heartbeat_name(self.s.node)),
                    body=patch,
                    content_type="application/merge-patch+json",
                )
                self.last_published = report
            self.m.heartbeat.labels(self.s.node).set(time.time())
        except KubeError as err:
            self.report.say_limited("heartbeat", "heartbeat_failed", reason=Reason.AGENT_STALE, error=str(err)[:300])
