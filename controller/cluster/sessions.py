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
Stuck or Lost, or has orphans that survived; when its image is not an allowed one; when its user, or its
namespace, already has as many live sessions as the chart allows; and every session, running or not, while
the admission guard is weakened (its binding gone, not denying, or its policy not failing closed). Ended
when its lifetime is over, its Pod ends, or the mount is not the sandbox's. A session's Pod has bounded
resources, tolerates only the taints of its node that the agent tolerates, and never runs as an id below
`min_owner_id` read from disk. The Pod is the sandbox's hold while it runs (the agent's existing Pod
check); a session never extends a sandbox past its own lifetime, which the chart caps. Nothing here
uses a finalizer: the Pod, Role and binding are named after the session's uid and torn down when the
session ends or is gone, found again by label after a restart.

`decide()` is the pure core; `Sessions` is the thin adapter (a queue of session keys, reads, writes).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import PurePosixPath
from urllib.parse import quote

from controller.api.kube import Kube, KubeError, now_utc
from controller.api.workqueue import WorkQueue
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules.contracts import MountCheck, Reason, SessionPhase
from controller.rules.durations import Invalid, format_duration, format_instant, instant_or_none, parse_duration
from controller.rules.objects import Obj, is_deleting, key_of

log = logging.getLogger("sandkeep.sessions")

Key = tuple[str, str]
DEFAULT_LIFETIME = "1h"
PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
SESSIONS_PATH = f"/apis/{c.GROUP}/{c.VERSION}"
POLL_STARTING = 1.0  # seconds between looks at a starting session's Pod
POLL_RUNNING = 10.0  # ... at a running one's (its end is noticed within this)
GUARD_TTL = 5.0  # seconds a sound admission guard is believed without a fresh GET; a weakened one never is
MAX_ID = 2**31 - 1  # the largest uid or gid a Pod's securityContext accepts
LIVE = (SessionPhase.PENDING, SessionPhase.RUNNING)  # the phases that hold one of the caps' places
_SETTLED = (SessionPhase.REFUSED, SessionPhase.ENDED)
# The session container's resources when the chart gives none (the chart's sessions.resources defaults).
DEFAULT_RESOURCES: Obj = {
    "requests": {"cpu": "50m", "memory": "64Mi", "ephemeral-storage": "64Mi"},
    "limits": {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "256Mi"},
}
COLLECT_ALL: Key = ("", "")  # the queue's item for "find the session Pods whose session went" (no real key)


@dataclass(frozen=True)
class SessionSettings:
    """Where sessions run and what bounds them (the chart's `sessions.*`)."""

    namespace: str  # the namespace session Pods run in
    root: PurePosixPath  # the nodes' sandbox root (the agent's --root)
    image: str  # the image when a session names none
    max_lifetime: timedelta = timedelta(hours=8)
    run_as_user: int = c.NOBODY  # when the workspace's owner is not known, or below min_owner_id
    admission_binding: str = ""  # the ValidatingAdmissionPolicyBinding proving spec.user: must deny
    admission_policy: str = ""  # the policy it must bind (empty: the binding's own name, as the chart names it)
    max_per_user: int = c.SESSIONS_MAX_PER_USER.default
    max_per_namespace: int = c.SESSIONS_MAX_PER_NAMESPACE.default
    min_owner_id: int = c.SESSIONS_MIN_OWNER_ID.default
    allowed_images: tuple[str, ...] = ()  # besides `image`, which is always allowed
    resources: Obj = field(default_factory=lambda: copy.deepcopy(DEFAULT_RESOURCES))
    tolerations: tuple[Obj, ...] = ()  # the agent's: a session tolerates its node's NoExecute taints among these

    @property
    def policy_name(self) -> str:
        return self.admission_policy or self.admission_binding

    def image_allowed(self, image: str) -> bool:
        return image == self.image or image in self.allowed_images


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


def guard_defect(binding: Obj | None, policy: Obj | None, settings: SessionSettings) -> str | None:
    """What weakens the admission guard that proves spec.user, or None when it holds.

    It holds only when the binding exists, binds the chart's policy, denies (`Deny` in validationActions:
    `Audit` or `Warn` alone let a session naming another user through), and the policy fails closed
    (`failurePolicy: Fail`) with the check of spec.user. Anything missing or unknown is a defect.
    """
    name, policy_name = settings.admission_binding, settings.policy_name
    if not name:
        return "no admission policy binding is configured (--sessions-admission-binding)"
    if binding is None:
        return f"the ValidatingAdmissionPolicyBinding {name} is not installed"
    spec = binding.get("spec") or {}
    if spec.get("policyName") != policy_name:
        return f"the ValidatingAdmissionPolicyBinding {name} binds {spec.get('policyName')!r}, not {policy_name}"
    actions = spec.get("validationActions") or []
    if "Deny" not in actions:
        return (
            f"the ValidatingAdmissionPolicyBinding {name} has validationActions {actions}, without Deny: a session "
            "naming another user would be let through"
        )
    if policy is None:
        return f"the ValidatingAdmissionPolicy {policy_name} is not installed"
    failure = (policy.get("spec") or {}).get("failurePolicy")
    if failure != "Fail":
        return f"the ValidatingAdmissionPolicy {policy_name} has failurePolicy {failure!r}, not Fail"
    checks = [v.get("expression") for v in (policy.get("spec") or {}).get("validations") or []]
    if c.SESSION_USER_CHECK not in checks:
        return f"the ValidatingAdmissionPolicy {policy_name} no longer checks `{c.SESSION_USER_CHECK}`"
    return None


