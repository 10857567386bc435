"""LIST then WATCH this node's RetainedSandboxes, in one thread, with the server-side field selector.

The controller watches through kopf; the agent still has this one small informer of its own. kopf 1.45
can send the same server-side field selector (`settings.watching.field_selectors`), so the agent could run
on kopf's watch too and the two components would share one watch stack; that move is not done yet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from controller import contracts as c
from controller import kube, logs
from controller.contracts import Reason
from controller.kube import Kube

log = logging.getLogger("sandkeep.agent")


class Watcher(threading.Thread):
    """LIST then WATCH this node's RetainedSandboxes, resuming from the last resourceVersion; a 410 re-lists.

    Every event lands on the loop as ("reset", items) or (type, object); the agent's cache is the
    result. The field selector is applied by the API server, so other nodes' objects never arrive.
    """

    def __init__(
        self, client: Kube, node: str, deliver: Callable[[str, Any], None], resource_version: str | None = None
    ) -> None:
        super().__init__(name="watch", daemon=True)
        self.client = client
        self.node = node
        self.deliver = deliver
        self.resource_version = resource_version  # where to resume; None lists first
        self.stopping = threading.Event()

    def run(self) -> None:
        from kubernetes import client as k8s
        from kubernetes import watch

        api = k8s.CustomObjectsApi(self.client.api)
        selector = f"spec.nodeName={self.node}"
        rv = self.resource_version
        failures = 0
        while not self.stopping.is_set():
            try:
                if rv is None:
                    listed = self.client.request(
                        "GET", kube.sandbox_path(), query={"fieldSelector": selector}, timeout=60
                    )
                    rv = listed["metadata"]["resourceVersion"]
                    self.deliver("reset", listed.get("items", []))
                w = watch.Watch()  # type: ignore[no-untyped-call]
                for event in w.stream(  # type: ignore[no-untyped-call]
                    api.list_cluster_custom_object,
                    c.GROUP,
                    c.VERSION,
                    c.SANDBOX_PLURAL,
                    field_selector=selector,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=60,
                ):
                    if self.stopping.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
                        break
                    obj = event["object"]
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.deliver(event["type"], obj)
                failures = 0
            except Exception as err:
                status = getattr(err, "status", None)
                if status == 410:
                    logs.say(log, "watch_expired", reason=Reason.AGENT_STALE, resource_version=rv, action="re-listing")
                    rv = None  # too old (etcd compacted it): list again
                    continue
                # A watch the server or a proxy closed is routine: resume quietly; say it when it keeps failing.
                failures += 1
                level = logging.WARNING if failures > 1 else logging.DEBUG
                logs.say(log, "watch_failed", level=level, reason=Reason.AGENT_STALE, error=str(err)[:300])
                if status in (401, 403):
                    rv = None
                self.stopping.wait(min(2.0 * failures, 30.0) if failures > 1 else 0.2)
