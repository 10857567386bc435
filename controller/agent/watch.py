"""The agent's watch: its node's RetainedSandboxes through kopf (`controller/watching.py`), the controller's
watch stack, with the API server filtering on `spec.nodeName=<node>` so other nodes' objects never arrive.

kopf says neither when its first listing is complete nor what vanished while a watch was down (a relist
after 410 Gone brings only what exists). So the cache starts from one LIST of our own (`seed`): the first
pass must not adopt, as new, directories whose objects simply have not arrived yet. kopf's own listing
then re-delivers the same objects (the cache keeps the newest resourceVersion). An object that vanished
unseen can only be one whose finalizer someone else removed; its next write answers 404 and the runtime
forgets it (`AgentState.forget`).
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from controller import contracts as c
from controller import logs, watching
from controller.contracts import Reason
from controller.kube import Kube, KubeError, Obj
from controller.watching import Handler

log = logging.getLogger("sandkeep.agent")


def registry(kube: Kube, on_event: Handler) -> kopf.OperatorRegistry:
    return watching.registry(kube, {(c.GROUP, c.VERSION, c.SANDBOX_PLURAL): on_event})


def settings(node: str) -> kopf.OperatorSettings:
    """Only this node's objects, and no CRD discovery: the agent's seed LIST has already found the CRD, and
    its RBAC does not include reading CRDs."""
    return watching.operator_settings(watching.sandbox_watch(node), discover=False)


async def seed(kube: Kube, node: str, stop: asyncio.Event) -> list[Obj] | None:
    """This node's objects, listed once before the watch starts; retried with backoff until it answers.

    None when stopped first. A refusal is said at once and then every time the wait doubles.
    """
    delay = 0.5
    while not stop.is_set():
        try:
            return await asyncio.to_thread(kube.list_sandboxes, node=node)
        except KubeError as err:
            logs.say(
                log,
                "list_failed",
                level=logging.WARNING,
                reason=Reason.AGENT_STALE,
                node=node,
                error=str(err)[:300],
                retry_in=f"{delay:.1f}s",
            )
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
        except TimeoutError:
            delay = min(delay * 2, 30.0)
    return None