def run_as(owner: Obj, settings: SessionSettings) -> tuple[int, int]:
    """The uid and gid a session runs as: the workspace owner's read from disk, each only where it is a
    person's (at least `min_owner_id`); otherwise `run_as_user`. Never 0 nor a system id from disk."""

    def person(value: object) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and settings.min_owner_id <= value <= MAX_ID:
            return value
        return settings.run_as_user

    return person(owner.get("uid")), person(owner.get("gid"))


def tolerates(toleration: Obj, taint: Obj) -> bool:
    """Kubernetes' own matching of one toleration against one taint (k8s.io/api/core/v1 ToleratesTaint)."""
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    exists = toleration.get("operator") == "Exists"
    if not toleration.get("key"):
        return exists  # an empty key with Exists matches every taint; with Equal, none
    if toleration.get("key") != taint.get("key"):
        return False
    return exists or (toleration.get("value") or "") == (taint.get("value") or "")


def session_tolerations(agent: Sequence[Obj], taints: Sequence[Obj]) -> list[Obj]:
    """Exactly the NoExecute taints of the sandbox's node that the agent tolerates, each tolerated by name.

    The Pod names its node, so no scheduler reads NoSchedule taints; the kubelet refuses, and the taint
    manager evicts, a Pod that does not tolerate a NoExecute one. The agent runs there, so its tolerations
    bound what a session may tolerate; a taint it does not tolerate is not tolerated here either.
    """
    out: list[Obj] = []
    for taint in taints:
        if taint.get("effect") != "NoExecute":
            continue
        match = next((t for t in agent if tolerates(t, taint)), None)
        if match is None:
            continue
        toleration: Obj = {"key": taint.get("key"), "operator": "Equal", "value": taint.get("value") or ""}
        toleration["effect"] = "NoExecute"
        if match.get("tolerationSeconds") is not None:
            toleration["tolerationSeconds"] = match["tolerationSeconds"]
        if toleration not in out:
            out.append(toleration)
    return out


