"""A SandboxSession's decision, pure: what one session needs now (`decide` -> `Plan`).

Refused, by the one expiry rule and the sandbox's state (`sandbox_refusal`), when the sandbox is expired,
being deleted, Stuck or Lost, or has orphans that survived; when its image is not an allowed one; when its
user, or its namespace, already has as many live sessions as the chart allows (`limit_refusal`); and every
session, running or not, while the admission guard is weakened (`guard_defect`: its binding gone, not
denying, or its policy not failing closed); and when the API server refuses its Pod (`pod_refused`: the
namespace's quota, LimitRange or Pod Security). Running once its Pod runs with its container ready (the
CSI plugin mounted the sandbox's own directory, or the Pod never starts). Ended when its lifetime is over
or its Pod ends. No I/O, no clock: `now` is a parameter. What a session is, and the adapter that reads
and writes around this: sessions.py.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from controller.rules import contracts as c
from controller.rules.contracts import Reason, SessionPhase
from controller.rules.durations import Invalid, format_duration, format_instant, instant_or_none, parse_duration
from controller.rules.objects import Obj, is_deleting, key_of
from controller.rules.reopen import sandbox_refusal

DEFAULT_LIFETIME = "1h"
PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
MAX_ID = 2**31 - 1  # the largest uid or gid a Pod's securityContext accepts
LIVE = (SessionPhase.PENDING, SessionPhase.RUNNING)  # the phases that hold one of the caps' places
SETTLED = (SessionPhase.REFUSED, SessionPhase.ENDED)
# The session container's resources when the chart gives none (the chart's sessions.resources defaults).
DEFAULT_RESOURCES: Obj = {
    "requests": {"cpu": "50m", "memory": "64Mi", "ephemeral-storage": "64Mi"},
    "limits": {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "256Mi"},
}


@dataclass(frozen=True)
class SessionSettings:
    """What bounds sessions (the chart's `sessions.*`); their Pods run in their sandbox's namespace."""

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
    """What one session needs now: its status, and whether to create its Pod or tear it down."""

    status: Obj
    create_pod: bool = False
    teardown: bool = False
    wake_at: datetime | None = None


def job_container(sandbox: Obj | None) -> Obj | None:
    """The container that mounted the workspace when it was kept (the first, as `spec.origin` recorded it):
    what a session with `asJob` runs as. None: not recorded (kept by `sandkeep retain`, or mounted by subPath)."""
    origin = ((sandbox or {}).get("spec") or {}).get("origin") or {}
    return next((cn for cn in origin.get("containers") or [] if cn.get("mountPath") and cn.get("image")), None)


def session_image(spec: Obj, sandbox: Obj | None, settings: SessionSettings) -> str:
    """The image a session runs: its own `image`; else, `asJob`, the job's recorded one; else the chart's."""
    job = job_container(sandbox) if spec.get("asJob") else None
    return str(spec.get("image") or (job or {}).get("image") or settings.image)


def image_allowed(image: str, spec: Obj, sandbox: Obj | None, settings: SessionSettings) -> bool:
    """The chart's images, and with `asJob` the job's recorded image: it already ran in this namespace."""
    job = job_container(sandbox) if spec.get("asJob") else None
    return settings.image_allowed(image) or (job is not None and image == job.get("image"))


def object_name(session: Obj) -> str:
    """The Pod's name: the session's uid, unique and stable across restarts."""
    return f"{c.SESSION_POD_PREFIX}{session['metadata']['uid']}"


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


def _waiting(pod: Obj) -> Obj:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == c.SESSION_CONTAINER:
            return (status.get("state") or {}).get("waiting") or {}
    return {}


def _ready(pod: Obj) -> bool:
    """Its container runs and is ready: the kubelet mounted every volume (the sandbox's, by the plugin)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == c.SESSION_CONTAINER:
            return "running" in (status.get("state") or {}) and status.get("ready") is True
    return False


def pod_refused(status: Obj, message: str, now: datetime) -> Obj:
    """The session's status once the API server refused its Pod (the namespace's ResourceQuota, LimitRange,
    Pod Security, or an invalid field): Refused with the server's own words, never retried."""
    return {
        **status,
        "phase": SessionPhase.REFUSED,
        "reason": Reason.POD_REFUSED,
        "message": (
            f"the API server refused its Pod {status.get('podNamespace')}/{status.get('podName')}: "
            f"{message[:800]}. Ask the namespace's administrators (its ResourceQuota, LimitRange or Pod Security "
            "level), then create the session again"
        ),
        "endedAt": format_instant(now),
    }


def decide(
    session: Obj,
    sandbox: Obj | None,
    pod: Obj | None,
    *,
    expired: bool,
    guard: str | None,
    past_max_age: bool = False,
    now: datetime,
    settings: SessionSettings,
    max_pin: timedelta | None = None,
    live: Sequence[Obj] = (),
) -> Plan:
    """The session's next state from what was read. Pure: no I/O, no clock (`now` is a parameter).

    `guard` is what weakens the admission guard (`guard_defect`), None when it holds. A sandbox `past_max_age`
    (its hard end) ends a session, a running one too. `max_pin` is the
    namespace's: a session's Pod holds its sandbox no longer than a pin set when the session was created
    could keep it, so a lifetime longer than that is cut to it. `live` is the other sessions holding a
    place under the caps; only a session not yet started is counted against them.
    """
    meta, spec = session["metadata"], session.get("spec") or {}
    status = dict(session.get("status") or {})
    if status.get("phase") in SETTLED:
        return Plan(status=status, teardown=True)
    namespace, name = meta["namespace"], str(spec.get("sandbox", ""))
    base: Obj = {"podNamespace": namespace, "podName": object_name(session)}
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
    image = session_image(spec, sandbox, settings)
    if not image_allowed(image, spec, sandbox, settings):
        allowed = ", ".join(dict.fromkeys((settings.image, *settings.allowed_images)))
        return stop(
            Reason.IMAGE_NOT_ALLOWED,
            f"image {image} is not one sessions may run (sessions.allowedImages: {allowed}); "
            "leave image unset for the default",
        )
    if past_max_age:  # the hard end: no session holds a sandbox past it, a running one ends (issue 28)
        return stop(
            Reason.MAX_AGE,
            f"RetainedSandbox {namespace}/{name} is past its hard end (its namespace's maxAge from its createdAt): "
            "no session may hold it any longer, and it is deleted once nothing uses it",
        )
    refusal = sandbox_refusal(sandbox, expired, namespace, name)
    # Once started, an expired sandbox is held by the session's Pod until the lifetime ends; one being
    # deleted, lost or gone ends it at once.
    if refusal is not None and (not started or refusal[0] is not Reason.EXPIRED):
        return stop(*refusal)
    if spec.get("asJob") and job_container(sandbox) is None:
        return stop(
            Reason.BAD_SESSION,
            f"sandbox {name} records no container that mounted its workspace whole, so it cannot be opened as its "
            "job was (only a workspace kept through sandkeep's CSI volume records one); open it without asJob "
            "(kubectl sandkeep open without --as-job)",
        )
    if not started and status.get("phase") not in LIVE and (limit := limit_refusal(session, live, settings)):
        return stop(*limit)
    assert sandbox is not None
    node = sandbox["spec"]["nodeName"]
    base["nodeName"] = node
    pending = {**status, **base, "phase": SessionPhase.PENDING, "reason": Reason.SESSION_STARTING}
    if pod is None:
        if status.get("phase") == SessionPhase.RUNNING:
            return stop(Reason.POD_ENDED, f"its Pod {namespace}/{base['podName']} is gone")
        message = f"starting Pod {namespace}/{base['podName']} on node {node}"
        return Plan(status={**pending, "message": message}, create_pod=True, wake_at=expires)
    pod_phase = (pod.get("status") or {}).get("phase")
    if is_deleting(pod) or pod_phase in ("Succeeded", "Failed"):
        return stop(Reason.POD_ENDED, f"its Pod {namespace}/{base['podName']} ended ({pod_phase})")
    waiting = _waiting(pod)
    if waiting.get("reason") in PULL_FAILURES:
        image = session_image(spec, sandbox, settings)
        detail = str(waiting.get("message") or waiting.get("reason"))[:500]
        return stop(
            Reason.IMAGE_PULL_FAILED,
            f"image {image} cannot be pulled on node {node} ({detail}); check its name, or leave image unset "
            "for the default",
        )
    if pod_phase != "Running" or not _ready(pod):
        # A volume the plugin refused leaves the Pod ContainerCreating; the refusal is in the Pod's Events.
        why = f" ({waiting['reason']})" if waiting.get("reason") else ""
        message = (
            f"waiting for its Pod to start on node {node}{why}; "
            f"`kubectl describe pod -n {namespace} {base['podName']}` shows why"
        )
        return Plan(status={**pending, "message": message}, wake_at=expires)
    running = {
        **status,
        **base,
        "phase": SessionPhase.RUNNING,
        "reason": Reason.SESSION_RUNNING,
        "message": f"kubectl exec -it -n {namespace} {base['podName']} -c {c.SESSION_CONTAINER} -- sh",
        "startedAt": status.get("startedAt") or format_instant(now),
    }
    return Plan(status=running, wake_at=expires)
