"""SandboxSession: open a retained sandbox from the cluster (the reference system's opener).

A person creates a SandboxSession naming a RetainedSandbox of the same namespace. The controller runs a
Pod on the sandbox's node with the workspace mounted at /sandbox (hostPath `type: Directory`: never
created when missing), in the namespace the chart owns for sessions, where nobody else may create Pods.
The kubelet resolves a hostPath through links, so the Pod is trusted only once the node agent has read,
through the container's own processes, that its /sandbox is the sandbox's workspace by device and inode
(`status.sessions` of the sandbox, written by the agent alone). Only then are `pods/exec` and `pods/log`
on exactly that Pod granted to the session's user (a Role scoped by `resourceNames` and its binding),
whom the admission policy proved to be whoever created the session.

Refused, by the one expiry rule and the sandbox's state, when the sandbox is expired, being deleted,
Stuck or Lost, or has orphans that survived; ended when its lifetime is over, its Pod ends, or the
mount is not the sandbox's. The Pod is the sandbox's hold while it runs (the agent's existing Pod
check); a session never extends a sandbox past its own lifetime, which the chart caps. Nothing here
uses a finalizer: the Pod, Role and binding are named after the session's uid and torn down when the
session ends or is gone, found again by label after a restart.

`decide()` is the pure core; `Sessions` is the thin adapter (a queue of session keys, reads, writes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import PurePosixPath
from urllib.parse import quote

from controller import contracts as c
from controller import logs
from controller.contracts import MountCheck, Reason, SessionPhase
from controller.durations import Invalid, format_duration, format_instant, instant_or_none, parse_duration
from controller.kube import Kube, KubeError, Obj, is_deleting, key_of, now_utc
from controller.workqueue import WorkQueue

log = logging.getLogger("sandkeep.sessions")

Key = tuple[str, str]
DEFAULT_LIFETIME = "1h"
PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
SESSIONS_PATH = f"/apis/{c.GROUP}/{c.VERSION}"
POLL_STARTING = 1.0  # seconds between looks at a starting session's Pod
POLL_RUNNING = 10.0  # ... at a running one's (its end is noticed within this)
GUARD_TTL = 5.0  # seconds a found admission binding is believed without a fresh GET; a missing one never is
COLLECT_ALL: Key = ("", "")  # the queue's item for "find the session Pods whose session went" (no real key)


@dataclass(frozen=True)
class SessionSettings:
    """Where sessions run and what bounds them (the chart's `sessions.*`)."""

    namespace: str  # the namespace session Pods run in
    root: PurePosixPath  # the nodes' sandbox root (the agent's --root)
    image: str  # the image when a session names none
    max_lifetime: timedelta = timedelta(hours=8)
    run_as_user: int = 65534  # when the workspace's owner is not known (or is root)
    admission_binding: str = ""  # the ValidatingAdmissionPolicyBinding proving spec.user; must exist
    memory_limit: str = "256Mi"


@dataclass(frozen=True)
class Plan:
    """What one session needs now: its status, and which of the Pod, the grant and the tear-down to do."""

    status: Obj
    create_pod: bool = False
    grant: bool = False
    teardown: bool = False
    verify: str | None = None  # the Pod uid the agent is asked to verify
    wake_at: datetime | None = None


def object_name(session: Obj) -> str:
    """The Pod's, Role's and RoleBinding's name: the session's uid, unique and stable across restarts."""
    return f"session-{session['metadata']['uid']}"


def sandbox_refusal(sandbox: Obj | None, expired: bool, namespace: str, name: str) -> tuple[Reason, str] | None:
    """Why this sandbox cannot be opened now, by the one rule and its state; None: it can."""
    ref = f"RetainedSandbox {namespace}/{name}"
    if sandbox is None:
        return Reason.SANDBOX_NOT_FOUND, f"{ref} does not exist; `kubectl sandkeep ls -n {namespace}` lists them"
    if is_deleting(sandbox):
        return Reason.SANDBOX_DELETING, f"{ref} is being deleted; a deletion is final and it cannot be opened"
    status = sandbox.get("status") or {}
    phase = status.get("phase")
    if phase == c.Phase.LOST:
        return Reason.LOST, f"{ref} is Lost (its node or its directory is gone): there is nothing to open"
    if phase == c.Phase.STUCK:
        return Reason.TOMBSTONE_STUCK, f"{ref} is Stuck mid-deletion on its node; see `kubectl sandkeep doctor`"
    for cond in status.get("conditions") or []:
        if cond.get("type") == c.Condition.ORPHANS_SURVIVED and cond.get("status") == "True":
            return Reason.ORPHAN_SURVIVOR, f"{ref} has commands that survived their reaping: {cond.get('message')}"
    if expired:
        return Reason.EXPIRED, (
            f"{ref} is expired (deadline {status.get('deadline') or 'unknown'}); to look inside it, pin it first: "
            f"kubectl sandkeep pin {name} -n {namespace} --for 24h"
        )
    return None


def mount_check(sandbox: Obj | None, pod_uid: str) -> str | None:
    """What the node agent found this Pod mounted (`status.sessions` of the sandbox), None: not yet read."""
    for entry in ((sandbox or {}).get("status") or {}).get("sessions") or []:
        if entry.get("podUID") == pod_uid:
            mount: str | None = entry.get("mount")
            return mount
    return None


def _waiting(pod: Obj) -> Obj:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == c.SESSION_CONTAINER:
            return (status.get("state") or {}).get("waiting") or {}
    return {}


def _running(pod: Obj) -> bool:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == c.SESSION_CONTAINER:
            return "running" in (status.get("state") or {})
    return False


def decide(
    session: Obj,
    sandbox: Obj | None,
    pod: Obj | None,
    *,
    expired: bool,
    guarded: bool,
    now: datetime,
    settings: SessionSettings,
    max_pin: timedelta | None = None,
    others: int = 0,
) -> Plan:
    """The session's next state from what was read. Pure: no I/O, no clock (`now` is a parameter).

    `max_pin` is the namespace's: a session's Pod holds its sandbox no longer than a pin set when the
    session was created could keep it, so a lifetime longer than that is cut to it. `others`: the other
    session Pods of the same sandbox, each holding one of the agent's verification slots.
    """
    meta, spec = session["metadata"], session.get("spec") or {}
    status = dict(session.get("status") or {})
    if status.get("phase") in (SessionPhase.REFUSED, SessionPhase.ENDED):
        return Plan(status=status, teardown=True)
    namespace, name = meta["namespace"], str(spec.get("sandbox", ""))
    base: Obj = {"podNamespace": settings.namespace, "podName": object_name(session)}
    base["observedGeneration"] = meta.get("generation", 1)
    started = status.get("phase") == SessionPhase.RUNNING or pod is not None

    def stop(reason: Reason, message: str) -> Plan:
        phase = SessionPhase.ENDED if started else SessionPhase.REFUSED
        done = {**status, **base, "phase": phase, "reason": reason, "message": message, "endedAt": format_instant(now)}
        return Plan(status=done, teardown=True)

    if not guarded:
        return stop(
            Reason.SESSIONS_UNGUARDED,
            "sessions are off: the admission policy proving who asked for a session "
            f"({settings.admission_binding or 'none configured'}) is not installed; ask the cluster's administrators",
        )
    lifetime = parse_duration(spec.get("lifetime") or DEFAULT_LIFETIME)
    created = instant_or_none(meta.get("creationTimestamp"))
    if isinstance(lifetime, Invalid) or lifetime <= timedelta(0) or created is None:
        return stop(Reason.BAD_SESSION, f"lifetime {spec.get('lifetime')!r} is not a duration; use e.g. 90m or 2h")
    if lifetime > settings.max_lifetime:
        cap = format_duration(settings.max_lifetime)
        return stop(
            Reason.BAD_SESSION, f"lifetime {spec.get('lifetime')} is over the cap of {cap}: ask for {cap} or less"
        )
    if max_pin is not None and max_pin < lifetime:
        lifetime = max_pin  # held no longer than a pin set at its creation could keep the sandbox
    expires = created + lifetime
    base["expiresAt"] = format_instant(expires)
    if now >= expires:
        return stop(Reason.LIFETIME_ENDED, f"the session's lifetime ({format_duration(lifetime)}) is over")
    refusal = sandbox_refusal(sandbox, expired, namespace, name)
    # Once started, an expired sandbox is held by the session's Pod until the lifetime ends; one being
    # deleted, lost or gone ends it at once.
    if refusal is not None and (not started or refusal[0] is not Reason.EXPIRED):
        return stop(*refusal)
    assert sandbox is not None
    node = sandbox["spec"]["nodeName"]
    base["nodeName"] = node
    pending = {**status, **base, "phase": SessionPhase.PENDING, "reason": Reason.SESSION_STARTING}
    if pod is None:
        if status.get("phase") == SessionPhase.RUNNING:
            return stop(Reason.POD_ENDED, f"its Pod {settings.namespace}/{base['podName']} is gone")
        if others >= c.SESSION_VERIFY_SLOTS:  # its Pod would never be verified: refused, never left waiting
            return stop(
                Reason.VERIFY_LIMIT,
                f"{others} other sessions of {namespace}/{name} are being verified or run on node {node} (at most "
                f"{c.SESSION_VERIFY_SLOTS}); end one and ask again",
            )
        message = f"starting Pod {settings.namespace}/{base['podName']} on node {node}"
        return Plan(status={**pending, "message": message}, create_pod=True, wake_at=expires)
    pod_phase = (pod.get("status") or {}).get("phase")
    if is_deleting(pod) or pod_phase in ("Succeeded", "Failed"):
        return stop(Reason.POD_ENDED, f"its Pod {settings.namespace}/{base['podName']} ended ({pod_phase})")
    waiting = _waiting(pod)
    if waiting.get("reason") in PULL_FAILURES:
        image = spec.get("image") or settings.image
        detail = str(waiting.get("message") or waiting.get("reason"))[:500]
        return stop(
            Reason.IMAGE_PULL_FAILED,
            f"image {image} cannot be pulled on node {node} ({detail}); check its name, or leave image unset "
            "for the default",
        )
    if pod_phase != "Running" or not _running(pod):
        why = f" ({waiting['reason']})" if waiting.get("reason") else ""
        return Plan(status={**pending, "message": f"waiting for its Pod to start on node {node}{why}"}, wake_at=expires)
    pod_uid = pod["metadata"]["uid"]
    mount = mount_check(sandbox, pod_uid)
    if mount == MountCheck.MISMATCH:
        return stop(
            Reason.MOUNT_MISMATCH,
            f"the directory its Pod mounted on node {node} is not the sandbox's workspace (it was replaced or "
            "swept meanwhile); nothing was granted",
        )
    if mount != MountCheck.VERIFIED:
        message = f"its Pod runs; waiting for the node agent on {node} to verify it mounted the sandbox's workspace"
        return Plan(status={**pending, "message": message}, verify=pod_uid, wake_at=expires)
    running = {
        **status,
        **base,
        "phase": SessionPhase.RUNNING,
        "reason": Reason.SESSION_RUNNING,
        "message": f"kubectl exec -it -n {settings.namespace} {base['podName']} -c {c.SESSION_CONTAINER} -- sh",
        "startedAt": status.get("startedAt") or format_instant(now),
    }
    return Plan(status=running, grant=True, wake_at=expires)


# --- the objects it makes ---------------------------------------------------------------------------------
def _labels(session: Obj, sandbox_uid: str) -> dict[str, str]:
    return {
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_SESSION_UID: session["metadata"]["uid"],
        c.LABEL_SANDBOX_UID: sandbox_uid,
    }


def _annotations(session: Obj) -> dict[str, str]:
    return {c.ANN_SESSION: "/".join(key_of(session))}


def pod_body(session: Obj, sandbox: Obj, settings: SessionSettings, expires: datetime, now: datetime) -> Obj:
    """The session's Pod: on the sandbox's node, the workspace at /sandbox, never privileged."""
    spec = session.get("spec") or {}
    namespace, name = key_of(sandbox)
    workspace = settings.root / namespace / name / c.WORKSPACE_DIR  # from our root, never from the object
    seconds = max(1, int((expires - now).total_seconds()))
    # As the workspace's owner (the agent reads it) where that is a person's uid, never root.
    owner = (sandbox.get("status") or {}).get("owner") or {}
    known = isinstance(owner.get("uid"), int) and owner["uid"] > 0 and isinstance(owner.get("gid"), int)
    uid, gid = (owner["uid"], owner["gid"]) if known else (settings.run_as_user, settings.run_as_user)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": object_name(session),
            "namespace": settings.namespace,
            "labels": _labels(session, sandbox["metadata"]["uid"]),
            "annotations": {**_annotations(session), c.ANN_SANDBOX: f"{namespace}/{name}"},
        },
        "spec": {
            "nodeName": sandbox["spec"]["nodeName"],
            "restartPolicy": "Never",
            "activeDeadlineSeconds": seconds,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 5,
            "tolerations": [{"operator": "Exists"}],
            "securityContext": {
                "runAsUser": uid,
                "runAsGroup": gid,
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": c.SESSION_CONTAINER,
                    "image": spec.get("image") or settings.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", str(seconds)],
                    "workingDir": c.SESSION_MOUNT,
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": {
                        "requests": {"cpu": "10m", "memory": "32Mi"},
                        "limits": {"memory": settings.memory_limit},
                    },
                    "volumeMounts": [
                        {"name": "workspace", "mountPath": c.SESSION_MOUNT, "readOnly": not spec.get("readWrite")},
                        {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 (an emptyDir of its own)
                    ],
                }
            ],
            "volumes": [
                {"name": "workspace", "hostPath": {"path": str(workspace), "type": "Directory"}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
            ],
        },
    }


