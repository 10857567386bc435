"""`sandkeep controller`'s core: the watches feed the view and the work queues, and workers reconcile.

The controller lists and watches RetainedSandboxes itself, in pages and with bookmarks
(`listwatch.ListWatch`), and SandboxPolicies, Nodes and SandboxSessions through kopf (the watch stack
the agent uses too), persisting nothing on the objects. Every watch event updates an in-memory view
(`view.py`) and queues the object's key (`controller/api/workqueue.py`); a few workers reconcile keys
one at a time each (`reconciler.py`), and a key is queued again exactly when its reconcile says its
deadline passes, with the queue's `add_after`, as the TTL-after-finished controller's `AddAfter` does.
With nothing changing, nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

import kopf

from controller.api import listwatch
from controller.api.cache import vanished
from controller.api.kube import Kube, KubeError, now_utc, sandbox_path
from controller.api.workqueue import WorkQueue
from controller.cluster.decide import decide
from controller.cluster.events import Events
from controller.cluster.notices import Notices
from controller.cluster.policyset import in_force, write_statuses
from controller.cluster.quota_enforcer import QuotaEnforcer
from controller.cluster.reconciler import Reconciler, Result
from controller.cluster.sessions import COLLECT_ALL, Sessions
from controller.cluster.settings import ControllerSettings
from controller.cluster.view import Key, View
from controller.observe import logs
from controller.observe.metrics import ControllerMetrics
from controller.rules import contracts as c
from controller.rules.contracts import Phase
from controller.rules.objects import Obj, condition_of, is_deleting, key_of

log = logging.getLogger("sandkeep.controller")
Q = TypeVar("Q")  # what a work queue holds: a sandbox key, or a namespace


class Controller:
    """The view, the work queues (deadlines and retries included) and their workers, around the parts that
    decide: the reconciler, the quota enforcer and the sessions."""

    def __init__(self, kube: Kube, settings: ControllerSettings, metrics_: ControllerMetrics) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics_
        self.view = View()
        self.is_leader: Callable[[], bool] = lambda: True
        self.queue: WorkQueue[Key] = WorkQueue()
        self._phases: dict[Key, tuple[str, str, bool, bool]] = {}  # key -> (phase, node, pinned, past its hard end)
        self.events = Events(kube, metrics_)
        self.notices = Notices(metrics_, settings.warn_webhook_timeout.total_seconds())
        self.reconciler = Reconciler(
            kube,
            settings,
            metrics_,
            self.view,
            self.events,
            self.notices,
            remember=self.remember,
            enqueue=self.enqueue,
            is_leader=lambda: self.is_leader(),
        )
        self.quota = QuotaEnforcer(self.reconciler)
        session_settings = settings.session_settings()
        self.sessions = None
        if session_settings is not None:
            rec = self.reconciler
            self.sessions = Sessions(kube, session_settings, rec.expired, rec.max_pin, rec.past_max_age)
        self.queue.instrument(metrics_.queues, c.Queue.CONTROLLER)
        self.quota.queue.instrument(metrics_.queues, c.Queue.QUOTA)
        if self.sessions is not None:
            self.sessions.queue.instrument(metrics_.queues, c.Queue.SESSIONS)

    # --- feeding the view ----------------------------------------------------------------------------------
    def on_sandbox(self, event_type: str | None, obj: Obj) -> None:
        key = key_of(obj)
        if self.sessions is not None:
            self.sessions.on_sandbox(obj)
        if event_type != "DELETED" and self.view.holds(key, obj):
            return  # the echo of our own write, whose answer the view already has: nothing new to decide
        self.quota.check(key[0])
        if event_type == "DELETED":
            self.quota.forget(obj)
            self.view.drop(key)
            self.queue.drop(key)
            self._count(key, None)
            self._regroup(self.reconciler.groups.drop(key))
            return
        self.remember(obj)
        self._regroup(self.reconciler.groups.put(obj))
        self.schedule(key)
        self.enqueue(key)

    def _regroup(self, moved: list[Key]) -> None:
        """Sandboxes a history group's change may take across a limit: decided again (issue 28)."""
        for key in moved:
            self.schedule(key)
            self.enqueue(key)

    def on_listed(self, namespace: str | None, seen: set[Key]) -> None:
        """A listing (of `namespace`, or of all) is complete: what the view holds beyond it is gone."""
        keys = self.view.in_namespace(namespace) if namespace is not None else list(self.view.sandboxes)
        for key in vanished(keys, seen):
            if (obj := self.view.sandboxes.get(key)) is not None:
                self.on_sandbox("DELETED", obj)

    def remember(self, obj: Obj) -> None:
        """Keep the newest version seen (a watch event may arrive after our own write's answer)."""
        if self.view.remember(obj):
            self._count(key_of(obj), obj)

    def on_policy(self, event_type: str | None, obj: Obj) -> None:
        namespace, name = key_of(obj)
        policies = self.view.policies.setdefault(namespace, {})
        known = policies.get(name)
        if event_type == "DELETED":
            policies.pop(name, None)
        else:
            policies[name] = obj
            if known is not None and _same_spec(known, obj):
                return  # its status (ours) or metadata changed: no sandbox's decision can
        history, groups = self.reconciler.policy_for(namespace)[0].history, self.reconciler.groups
        if history is not None or namespace in groups.history:  # its history limits came, changed or went
            members = [self.view.sandboxes[k] for k in self.view.in_namespace(namespace) if k in self.view.sandboxes]
            groups.configure(namespace, history, members)
        for key in self.view.in_namespace(namespace):
            self.schedule(key)
            self.enqueue(key)
        self.quota.check(namespace)

    def on_node(self, event_type: str | None, obj: Obj) -> None:
        """A node came or went: its sandboxes decide again. Its other updates (status, every few seconds
        on a busy cluster) change no decision and touch nothing."""
        name = obj["metadata"]["name"]
        was = name in self.view.nodes
        if event_type == "DELETED":
            self.view.nodes.discard(name)
            self.view.node_gone_since[name] = now_utc()
        else:
            self.view.nodes.add(name)
            self.view.node_gone_since.pop(name, None)
        if was == (name in self.view.nodes):
            return
        for key in list(self.view.on_node.get(name, ())):
            self.schedule(key)
            self.enqueue(key)

    def _count(self, key: Key, obj: Obj | None) -> None:
        """Keep the by-phase-and-node gauge, the pins gauge and the past-its-hard-end gauge in step with the view,
        incrementally."""
        new = None
        if obj is not None:
            phase = (obj.get("status") or {}).get("phase") or "Unknown"
            # An open sandbox keeps its pin: the Pinned condition says so while the phase says Open.
            pinned = phase == Phase.PINNED or (
                phase == Phase.OPEN and (condition_of(obj, c.Condition.PINNED) or {}).get("status") == "True"
            )
            past = (condition_of(obj, c.Condition.EXPIRED) or {}).get("reason") == c.Reason.MAX_AGE
            new = (phase, (obj.get("spec") or {}).get("nodeName", ""), pinned, past)
        old = self._phases.get(key)
        if old == new:
            return
        if old is not None:
            self.metrics.sandboxes.labels(phase=old[0], node=old[1]).dec()
            if old[2]:
                self.metrics.pins_active.dec()
            if old[3]:
                self.metrics.past_max_age.labels(namespace=key[0]).dec()
        if new is None:
            self._phases.pop(key, None)
            return
        self._phases[key] = new
        self.metrics.sandboxes.labels(phase=new[0], node=new[1]).inc()
        if new[2]:
            self.metrics.pins_active.inc()
        if new[3]:
            self.metrics.past_max_age.labels(namespace=key[0]).inc()

    # --- the queue ----------------------------------------------------------------------------------------
    def enqueue(self, key: Key, priority: int = 1) -> None:
        """Queue a key once; a key being reconciled is queued again when its current pass ends.

        Keys whose deadline came (priority 0) go before watch-driven work (1): a policy change that
        rewrites ten thousand statuses must not make due deletions wait behind it.
        """
        self.queue.add(key, priority)

    def schedule(self, key: Key) -> None:
        """Queue the key at its next deadline straight from the view: pure, no API call.

        A policy change queues every sandbox of its namespace for a status rewrite; their new deadlines
        must not wait for that rewrite, or sandboxes at the back of the queue would expire late.
        """
        obj = self.view.sandboxes.get(key)
        if obj is None or is_deleting(obj):
            return
        now = now_utc()
        decision = decide(obj, self.reconciler.context(obj, now), now)
        if decision.delete:
            self.enqueue(key, priority=0)
        elif decision.wake_at is not None:
            _add_at(self.queue, key, decision.wake_at)

    def enqueue_all(self) -> None:
        for key in list(self.view.sandboxes):
            self.enqueue(key)

    # --- the workers ----------------------------------------------------------------------------------------
    async def worker(self) -> None:
        def failed(key: Key) -> dict[str, Any]:
            return {"object": f"{key[0]}/{key[1]}"}

        await self._serve(self.queue, self.reconciler.reconcile, c.Queue.CONTROLLER, "reconcile_failed", failed)

    async def quota_worker(self) -> None:
        def failed(namespace: str) -> dict[str, Any]:
            return {"reason": c.Reason.QUOTA_EXCEEDED, "namespace": namespace}

        await self._serve(self.quota.queue, self.quota.enforce, c.Queue.QUOTA, "quota_failed", failed)

    async def sessions_worker(self) -> None:
        assert self.sessions is not None
        await self._serve(
            self.sessions.queue, self.sessions.reconcile, c.Queue.SESSIONS, "session_failed", _session_fields
        )

    async def _serve(
        self,
        queue: WorkQueue[Q],
        handle: Callable[[Q], Awaitable[Result | None]],
        component: c.Queue,
        event: str,
        fields: Callable[[Q], dict[str, Any]],
    ) -> None:
        """One worker of `queue`: `handle` each item, and queue it again when its result asks; a failed one
        is retried with exponential backoff, the error counted (`component`) and logged (`event`, with
        `fields` of the item) once per attempt. Each reconcile is timed and counted by its result, as
        controller-runtime does (`controller_runtime_reconcile_*{controller=component}`)."""
        while True:
            item = await queue.get()
            started, outcome = time.monotonic(), c.ReconcileResult.SUCCESS
            try:
                result = await handle(item)
                if result is not None and result.requeue_at is not None:
                    _add_at(queue, item, result.requeue_at)
                    outcome = c.ReconcileResult.REQUEUE_AFTER
                queue.forget(item)
            except Exception as err:
                outcome = c.ReconcileResult.ERROR
                delay = queue.add_rate_limited(item)
                self.metrics.reconcile_errors.labels(component=component).inc()
                self.metrics.reconcile_errors_total.labels(component).inc()
                said = fields(item)
                logs.say(log, event, level=logging.WARNING, **said, error=str(err)[:300], retry_in=f"{delay:.1f}s")
            finally:
                self.metrics.reconcile_time.labels(component).observe(time.monotonic() - started)
                self.metrics.reconcile_total.labels(component, outcome).inc()
                queue.done(item)

    def idle(self) -> bool:
        """Nothing queued, being reconciled or being posted (for tests and the benchmark)."""
        events, notices = self.events, self.notices
        return not self.queue.busy() and not events.backlog and not events.folding() and not notices.backlog

    # --- the SandboxPolicies' status (the leader's) -------------------------------------------------------
    async def write_policy_statuses(self, namespace: str) -> None:
        """As leader: each SandboxPolicy of `namespace` says whether it applies (Active) or is Superseded.

        Only a change is written (policyset.write_statuses). A refusal is logged, never raised: the next
        event of a policy of the namespace, or the next leadership, writes again.
        """
        if not self.is_leader():
            return
        policies = dict(self.view.policies.get(namespace) or {})
        try:
            written = await asyncio.to_thread(write_statuses, self.kube, namespace, policies)
        except KubeError as err:
            logs.say(log, "policy_status_failed", level=logging.WARNING, namespace=namespace, error=str(err)[:300])
            return
        if written:
            logs.say(log, "policy_status", namespace=namespace, written=",".join(written), applies=in_force(policies))

    async def write_all_policy_statuses(self) -> None:
        for namespace in list(self.view.policies):
            await self.write_policy_statuses(namespace)


