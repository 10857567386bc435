"""Sandboxes whose node is gone: the controller confirms the node is gone, then drops the disk finalizer.

A sandbox being deleted waits on its node's agent to remove `sandkeep.io/disk` after deleting the
directory. When the node itself is gone past `--node-grace`, no agent ever will, and the directory
went with the node's disk: the controller removes the finalizer, so the object never hangs in
Terminating. A Node is declared gone only after a fresh read finds it absent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from controller.api.kube import Kube, KubeError
from controller.cluster.decide import Context, instant_words
from controller.cluster.events import Events
from controller.cluster.view import Key, View
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules.contracts import Reason
from controller.rules.objects import Obj, key_of

log = logging.getLogger("sandkeep.controller")


class LostNodes:
    def __init__(
        self,
        kube: Kube,
        view: View,
        events: Events,
        context: Callable[[Obj, datetime], Context],
        enqueue: Callable[[Key], None],
    ) -> None:
        self.kube = kube
        self.view = view
        self.events = events
        self.context = context
        self.enqueue = enqueue

    async def still_there(self, node: str) -> bool:
        """A fresh read of a Node the view has as gone; one that exists is back in the view."""
        exists = await self._node_exists(node)
        if exists:
            self.view.nodes.add(node)
            self.view.node_gone_since.pop(node, None)
        return exists

    async def release(self, obj: Obj, now: datetime) -> datetime | None:
        """A deleting sandbox whose node is gone past the grace: drop the disk finalizer (nobody else can).

        Returns when to look again: the end of the grace of a node gone for less.
        """
        if c.FINALIZER not in (obj["metadata"].get("finalizers") or []):
            return None
        ctx = self.context(obj, now)
        if ctx.node_gone_since is None:
            return None
        lost_at = ctx.node_gone_since + ctx.node_grace
        if lost_at > now:
            return lost_at
        node = obj["spec"]["nodeName"]
        if await self.still_there(node):
            return None
        try:
            released = await asyncio.to_thread(self.kube.remove_finalizer, obj, c.FINALIZER)
        except KubeError as err:
            if err.not_found:
                return None
            if err.conflict:
                self.enqueue(key_of(obj))
                return None
            raise
        message = (
            f"{'/'.join(key_of(obj))}: node {node} is gone since {instant_words(ctx.node_gone_since)}; its disk "
            f"went with it, so finalizer {c.FINALIZER} was removed by the controller"
        )
        self.events.post(released, Reason.FINALIZER_REMOVED, message, "Warning")
        logs.say(log, "finalizer_removed", reason=Reason.LOST, object="/".join(key_of(obj)), node=node)
        return None

    async def _node_exists(self, node: str) -> bool:
        """A fresh read of the Node; a controller not allowed to read Nodes never declares one gone."""
        try:
            return await asyncio.to_thread(self.kube.get_node, node) is not None
        except KubeError as err:
            if err.status in (401, 403):
                logs.say(
                    log,
                    "node_unreadable",
                    level=logging.WARNING,
                    reason=Reason.NODE_GONE,
                    node=node,
                    error=err.message[:200],
                    hint="grant get/list/watch on nodes",
                )
                return True
            raise
