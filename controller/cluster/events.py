"""The controller's Events, posted in the background: Events report decisions, they never delay them."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from controller.api.kube import Kube
from controller.cluster.settings import COMPONENT
from controller.observe import logs
from controller.observe.metrics import ControllerMetrics
from controller.rules import contracts as c
from controller.rules.contracts import Reason
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.controller")
EVENTS_BACKLOG = 1000  # Events waiting to be posted, at most (client-go's broadcaster queue holds as many)


class Events:
    """Posts Events off the loop, on a few threads of their own: under load they queue there, never in
    front of a DELETE."""

    def __init__(self, kube: Kube, metrics_: ControllerMetrics) -> None:
        self.kube = kube
        self.metrics = metrics_
        self.backlog: set[asyncio.Future[None]] = set()
        self._dropping: float | None = None  # since when Events are being dropped (the backlog is full)
        self._pool = ThreadPoolExecutor(4, "events")

    def post(self, obj: Obj, reason: Reason, message: str, type_: str) -> None:
        """Post an Event in the background.

        The backlog is bounded, as client-go's event broadcaster bounds its own: past EVENTS_BACKLOG
        unsent Events (a mass expiry on a slow API server) a new one is dropped and counted, so memory
        does not grow with the size of the wave.
        """
        if len(self.backlog) >= EVENTS_BACKLOG:
            self.metrics.events_dropped.inc()
            if self._dropping is None:
                self._dropping = time.monotonic()
                logs.say(log, "events_dropped", level=logging.WARNING, reason=reason, backlog=EVENTS_BACKLOG)
            return
        self._dropping = None
        # Only what involvedObject needs: a backlog of 10,000 Events must not hold 10,000 whole objects.
        meta = obj["metadata"]
        ref = {
            "apiVersion": obj.get("apiVersion", c.API_VERSION),
            "kind": obj.get("kind", c.SANDBOX_KIND),
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion")},
        }
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self.kube.post_event, ref, reason, message, type_, COMPONENT)
        self.backlog.add(future)
        future.add_done_callback(self.backlog.discard)