def _add_at(queue: WorkQueue[Q], item: Q, when: datetime) -> None:
    """Queue `item` again at `when` (the AddAfter of the TTL controller); the earliest request wins."""
    queue.add_after(item, (when - now_utc()).total_seconds(), priority=0)


def _same_spec(known: Obj, new: Obj) -> bool:
    """The same object at the same generation: only its status or metadata changed, never its spec."""
    a, b = known.get("metadata", {}), new.get("metadata", {})
    generation = a.get("generation")
    return a.get("uid") == b.get("uid") and generation is not None and generation == b.get("generation")


def _session_fields(key: Key) -> dict[str, Any]:
    return {"session": "(the leftover session Pods)" if key == COLLECT_ALL else f"{key[0]}/{key[1]}"}


# --- the watches -----------------------------------------------------------------------------------------
def sandbox_watches(ctl: Controller) -> list[listwatch.ListWatch]:
    """The RetainedSandboxes, listed and watched by the controller itself (`listwatch.ListWatch`): all of the
    cluster's, or one watch per namespace of `--watch-namespaces`."""
    scopes: list[str | None] = [*ctl.settings.watch_namespaces] or [None]
    return [
        listwatch.ListWatch(ctl.kube, sandbox_path(ns), ctl.on_sandbox, partial(ctl.on_listed, ns)) for ns in scopes
    ]


def build_registry(ctl: Controller) -> kopf.OperatorRegistry:
    """The controller's kopf watches (controller/api/listwatch.py): each event feeds the view and never writes to
    the watched objects, but for the leader's SandboxPolicy status (which policy of a namespace applies)."""

    async def policy_event(event_type: str | None, obj: Obj) -> None:
        ctl.on_policy(event_type, obj)
        await ctl.write_policy_statuses(key_of(obj)[0])

    async def node_event(event_type: str | None, obj: Obj) -> None:
        ctl.on_node(event_type, obj)

    watches: dict[tuple[str, ...], listwatch.Handler] = {
        (c.GROUP, c.VERSION, c.POLICY_PLURAL): policy_event,
        ("v1", "nodes"): node_event,
    }
    if ctl.sessions is not None:
        sessions = ctl.sessions

        async def session_event(event_type: str | None, obj: Obj) -> None:
            sessions.on_session(event_type, obj)

        watches[c.GROUP, c.VERSION, c.SESSION_PLURAL] = session_event
    return listwatch.registry(ctl.kube, watches)