def limit_refusal(session: Obj, live: Sequence[Obj], settings: SessionSettings) -> tuple[Reason, str] | None:
    """Why a new session would pass its user's or its namespace's cap, naming the live sessions that count
    and how to end one; None: within both. `live` holds the other sessions holding a place (Pending, Running)."""
    meta, user = session["metadata"], str((session.get("spec") or {}).get("user", ""))
    others = [s for s in live if s["metadata"].get("uid") != meta.get("uid")]
    mine = [s for s in others if str((s.get("spec") or {}).get("user", "")) == user]
    here = [s for s in others if s["metadata"].get("namespace") == meta["namespace"]]
    for counted, cap, bound, who in (
        (mine, settings.max_per_user, c.SESSIONS_MAX_PER_USER, f"user {user}"),
        (here, settings.max_per_namespace, c.SESSIONS_MAX_PER_NAMESPACE, f"namespace {meta['namespace']}"),
    ):
        if len(counted) < cap:
            continue
        names = sorted("/".join(key_of(s)) for s in counted)
        first_ns, _, first = names[0].partition("/") if names else ("", "", "")
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        end = f"`kubectl delete {c.SESSION_PLURAL} -n {first_ns} {first}`" if names else "none can be ended"
        return Reason.SESSION_LIMIT, (
            f"{who} already has {len(counted)} live session(s), the most sessions.{bound.value} allows ({cap}): "
            f"{shown or 'none'}. End one ({end}), then create this session again"
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
    guard: str | None,
    now: datetime,
    settings: SessionSettings,
    max_pin: timedelta | None = None,
    live: Sequence[Obj] = (),
    others: int = 0,
) -> Plan:
    """The session's next state from what was read. Pure: no I/O, no clock (`now` is a parameter).

    `guard` is what weakens the admission guard (`guard_defect`), None when it holds. `max_pin` is the
    namespace's: a session's Pod holds its sandbox no longer than a pin set when the session was created
    could keep it, so a lifetime longer than that is cut to it. `live` is the other sessions holding a
    place under the caps; only a session not yet started is counted against them. `others`: the other
    session Pods of the same sandbox, each holding one of the agent's verification slots.
    """
    meta, spec = session["metadata"], session.get("spec") or {}
    status = dict(session.get("status") or {})
    if status.get("phase") in _SETTLED:
        return Plan(status=status, teardown=True)
    namespace, name = meta["namespace"], str(spec.get("sandbox", ""))
    base: Obj = {"podNamespace": settings.namespace, "podName": object_name(session)}
    base["observedGeneration"] = meta.get("generation", 1)
    started = status.get("phase") == SessionPhase.RUNNING or pod is not None

    def stop(reason: Reason, message: str) -> Plan:
        phase = SessionPhase.ENDED if started else SessionPhase.REFUSED
        done = {**status, **base, "phase": phase, "reason": reason, "message": message, "endedAt": format_instant(now)}
        return Plan(status=done, teardown=True)

    if guard is not None:
        return stop(
            Reason.SESSIONS_UNGUARDED,
            f"sessions are off: {guard}, so who asked for a session is not proven. Ask the cluster's "
            "administrators to restore the chart's admission policy and binding (`helm upgrade` does)",
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
    image = str(spec.get("image") or settings.image)
    if not settings.image_allowed(image):
        allowed = ", ".join(dict.fromkeys((settings.image, *settings.allowed_images)))
        return stop(
            Reason.IMAGE_NOT_ALLOWED,
            f"image {image} is not one sessions may run (sessions.allowedImages: {allowed}); "
            "leave image unset for the default",
        )
    refusal = sandbox_refusal(sandbox, expired, namespace, name)
    # Once started, an expired sandbox is held by the session's Pod until the lifetime ends; one being
    # deleted, lost or gone ends it at once.
    if refusal is not None and (not started or refusal[0] is not Reason.EXPIRED):
        return stop(*refusal)
    if not started and status.get("phase") not in LIVE and (limit := limit_refusal(session, live, settings)):
        return stop(*limit)
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


def pod_body(
    session: Obj,
    sandbox: Obj,
    settings: SessionSettings,
    expires: datetime,
    now: datetime,
    taints: Sequence[Obj] = (),
) -> Obj:
    """The session's Pod: on the sandbox's node (`taints` are that node's), the workspace at /sandbox, never
    privileged, with bounded resources."""
    spec = session.get("spec") or {}
    namespace, name = key_of(sandbox)
    workspace = settings.root / namespace / name / c.WORKSPACE_DIR  # from our root, never from the object
    seconds = max(1, int((expires - now).total_seconds()))
    # As the workspace's owner (the agent reads it) where that is a person's id, never root nor a system id.
    uid, gid = run_as((sandbox.get("status") or {}).get("owner") or {}, settings)
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
            "tolerations": session_tolerations(settings.tolerations, taints),
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
                    "resources": copy.deepcopy(settings.resources),
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
_VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}"
_NODE = "/api/v1/nodes/{name}"


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
    _guard_seen: float = field(default=-GUARD_TTL, init=False)  # monotonic time the guard was last found sound

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
        guard = await asyncio.to_thread(self._guard)
        # Only a session not yet admitted is counted against the caps: read them fresh (one worker decides
        # sessions one at a time, and its own status writes are read back, so two never take one place).
        new = pod is None and (session.get("status") or {}).get("phase") not in (*LIVE, *_SETTLED)
        live = await asyncio.to_thread(self._live) if new and guard is None else []
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
            guard=guard,
            now=now,
            settings=self.settings,
            max_pin=max_pin,
            live=live,
            others=others,
        )
        if plan.create_pod and sandbox is not None:
            expires = instant_or_none(plan.status.get("expiresAt")) or now
            taints = await asyncio.to_thread(self._taints, sandbox["spec"]["nodeName"])
            body = pod_body(session, sandbox, self.settings, expires, now, taints)
            self.started.add(key)  # before the create: a crash in between is collected by `collect_all`
            await asyncio.to_thread(self._create, _PODS, body)
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
        """Every session of this install holding a place under the caps (Pending or Running), cluster-wide."""
        listed = self.kube.request("GET", session_path())
        return [
            s
            for s in listed.get("items", [])
            if (s.get("status") or {}).get("phase") in LIVE
            and (s.get("status") or {}).get("podNamespace") == self.settings.namespace
        ]

    def _taints(self, node: str) -> list[Obj]:
        """The node's taints; none when it is gone (the Pod then fails and the session ends)."""
        found = self._get(_NODE.format(name=quote(node)))
        return list(((found or {}).get("spec") or {}).get("taints") or [])

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