def role_body(session: Obj, settings: SessionSettings) -> Obj:
    """Exec and logs on exactly the session's Pod, nothing else in the namespace."""
    pod = [object_name(session)]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {
            "name": object_name(session),
            "namespace": settings.namespace,
            "labels": _labels(session, ""),
            "annotations": _annotations(session),
        },
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": pod, "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["pods/exec"], "resourceNames": pod, "verbs": ["create", "get"]},
            {"apiGroups": [""], "resources": ["pods/log"], "resourceNames": pod, "verbs": ["get"]},
        ],
    }


def binding_body(session: Obj, settings: SessionSettings) -> Obj:
    user = str((session.get("spec") or {}).get("user"))
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": object_name(session),
            "namespace": settings.namespace,
            "labels": _labels(session, ""),
            "annotations": _annotations(session),
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": object_name(session)},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }


# --- the adapter ------------------------------------------------------------------------------------------
def session_path(namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
    """The API path of SandboxSessions (all, one namespace's, one, or one's subresource)."""
    path = (
        f"{SESSIONS_PATH}/namespaces/{quote(namespace)}/{c.SESSION_PLURAL}"
        if namespace
        else f"{SESSIONS_PATH}/{c.SESSION_PLURAL}"
    )
    if name:
        path += f"/{quote(name)}"
    return f"{path}/{subresource}" if subresource else path


_PODS = "/api/v1/namespaces/{ns}/pods"
_ROLES = "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles"
_BINDINGS = "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"
_VAP_BINDING = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{name}"


@dataclass
class Sessions:
    """The sessions' work queue and the reads and writes around `decide` (run by the leader only)."""

    kube: Kube
    settings: SessionSettings
    expired: Callable[[Obj, datetime], bool]  # the one rule, as the controller applies it to a sandbox
    max_pin: Callable[[str], timedelta]  # a namespace's maxPin (its policy under the ceiling)
    is_leader: Callable[[], bool] = lambda: True
    queue: WorkQueue[Key] = field(default_factory=WorkQueue)
    by_sandbox: dict[Key, set[Key]] = field(default_factory=dict)  # sandbox key -> sessions naming it
    gone: dict[Key, set[str]] = field(default_factory=dict)  # a deleted session's key -> its objects' names
    started: set[Key] = field(default_factory=set)  # sessions this process created a Pod for (status may lag)
    _guard_seen: float = field(default=-GUARD_TTL, init=False)  # monotonic time the binding was last found

    # --- events ---------------------------------------------------------------------------------------
    def on_session(self, event_type: str | None, obj: Obj) -> None:
        key = key_of(obj)
        sandbox = (key[0], str((obj.get("spec") or {}).get("sandbox", "")))
        if event_type == "DELETED":
            self.by_sandbox.get(sandbox, set()).discard(key)
            started_here = key in self.started
            self.started.discard(key)
            if not started_here and (obj.get("status") or {}).get("podNamespace") != self.settings.namespace:
                return  # not started by this install (another's, or refused before a Pod): nothing of ours
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
        collection = _PODS.format(ns=self.settings.namespace)
        query = {"labelSelector": f"{c.LABEL_SESSION_UID}"}
        listed = await asyncio.to_thread(self.kube.request, "GET", collection, query=query)
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
            await self._teardown(gone, "/".join(key), Reason.POD_ENDED)
            names.discard(gone)
        if not names:
            self.gone.pop(key, None)
        session = await asyncio.to_thread(self._get, session_path(*key))
        if session is None:
            return
        spec = session.get("spec") or {}
        sandbox = await asyncio.to_thread(self.kube.get_sandbox, key[0], str(spec.get("sandbox", "")))
        name = object_name(session)
        pod = await asyncio.to_thread(self._get, f"{_PODS.format(ns=self.settings.namespace)}/{name}")
        if pod is not None and pod["metadata"].get("labels", {}).get(c.LABEL_SESSION_UID) != session["metadata"]["uid"]:
            pod = None  # not ours (never: the name carries the uid); never adopted
        guarded = await asyncio.to_thread(self._guarded)
        now = now_utc()
        expired = sandbox is not None and self.expired(sandbox, now)
        max_pin = self.max_pin(key[0])
        others = 0
        if (
            pod is None
            and sandbox is not None
            and (session.get("status") or {}).get("phase") in (None, SessionPhase.PENDING)
        ):
            others = await asyncio.to_thread(self._others, sandbox, session)
        plan = decide(
            session,
            sandbox,
            pod,
            expired=expired,
            guarded=guarded,
            now=now,
            settings=self.settings,
            max_pin=max_pin,
            others=others,
        )
        if plan.create_pod and sandbox is not None:
            expires = instant_or_none(plan.status.get("expiresAt")) or now
            self.started.add(key)  # before the create: a crash in between is collected by `collect_all`
            await asyncio.to_thread(self._create, _PODS, pod_body(session, sandbox, self.settings, expires, now))
        if plan.verify is not None and sandbox is not None:
            await asyncio.to_thread(self._ask_verify, sandbox, plan.verify)
        if plan.grant:
            await asyncio.to_thread(self._create, _ROLES, role_body(session, self.settings))
            await asyncio.to_thread(self._create, _BINDINGS, binding_body(session, self.settings))
        if plan.teardown:
            await self._teardown(name, "/".join(key), plan.status.get("reason"))
        if plan.status != (session.get("status") or {}):
            await asyncio.to_thread(self._write_status, session, plan.status)
        # No Pod watch (it would need every Pod of the cluster): a starting session looks again soon, a
        # running one every POLL_RUNNING, and each at its lifetime's end.
        if plan.wake_at is not None:
            poll = POLL_STARTING if plan.status.get("phase") == SessionPhase.PENDING else POLL_RUNNING
            due = min(poll, (plan.wake_at - now_utc()).total_seconds() + 0.5)
            self.queue.add_after(key, max(0.0, due))

    def _ask_verify(self, sandbox: Obj, pod_uid: str) -> None:
        """Wake the node agent for this Pod (a watch event on the sandbox); it also looks on every pass."""
        if (sandbox["metadata"].get("annotations") or {}).get(c.ANN_VERIFY_SESSION) == pod_uid:
            return
        try:
            self.kube.patch_annotations(sandbox, {c.ANN_VERIFY_SESSION: pod_uid})
        except KubeError as err:
            if not (err.conflict or err.not_found):  # changed meanwhile: the next look asks again
                raise

    def _others(self, sandbox: Obj, session: Obj) -> int:
        """The other sessions' Pods of this sandbox (the ones the agent reads, deleting or not)."""
        query = {"labelSelector": f"{c.LABEL_SANDBOX_UID}={sandbox['metadata']['uid']}"}
        listed = self.kube.request("GET", _PODS.format(ns=self.settings.namespace), query=query)
        mine = session["metadata"]["uid"]
        return sum(
            1 for p in listed.get("items", []) if p["metadata"].get("labels", {}).get(c.LABEL_SESSION_UID) != mine
        )

    def _get(self, path: str) -> Obj | None:
        try:
            found: Obj = self.kube.request("GET", path)
        except KubeError as err:
            if err.not_found:
                return None
            raise
        return found

    def _guarded(self) -> bool:
        """The admission policy proving spec.user is bound; unknown (an error) is not guarded.

        Found, it is believed for GUARD_TTL (a starting session is looked at every second); not found or
        unknown, it is asked again on the next look.
        """
        if not self.settings.admission_binding:
            return False
        if time.monotonic() - self._guard_seen < GUARD_TTL:
            return True
        try:
            found = self._get(_VAP_BINDING.format(name=self.settings.admission_binding)) is not None
        except KubeError:
            return False
        if found:
            self._guard_seen = time.monotonic()
        return found

    def _create(self, collection: str, body: Obj) -> None:
        try:
            self.kube.request("POST", collection.format(ns=self.settings.namespace), body=body)
        except KubeError as err:
            if err.status != 409:  # AlreadyExists: an earlier pass made it
                raise

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

    async def _teardown(self, name: str, session: str, reason: object) -> None:
        """Take the grant away first, then the Pod; each absent one is already done."""
        for collection in (_BINDINGS, _ROLES, _PODS):
            path = f"{collection.format(ns=self.settings.namespace)}/{name}"
            try:
                await asyncio.to_thread(self.kube.request, "DELETE", path)
            except KubeError as err:
                if not err.not_found:
                    raise
                continue
            logs.say(log, "session_teardown", reason=reason, session=session, deleted=path)

    async def _collect(self, pod: Obj, namespace: str, name: str) -> None:
        """A session Pod whose session is gone (deleted while the controller was down) is torn down."""
        session = await asyncio.to_thread(self._get, session_path(namespace, name)) if namespace and name else None
        uid = (pod["metadata"].get("labels") or {}).get(c.LABEL_SESSION_UID)
        if session is None or session["metadata"].get("uid") != uid:
            await self._teardown(pod["metadata"]["name"], f"{namespace}/{name}", Reason.POD_ENDED)
