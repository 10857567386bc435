"""SandboxSession: open a retained sandbox from the cluster (the reference system's opener).

A person creates a SandboxSession naming a RetainedSandbox of the same namespace, as themselves (the
admission policy proves spec.user is whoever created it). The controller runs a Pod in that same
namespace, pinned to the sandbox's node, mounting the sandbox at /sandbox through sandkeep's CSI driver:
the node plugin mounts the sandbox's own directory or refuses (another namespace's, expired, deleting,
stuck, lost, another node's), and holds the sandbox while mounted. The Pod is an ordinary tenant Pod: the
namespace's ResourceQuota, LimitRange, NetworkPolicies and Pod Security apply, and a Pod the API server
refuses ends the session Refused with its words (`PodRefused`). Exec is the user's own `pods/exec` there.

When a session is refused or ended is `session_decide.py`'s to say (the one expiry rule, the caps, the
images, the admission guard); what its Pod may do is `session_objects.py`'s (bounded resources, its
node's taints the agent tolerates, never an id below `min_owner_id` read from disk). A session never
extends a sandbox past its own lifetime, which the chart caps. Nothing here uses a finalizer: the Pod is
named after the session's uid and deleted when the session ends or is gone, found again by label after a
restart.

`Sessions` here is the thin adapter around them: a queue of session keys, the reads and the writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from urllib.parse import quote

from controller.api.kube import Kube, KubeError, now_utc, session_path
from controller.api.workqueue import WorkQueue
from controller.cluster.session_decide import (
    LIVE,
    SETTLED,
    SessionSettings,
    decide,
    guard_defect,
    object_name,
    pod_refused,
)
from controller.cluster.session_objects import pod_body
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules.contracts import Reason, SessionPhase
from controller.rules.durations import instant_or_none
from controller.rules.objects import Obj, key_of

log = logging.getLogger("sandkeep.sessions")

Key = tuple[str, str]
POLL_STARTING = 1.0  # seconds between looks at a starting session's Pod
POLL_RUNNING = 10.0  # ... at a running one's (its end is noticed within this)
GUARD_TTL = 5.0  # seconds a sound admission guard is believed without a fresh GET; a weakened one never is
COLLECT_ALL: Key = ("", "")  # the queue's item for "find the session Pods whose session went" (no real key)


_PODS = "/api/v1/namespaces/{ns}/pods"
_ALL_PODS = "/api/v1/pods"
# What the API server answers a Pod it will never admit as sent: 403 (ResourceQuota, LimitRange, Pod
# Security), 422 (invalid) and 400. Anything else (a 5xx, a timeout) is retried with the queue's backoff.
REFUSED_POD = frozenset({400, 403, 422})
_VAP_BINDING = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{name}"
_VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}"
_NODE = "/api/v1/nodes/{name}"


@dataclass
class Sessions:
    """The sessions' work queue and the reads and writes around `decide` (run by the leader only)."""

    kube: Kube
    settings: SessionSettings
    expired: Callable[[Obj, datetime], bool]  # the one rule, as the controller applies it to a sandbox
    max_pin: Callable[[str], timedelta]  # a namespace's maxPin (its policy under the ceiling)
    past_max_age: Callable[[Obj, datetime], bool] = lambda _o, _t: False  # past its hard end: its sessions end
    is_leader: Callable[[], bool] = lambda: True
    queue: WorkQueue[Key] = field(default_factory=WorkQueue)
    by_sandbox: dict[Key, set[Key]] = field(default_factory=dict)  # sandbox key -> sessions naming it
    gone: dict[Key, set[str]] = field(default_factory=dict)  # a deleted session's key -> its objects' names
    started: set[Key] = field(default_factory=set)  # sessions this process created a Pod for (status may lag)
    _guard_seen: float = field(default=-GUARD_TTL, init=False)  # monotonic time the guard was last found sound

    # --- events ---------------------------------------------------------------------------------------
    def on_session(self, event_type: str | None, obj: Obj) -> None:
        key = key_of(obj)
        sandbox = (key[0], str((obj.get("spec") or {}).get("sandbox", "")))
        if event_type == "DELETED":
            self.by_sandbox.get(sandbox, set()).discard(key)
            started_here = key in self.started
            self.started.discard(key)
            if not started_here and not (obj.get("status") or {}).get("podName"):
                return  # never given a Pod (refused before one): nothing to tear down
            if self.is_leader():  # torn down by the queue's worker, retried until done; a standby's next
                self.gone.setdefault(key, set()).add(object_name(obj))  # leadership collects them all
                self.queue.add(key)
            else:
                self.queue.drop(key)
            return
        self.by_sandbox.setdefault(sandbox, set()).add(key)
        self.queue.add(key)

    def on_sandbox(self, obj: Obj) -> None:
        for key in self.by_sandbox.get(key_of(obj), ()):
            self.queue.add(key)

    def collect_all(self) -> None:
        """On taking the lead: tear down the session Pods whose session went while no leader watched."""
        self.queue.add(COLLECT_ALL)

    async def _collect_all(self) -> None:
        query = {"labelSelector": f"{c.LABEL_SESSION_UID},{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"}
        listed = await asyncio.to_thread(self.kube.request, "GET", _ALL_PODS, query=query)
        for pod in listed.get("items", []):
            ref = (pod["metadata"].get("annotations") or {}).get(c.ANN_SESSION, "")
            namespace, _, name = ref.partition("/")
            await self._collect(pod, namespace, name)

    # --- work -----------------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> None:
        """Read the session, its sandbox and its Pod fresh; do what `decide` says (the leader only)."""
        if not self.is_leader():
            return
        if key == COLLECT_ALL:
            await self._collect_all()
            return
        names = self.gone.get(key, set())
        for gone in sorted(names):  # a failure raises: the worker retries what is left with backoff
            await self._teardown(key[0], gone, "/".join(key), Reason.POD_ENDED)
            names.discard(gone)
        if not names:
            self.gone.pop(key, None)
        session = await asyncio.to_thread(self._get, session_path(*key))
        if session is None:
            return
        spec = session.get("spec") or {}
        sandbox = await asyncio.to_thread(self.kube.get_sandbox, key[0], str(spec.get("sandbox", "")))
        name = object_name(session)
        pod = await asyncio.to_thread(self._get, f"{_PODS.format(ns=quote(key[0]))}/{name}")
        if pod is not None and pod["metadata"].get("labels", {}).get(c.LABEL_SESSION_UID) != session["metadata"]["uid"]:
            pod = None  # not ours (never: the name carries the uid); never adopted
        guard = await asyncio.to_thread(self._guard)
        # Only a session not yet admitted is counted against the caps: read them fresh (one worker decides
        # sessions one at a time, and its own status writes are read back, so two never take one place).
        new = pod is None and (session.get("status") or {}).get("phase") not in (*LIVE, *SETTLED)
        live = await asyncio.to_thread(self._live) if new and guard is None else []
        now = now_utc()
        expired = sandbox is not None and self.expired(sandbox, now)
        past_max_age = sandbox is not None and self.past_max_age(sandbox, now)
        max_pin = self.max_pin(key[0])
        plan = decide(
            session,
            sandbox,
            pod,
            expired=expired,
            past_max_age=past_max_age,
            guard=guard,
            now=now,
            settings=self.settings,
            max_pin=max_pin,
            live=live,
        )
        if plan.create_pod and sandbox is not None:
            expires = instant_or_none(plan.status.get("expiresAt")) or now
            taints = await asyncio.to_thread(self._taints, sandbox["spec"]["nodeName"])
            body = pod_body(session, sandbox, self.settings, expires, now, taints)
            self.started.add(key)  # before the create: a crash in between is collected by `collect_all`
            refused = await asyncio.to_thread(self._create_pod, key[0], body)
            if refused is not None:  # settled: never retried, the next pass only tears down
                plan = replace(plan, status=pod_refused(plan.status, refused, now), teardown=True, wake_at=None)
        if plan.teardown:
            await self._teardown(key[0], name, "/".join(key), plan.status.get("reason"))
        if plan.status != (session.get("status") or {}):
            await asyncio.to_thread(self._write_status, session, plan.status)
        # No Pod watch (it would need every Pod of the cluster): a starting session looks again soon, a
        # running one every POLL_RUNNING, and each at its lifetime's end.
        if plan.wake_at is not None:
            poll = POLL_STARTING if plan.status.get("phase") == SessionPhase.PENDING else POLL_RUNNING
            due = min(poll, (plan.wake_at - now_utc()).total_seconds() + 0.5)
            self.queue.add_after(key, max(0.0, due))

    def _get(self, path: str) -> Obj | None:
        try:
            found: Obj = self.kube.request("GET", path)
        except KubeError as err:
            if err.not_found:
                return None
            raise
        return found

    def _guard(self) -> str | None:
        """What weakens the admission guard proving spec.user (`guard_defect`), None when it holds; a read
        that fails is a defect too. Sound, it is believed for GUARD_TTL (a starting session is looked at
        every second); weakened or unknown, it is read again on the next look."""
        if not self.settings.admission_binding:
            return guard_defect(None, None, self.settings)
        if time.monotonic() - self._guard_seen < GUARD_TTL:
            return None
        try:
            binding = self._get(_VAP_BINDING.format(name=self.settings.admission_binding))
            policy = self._get(_VAP.format(name=self.settings.policy_name)) if binding is not None else None
        except KubeError as err:
            return f"the admission guard could not be read ({str(err)[:200]})"
        defect = guard_defect(binding, policy, self.settings)
        if defect is None:
            self._guard_seen = time.monotonic()
        return defect

    def _live(self) -> list[Obj]:
        """Every session holding a place under the caps (Pending or Running), cluster-wide."""
        listed = self.kube.request("GET", session_path())
        return [s for s in listed.get("items", []) if (s.get("status") or {}).get("phase") in LIVE]

    def _taints(self, node: str) -> list[Obj]:
        """The node's taints; none when it is gone (the Pod then fails and the session ends)."""
        found = self._get(_NODE.format(name=quote(node)))
        return list(((found or {}).get("spec") or {}).get("taints") or [])

    def _create_pod(self, namespace: str, body: Obj) -> str | None:
        """Create the session's Pod; the API server's words when it refuses it for good, None when made."""
        try:
            self.kube.request("POST", _PODS.format(ns=quote(namespace)), body=body)
        except KubeError as err:
            if err.status in REFUSED_POD:
                return err.message or f"{err.status}"
            if err.status != 409:  # AlreadyExists: an earlier pass made it
                raise
        return None

    def _write_status(self, session: Obj, status: Obj) -> None:
        meta = session["metadata"]
        body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
        try:
            self.kube.request(
                "PATCH",
                session_path(meta["namespace"], meta["name"], "status"),
                body=body,
                content_type="application/merge-patch+json",
            )
        except KubeError as err:
            if not (err.conflict or err.not_found):
                raise
            self.queue.add(key_of(session))  # changed meanwhile: decide again on the fresh object
            return
        phase = status.get("phase")
        if phase != (session.get("status") or {}).get("phase"):
            level = logging.WARNING if phase in (SessionPhase.REFUSED, SessionPhase.ENDED) else logging.INFO
            logs.say(
                log,
                f"session_{str(phase).lower()}",
                level=level,
                reason=status.get("reason"),
                session="/".join(key_of(session)),
                sandbox=(session.get("spec") or {}).get("sandbox"),
                user=(session.get("spec") or {}).get("user"),
                detail=status.get("message"),
            )

    async def _teardown(self, namespace: str, name: str, session: str, reason: object) -> None:
        """Delete the session's Pod; an absent one is already done."""
        path = f"{_PODS.format(ns=quote(namespace))}/{name}"
        try:
            await asyncio.to_thread(self.kube.request, "DELETE", path)
        except KubeError as err:
            if not err.not_found:
                raise
            return
        logs.say(log, "session_teardown", reason=reason, session=session, deleted=path)

    async def _collect(self, pod: Obj, namespace: str, name: str) -> None:
        """A session Pod whose session is gone (deleted while the controller was down) is torn down."""
        session = await asyncio.to_thread(self._get, session_path(namespace, name)) if namespace and name else None
        uid = (pod["metadata"].get("labels") or {}).get(c.LABEL_SESSION_UID)
        if session is None or session["metadata"].get("uid") != uid:
            pod_ns, pod_name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            await self._teardown(pod_ns, pod_name, f"{namespace}/{name}", Reason.POD_ENDED)
