"""SandboxSessions: the pure decision, then a real controller against the real API server with the chart's
session objects (RBAC, admission policy) applied for one release.

There is no kubelet here, so a session's Pod never starts unless a test writes its status: these tests
cover every refusal (the namespace's own ResourceQuota and Pod Security among them, decided by the real
API server's admission), the Pod as the controller writes it in the sandbox's namespace, lifetime expiry,
tear-down and who may do what. A Pod that really starts, mounts the sandbox through the CSI plugin and is
opened with exec is tested on the real node (tests/node/test_e2e.py).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.api.kube import AGENT_MANAGER, session_path
from controller.cluster.session_decide import DEFAULT_RESOURCES, SessionSettings, decide, guard_defect, pod_refused
from controller.cluster.session_objects import pod_body, run_as, session_tolerations, tolerates
from controller.rules import contracts as c
from controller.rules.contracts import NOBODY, Reason, SessionPhase
from controller.rules.durations import format_instant
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import (
    Controller,
    install_crds,
    instant,
    kube_for,
    only_in,
    render_templates,
    wait_for,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
SETTINGS = SessionSettings(image="sandkeep:test")


# --- the pure decision ------------------------------------------------------------------------------------
def session(lifetime: str = "1h", created: datetime = NOW, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "team",
            "name": "s1",
            "uid": "u-1",
            "generation": 1,
            "creationTimestamp": format_instant(created),
            "resourceVersion": "1",
        },
        "spec": {"sandbox": "run-1", "user": "alice", "lifetime": lifetime},
        "status": status,
    }


def sandbox(
    phase: str = "Retained", deleting: bool = False, sessions: list[Any] | None = None, **extra: Any
) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "team", "name": "run-1", "uid": "sb-1"}
    if deleting:
        meta["deletionTimestamp"] = format_instant(NOW)
    return {
        "metadata": meta,
        "spec": {"nodeName": "node-a"},
        "status": {"phase": phase, "sessions": sessions or [], **extra},
    }


def pod(phase: str = "Running", running: bool = True, waiting: str | None = None, ready: bool = True) -> dict[str, Any]:
    state: dict[str, Any] = {"running": {}} if running else {"waiting": {"reason": waiting or "ContainerCreating"}}
    container = {"name": c.SESSION_CONTAINER, "state": state, "ready": running and ready}
    return {
        "metadata": {"name": "session-u-1", "namespace": "team", "uid": "pod-1"},
        "status": {"phase": phase, "containerStatuses": [container]},
    }


def plan(
    s: dict[str, Any],
    sb: dict[str, Any] | None,
    p: dict[str, Any] | None = None,
    *,
    expired: bool = False,
    guard: str | None = None,
    now: datetime = NOW,
    live: tuple[dict[str, Any], ...] = (),
    settings: SessionSettings = SETTINGS,
) -> Any:
    return decide(s, sb, p, expired=expired, guard=guard, now=now, settings=settings, live=live)


@pytest.mark.parametrize(
    ("sb", "expired", "reason"),
    [
        (None, False, Reason.SANDBOX_NOT_FOUND),
        (sandbox(deleting=True), False, Reason.SANDBOX_DELETING),
        (sandbox("Lost"), False, Reason.LOST),
        (sandbox("Stuck"), False, Reason.TOMBSTONE_STUCK),
        (
            sandbox(conditions=[{"type": c.Condition.ORPHANS_SURVIVED, "status": "True", "message": "pid 7"}]),
            False,
            Reason.ORPHAN_SURVIVOR,
        ),
        (sandbox("Expired"), True, Reason.EXPIRED),
    ],
)
def test_a_sandbox_that_cannot_be_opened_refuses_the_session_and_creates_nothing(
    sb: dict[str, Any] | None, expired: bool, reason: Reason
) -> None:
    p = plan(session(), sb, expired=expired)
    assert (p.status["phase"], p.status["reason"]) == (SessionPhase.REFUSED, reason)
    assert not p.create_pod and p.teardown


def test_unguarded_over_the_cap_and_unparsed_lifetimes_are_refused() -> None:
    unguarded = plan(session(), sandbox(), guard="the ValidatingAdmissionPolicyBinding b is not installed")
    assert (
        unguarded.status["reason"] == Reason.SESSIONS_UNGUARDED and "b is not installed" in unguarded.status["message"]
    )
    over = plan(session("9h"), sandbox())
    assert over.status["reason"] == Reason.BAD_SESSION and "cap of 8h" in over.status["message"]
    assert plan(session("soon"), sandbox()).status["reason"] == Reason.BAD_SESSION


def test_a_session_starts_its_pod_then_runs_once_its_container_is_ready() -> None:
    first = plan(session(), sandbox())
    assert first.create_pod and first.status["phase"] == SessionPhase.PENDING
    assert (first.status["podNamespace"], first.status["podName"]) == ("team", "session-u-1")
    starting = plan(session(), sandbox(), pod("Pending", running=False))
    assert not starting.create_pod and "ContainerCreating" in starting.status["message"]
    assert "kubectl describe pod -n team session-u-1" in starting.status["message"]
    unready = plan(session(), sandbox(), pod(ready=False))
    assert unready.status["phase"] == SessionPhase.PENDING and not unready.create_pod
    running = plan(session(), sandbox(), pod())
    assert running.status["phase"] == SessionPhase.RUNNING and not running.teardown
    assert running.status["message"] == f"kubectl exec -it -n team session-u-1 -c {c.SESSION_CONTAINER} -- sh"
    assert running.status["startedAt"] == format_instant(NOW)
    assert running.wake_at == NOW + timedelta(hours=1)


def test_a_pod_the_api_server_refuses_settles_the_session_refused_with_its_words() -> None:
    pending = plan(session(), sandbox()).status
    refused = pod_refused(pending, 'pods "session-u-1" is forbidden: exceeded quota: q, limited: pods=0', NOW)
    assert (refused["phase"], refused["reason"]) == (SessionPhase.REFUSED, Reason.POD_REFUSED)
    assert 'refused its Pod team/session-u-1: pods "session-u-1" is forbidden: exceeded quota' in refused["message"]
    assert refused["endedAt"] == format_instant(NOW)
    settled = plan(session(**refused), sandbox())
    assert settled.status == refused and settled.teardown and not settled.create_pod, "never retried"


def test_lifetime_pod_end_pull_failure_and_deletion_end_a_started_session() -> None:
    late = plan(session(), sandbox(), pod(), now=NOW + timedelta(hours=1))
    assert (late.status["phase"], late.status["reason"]) == (SessionPhase.ENDED, Reason.LIFETIME_ENDED)
    assert plan(session(), sandbox(), pod("Failed", running=False)).status["reason"] == Reason.POD_ENDED
    pull = plan(session(), sandbox(), pod("Pending", running=False, waiting="ImagePullBackOff"))
    assert pull.status["reason"] == Reason.IMAGE_PULL_FAILED and "sandkeep:test" in pull.status["message"]
    assert plan(session(), sandbox(deleting=True), pod()).status["reason"] == Reason.SANDBOX_DELETING
    gone = plan(session(phase=SessionPhase.RUNNING), sandbox(), None)
    assert gone.status["reason"] == Reason.POD_ENDED


def test_a_session_holds_its_sandbox_no_longer_than_a_pin_could() -> None:
    args = {"expired": False, "guard": None, "settings": SETTINGS, "max_pin": timedelta(minutes=30)}
    cut = decide(session("4h"), sandbox(), None, now=NOW, **args)
    assert cut.status["expiresAt"] == format_instant(NOW + timedelta(minutes=30))
    assert cut.create_pod and cut.wake_at == NOW + timedelta(minutes=30)
    over = decide(session("4h"), sandbox(), pod(), now=NOW + timedelta(minutes=30), **args)
    assert (over.status["phase"], over.status["reason"]) == (SessionPhase.ENDED, Reason.LIFETIME_ENDED)
    kept = decide(session("20m"), sandbox(), None, now=NOW, **args)
    assert kept.status["expiresAt"] == format_instant(NOW + timedelta(minutes=20))


def test_a_sandbox_past_its_hard_end_ends_a_running_session_and_refuses_a_new_one() -> None:
    # Issue 28: past createdAt + maxAge no session holds it; the teardown frees it for deletion.
    args: dict[str, Any] = {"expired": True, "guard": None, "now": NOW, "settings": SETTINGS, "past_max_age": True}
    for pod_ in (pod(), None):
        done = decide(session(), sandbox("Held"), pod_, **args)
        assert done.teardown and done.status["reason"] == Reason.MAX_AGE and "hard end" in done.status["message"]
        assert done.status["phase"] == (SessionPhase.ENDED if pod_ else SessionPhase.REFUSED)


def test_an_expired_sandbox_stays_open_for_a_running_session_and_a_settled_one_stays_settled() -> None:
    assert plan(session(), sandbox("Held"), pod(), expired=True).status["phase"] == SessionPhase.RUNNING
    ended = session(phase=SessionPhase.ENDED, reason=Reason.LIFETIME_ENDED)
    assert plan(ended, sandbox(), pod()).status == ended["status"]


def test_the_pod_mounts_the_sandbox_through_the_csi_driver_in_its_own_namespace_as_restricted_allows() -> None:
    sb = sandbox()
    sb["spec"]["workspace"] = {"path": "/etc"}  # an editor can write spec; it is never read
    body = pod_body(session(), sb, SETTINGS, NOW + timedelta(hours=1), NOW)
    assert body["metadata"]["namespace"] == "team" and body["metadata"]["name"] == "session-u-1"
    volume = body["spec"]["volumes"][0]
    assert volume == {
        "name": "sandbox",
        "csi": {"driver": c.CSI_DRIVER, "readOnly": True, "volumeAttributes": {c.VOLUME_SANDBOX: "run-1"}},
    }
    assert not any("hostPath" in v for v in body["spec"]["volumes"])
    container = body["spec"]["containers"][0]
    assert container["volumeMounts"][0] == {"name": "sandbox", "mountPath": c.SESSION_MOUNT, "readOnly": True}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    pod_security = body["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert body["spec"]["nodeName"] == "node-a" and body["spec"]["activeDeadlineSeconds"] == 3600
    assert body["metadata"]["labels"][c.LABEL_SANDBOX_UID] == "sb-1"
    rw = session()
    rw["spec"]["readWrite"] = True
    rw_body = pod_body(rw, sb, SETTINGS, NOW + timedelta(hours=1), NOW)
    assert rw_body["spec"]["volumes"][0]["csi"] == {
        "driver": c.CSI_DRIVER,
        "readOnly": False,
        "volumeAttributes": {c.VOLUME_SANDBOX: "run-1", c.VOLUME_READ_WRITE: "true"},
    }
    assert rw_body["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] is False


JOB = {"name": "build", "image": "registry.example/build:7", "workingDir": "/src/app", "mountPath": "/src"}


def as_job(sb: dict[str, Any], *containers: dict[str, Any], image: str | None = None) -> dict[str, Any]:
    """A session with asJob on `sb`, whose spec.origin records `containers`."""
    sb["spec"]["origin"] = {"pod": "build-x", "outcome": "Failed", "containers": list(containers)}
    s = session()
    s["spec"] |= {"asJob": True, **({"image": image} if image else {})}
    return s


def test_as_job_runs_the_recorded_image_in_its_working_directory_with_the_workspace_at_its_mount_path() -> None:
    sb = sandbox()
    s = as_job(sb, {"name": "init", "image": "busybox"}, JOB)  # the first that mounted it whole is the job's
    p = plan(s, sb)
    assert p.create_pod, p.status  # the recorded image is allowed: it already ran in this namespace
    container = pod_body(s, sb, SETTINGS, NOW + timedelta(hours=1), NOW)["spec"]["containers"][0]
    assert (container["image"], container["workingDir"]) == ("registry.example/build:7", "/src/app")
    assert container["volumeMounts"] == [
        {"name": "sandbox", "mountPath": "/src", "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    assert body_security(s, sb) == {"runAsUser": NOBODY, "runAsGroup": NOBODY}  # no user recorded, none on disk
    sb["spec"]["origin"]["fsGroup"] = 2000
    sb["spec"]["origin"]["containers"][1] |= {"runAsUser": 1000, "runAsGroup": 1000}
    assert body_security(s, sb) == {"runAsUser": 1000, "runAsGroup": 1000, "supplementalGroups": [2000]}
    sb["spec"]["origin"]["containers"][1] |= {"runAsUser": 0, "runAsGroup": 10}  # root, a system id: never
    sb["status"]["owner"] = {"uid": 1234, "gid": 1234}
    sb["spec"]["origin"]["fsGroup"] = 0
    assert body_security(s, sb) == {"runAsUser": 1234, "runAsGroup": 1234}
    at_tmp = sandbox()
    s = as_job(at_tmp, {**JOB, "mountPath": "/tmp", "workingDir": None})
    container = pod_body(s, at_tmp, SETTINGS, NOW + timedelta(hours=1), NOW)["spec"]["containers"][0]
    assert container["volumeMounts"] == [{"name": "sandbox", "mountPath": "/tmp", "readOnly": True}]
    assert container["workingDir"] == "/tmp"  # none recorded: the workspace


def body_security(s: dict[str, Any], sb: dict[str, Any]) -> dict[str, Any]:
    """The ids of the session Pod's securityContext."""
    security = pod_body(s, sb, SETTINGS, NOW + timedelta(hours=1), NOW)["spec"]["securityContext"]
    return {k: v for k, v in security.items() if k in ("runAsUser", "runAsGroup", "supplementalGroups")}


def test_as_job_without_a_recorded_container_or_with_an_image_not_allowed_is_refused() -> None:
    for sb in (sandbox(), sandbox()):
        unrecorded = as_job(sb, {"name": "build", "image": "i"})  # mounted by subPath, or kept by sandkeep retain
        p = plan(unrecorded, sb)
        assert (p.status["phase"], p.status["reason"]) == (SessionPhase.REFUSED, Reason.BAD_SESSION)
        assert "cannot be opened as its job was" in p.status["message"] and not p.create_pod
        sb["spec"].pop("origin")
        assert plan(unrecorded, sb).status["reason"] == Reason.BAD_SESSION
    sb = sandbox()
    other = as_job(sb, JOB, image="evil/miner:latest")  # an image of its own is checked as always
    assert plan(other, sb).status["reason"] == Reason.IMAGE_NOT_ALLOWED
    recorded = session()
    recorded["spec"]["image"] = JOB["image"]  # without asJob the recorded image is not allowed by that alone
    sb["spec"]["origin"] = {"pod": "p", "outcome": "Failed", "containers": [JOB]}
    assert plan(recorded, sb).status["reason"] == Reason.IMAGE_NOT_ALLOWED


# --- bounds (issue 25): caps, images, the guard, ids from disk, tolerations, resources -------------------------
def live_session(name: str, user: str = "alice", namespace: str = "team") -> dict[str, Any]:
    meta = {"namespace": namespace, "name": name, "uid": f"uid-{name}"}
    return {"metadata": meta, "spec": {"user": user}, "status": {"phase": SessionPhase.RUNNING}}


def test_a_new_session_past_its_users_cap_is_refused_naming_the_sessions_that_count_and_how_to_end_one() -> None:
    live = tuple(live_session(f"s{i}", namespace=f"ns{i}") for i in range(c.SESSIONS_MAX_PER_USER.default))
    p = plan(session(), sandbox(), live=live)
    assert (p.status["phase"], p.status["reason"]) == (SessionPhase.REFUSED, Reason.SESSION_LIMIT)
    assert not p.create_pod and p.teardown
    message = p.status["message"]
    assert "user alice already has 3 live session(s)" in message and "sessions.maxPerUser" in message
    assert "ns0/s0, ns1/s1, ns2/s2" in message and "kubectl delete sandboxsessions -n ns0 s0" in message
    others = tuple(live_session(f"s{i}", user=f"u{i}") for i in range(3))  # other users: within both caps
    assert plan(session(), sandbox(), live=others).create_pod


def test_a_namespace_full_of_sessions_refuses_a_new_one_whoever_asks() -> None:
    small = SessionSettings(image="sandkeep:test", max_per_namespace=2)
    live = (live_session("a", user="bob"), live_session("b", user="carol"), live_session("c", namespace="elsewhere"))
    p = plan(session(), sandbox(), live=live, settings=small)
    assert p.status["reason"] == Reason.SESSION_LIMIT and "namespace team already has 2" in p.status["message"]
    assert "sessions.maxPerNamespace" in p.status["message"]


@given(
    st.lists(st.tuples(st.sampled_from(["alice", "bob"]), st.sampled_from(["team", "other"])), max_size=8),
    st.integers(0, 4),
    st.integers(0, 6),
    st.sampled_from([None, SessionPhase.PENDING, SessionPhase.RUNNING]),
)
def test_the_caps_count_only_other_live_sessions_and_never_stop_an_admitted_one(
    owners: list[tuple[str, str]], per_user: int, per_namespace: int, phase: SessionPhase | None
) -> None:
    settings = SessionSettings(image="i", max_per_user=per_user, max_per_namespace=per_namespace)
    live = tuple(live_session(f"s{i}", user, ns) for i, (user, ns) in enumerate(owners))
    live += (live_session("self"),)  # the session itself, as a fresh list shows it once admitted: never counted
    s = session(**({"phase": phase} if phase else {}))
    s["metadata"]["uid"] = "uid-self"
    p = plan(s, sandbox(), live=live, settings=settings)
    over = sum(u == "alice" for u, _ in owners) >= per_user or sum(n == "team" for _, n in owners) >= per_namespace
    assert (p.status["reason"] == Reason.SESSION_LIMIT) == (over and phase is None)


def test_an_image_not_allowed_is_refused_and_the_default_always_is() -> None:
    allowed = SessionSettings(image="sandkeep:test", allowed_images=("busybox:1.36",))
    evil = session()
    evil["spec"]["image"] = "evil/miner:latest"
    p = plan(evil, sandbox(), settings=allowed)
    assert (p.status["phase"], p.status["reason"]) == (SessionPhase.REFUSED, Reason.IMAGE_NOT_ALLOWED)
    assert "sandkeep:test, busybox:1.36" in p.status["message"] and not p.create_pod
    ok = session()
    ok["spec"]["image"] = "busybox:1.36"
    assert plan(ok, sandbox(), settings=allowed).create_pod
    assert plan(session(), sandbox(), settings=allowed).create_pod  # no image: the default
    assert plan(ok, sandbox()).status["reason"] == Reason.IMAGE_NOT_ALLOWED  # not allowed by SETTINGS


GUARDED = SessionSettings(image="i", admission_binding="rel-sessions")


def vap_binding(policy: str = "rel-sessions", actions: list[str] | None = None) -> dict[str, Any]:
    return {"spec": {"policyName": policy, "validationActions": ["Deny"] if actions is None else actions}}


def vap(failure: str | None = "Fail", checks: tuple[str, ...] = (c.SESSION_USER_CHECK,)) -> dict[str, Any]:
    spec: dict[str, Any] = {"validations": [{"expression": e} for e in checks]}
    if failure is not None:
        spec["failurePolicy"] = failure
    return {"spec": spec}


@pytest.mark.parametrize(
    ("binding", "policy", "defect"),
    [
        (None, vap(), "rel-sessions is not installed"),
        (vap_binding("other"), vap(), "binds 'other', not rel-sessions"),
        (vap_binding(actions=["Audit"]), vap(), "validationActions ['Audit'], without Deny"),
        (vap_binding(actions=["Warn", "Audit"]), vap(), "without Deny"),
        (vap_binding(actions=[]), vap(), "without Deny"),
        (vap_binding(), None, "ValidatingAdmissionPolicy rel-sessions is not installed"),
        (vap_binding(), vap("Ignore"), "failurePolicy 'Ignore', not Fail"),
        (vap_binding(), vap(None), "failurePolicy None, not Fail"),
        (vap_binding(), vap(checks=("true",)), "no longer checks"),
    ],
)
def test_a_weakened_admission_guard_is_a_defect_that_says_what_is_wrong(
    binding: dict[str, Any] | None, policy: dict[str, Any] | None, defect: str
) -> None:
    found = guard_defect(binding, policy, GUARDED)
    assert found is not None and defect in found
    p = plan(session(), sandbox(), guard=found)
    assert p.status["reason"] == Reason.SESSIONS_UNGUARDED and defect in p.status["message"] and not p.create_pod


@given(st.lists(st.sampled_from(["Deny", "Warn", "Audit"]), unique=True))
def test_the_guard_holds_exactly_when_its_binding_denies(actions: list[str]) -> None:
    assert (guard_defect(vap_binding(actions=actions), vap(), GUARDED) is None) == ("Deny" in actions)


def test_a_running_session_ends_when_its_guard_is_weakened() -> None:
    p = plan(session(phase=SessionPhase.RUNNING), sandbox(), pod(), guard="binding b has validationActions ['Audit']")
    assert (p.status["phase"], p.status["reason"], p.teardown) == (SessionPhase.ENDED, Reason.SESSIONS_UNGUARDED, True)


ids = st.one_of(st.integers(-(2**40), 2**40), st.booleans(), st.none(), st.text(max_size=3), st.floats())


@given(ids, ids, st.integers(1, 70000))
def test_a_session_never_runs_as_root_or_a_system_id_read_from_disk(uid: Any, gid: Any, min_id: int) -> None:
    settings = SessionSettings(image="i", min_owner_id=min_id)
    run_uid, run_gid = run_as({"uid": uid, "gid": gid}, settings)
    for read, ran in ((uid, run_uid), (gid, run_gid)):
        assert ran != 0 and type(ran) is int
        person = type(read) is int and min_id <= read <= 2**31 - 1
        assert ran == (read if person else c.NOBODY)


def test_the_pod_runs_as_the_owner_only_above_the_threshold() -> None:
    def ids_of(owner: dict[str, Any]) -> tuple[int, int]:
        sc = pod_body(session(), sandbox(owner=owner), SETTINGS, NOW + timedelta(hours=1), NOW)["spec"]
        return sc["securityContext"]["runAsUser"], sc["securityContext"]["runAsGroup"]

    assert ids_of({"uid": 1001, "gid": 1001}) == (1001, 1001)
    assert ids_of({"uid": 1001, "gid": 0}) == (1001, c.NOBODY)  # group 0 from disk: never
    assert ids_of({"uid": 0, "gid": 0}) == (c.NOBODY, c.NOBODY)
    assert ids_of({"uid": 999, "gid": 4}) == (c.NOBODY, c.NOBODY)  # a system account's, and group adm
    assert ids_of({}) == (c.NOBODY, c.NOBODY)


taint_strategy = st.fixed_dictionaries(
    {"key": st.sampled_from(["a", "b", "node.kubernetes.io/unreachable"]), "effect": st.sampled_from(EFFECTS)},
    optional={"value": st.sampled_from(["", "x", "y"])},
)
toleration_strategy = st.fixed_dictionaries(
    {},
    optional={
        "key": st.sampled_from(["", "a", "b"]),
        "operator": st.sampled_from(["Exists", "Equal"]),
        "value": st.sampled_from(["", "x"]),
        "effect": st.sampled_from(["", *EFFECTS]),
        "tolerationSeconds": st.integers(0, 600),
    },
)


@given(st.lists(toleration_strategy, max_size=4), st.lists(taint_strategy, max_size=5))
def test_a_session_tolerates_only_its_nodes_noexecute_taints_that_the_agent_tolerates(
    agent: list[dict[str, Any]], taints: list[dict[str, Any]]
) -> None:
    out = session_tolerations(agent, taints)
    for toleration in out:  # each names one taint of the node, never a blanket
        assert toleration["key"] and toleration["operator"] == "Equal" and toleration["effect"] == "NoExecute"
        assert any(
            t["key"] == toleration["key"]
            and (t.get("value") or "") == toleration["value"]
            and t["effect"] == "NoExecute"
            for t in taints
        )
    for taint in taints:  # and every NoExecute taint the agent tolerates is tolerated
        if taint["effect"] == "NoExecute" and any(tolerates(t, taint) for t in agent):
            assert any(tolerates(t, taint) for t in out)
        if not any(tolerates(t, taint) for t in agent):
            assert not any(tolerates(t, taint) for t in out)


def test_the_pod_tolerates_no_blanket_and_has_bounded_resources() -> None:
    blanket = SessionSettings(image="i", tolerations=({"operator": "Exists"},))
    taints = [
        {"key": "dedicated", "value": "ci", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "ci", "effect": "NoExecute"},
    ]
    spec = pod_body(session(), sandbox(), blanket, NOW + timedelta(hours=1), NOW, taints)["spec"]
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ci", "effect": "NoExecute"}]
    assert pod_body(session(), sandbox(), blanket, NOW + timedelta(hours=1), NOW)["spec"]["tolerations"] == []
    resources = spec["containers"][0]["resources"]
    assert resources == DEFAULT_RESOURCES
    for kind in ("requests", "limits"):
        assert set(resources[kind]) == {"cpu", "memory", "ephemeral-storage"}


# --- a real controller, the chart's session objects --------------------------------------------------------
@pytest.fixture
def sbed(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Bed]:
    install_crds(cluster)
    release = f"ss{secrets.token_hex(3)}"
    docs = render_templates(
        release,
        namespace,
        ("sessions.yaml",),
        only_in(namespace),
        "--set=sessions.enabled=true",
        "--set=sessions.maxLifetime=1h",
    )
    cluster.apply(docs)
    b = Bed(cluster, namespace, release, tmp_path)
    # A new admission policy takes effect a moment after it is created: wait until a forged user is refused.
    wait_for("the session policy in force", lambda: b.open("x", "someone-else", dry_run=True).returncode or None)
    yield b
    b.stop()
    # No kubelet here finishes a Pod's graceful deletion: remove them outright, then the namespace can go.
    cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False)
    cluster_wide = ("Namespace", "ClusterRole", "ClusterRoleBinding")
    made = [
        f"{doc['kind']}/{doc['metadata']['name']}"
        for doc in docs
        if doc["kind"] in cluster_wide or doc["kind"].startswith("Validating")
    ]
    cluster.kubectl("delete", *made, "--wait=false", check=False)  # one kubectl for them all


class Bed:
    def __init__(self, cluster: LocalCluster, namespace: str, release: str, tmp: Path) -> None:
        self.cluster, self.namespace, self.release, self.tmp = cluster, namespace, release, tmp
        self.kube = kube_for(cluster)
        self.controllers: list[Controller] = []
        self.admin = cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout.strip()

    def controller(self, *flags: str, binding: str | None = None) -> Controller:
        ctl = Controller(
            self.cluster,
            self.namespace,
            self.tmp / f"controller-{len(self.controllers)}.log",
            "--sessions",
            "--sessions-image=sandkeep:test",
            "--sessions-max-lifetime=1h",
            f"--sessions-admission-binding={binding or self.release + '-sandkeep-sessions'}",
            *flags,
        )
        self.controllers.append(ctl)
        ctl.wait_leader()
        return ctl

    def stop(self) -> None:
        for ctl in self.controllers:
            ctl.stop()
            print(f"----- {ctl.log_path.name}\n" + "\n".join(ctl.log().splitlines()[-60:]))

    def sandbox(
        self, name: str, created: timedelta = timedelta(0), finalizer: bool = False, origin: Any = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"nodeName": "node-a", "createdAt": instant(-created), **({"origin": origin} if origin else {})},
        }
        if finalizer:
            body["metadata"]["finalizers"] = ["sandkeep.io/test-hold"]
        return self.kube.create_sandbox(self.namespace, body)

    def open(
        self, sandbox: str, user: str | None = None, as_user: str | None = None, dry_run: bool = False, **spec: Any
    ) -> subprocess.CompletedProcess[str]:
        body = {
            "apiVersion": c.API_VERSION,
            "kind": c.SESSION_KIND,
            "metadata": {"name": f"open-{sandbox}", "namespace": self.namespace},
            "spec": {"sandbox": sandbox, "user": user or as_user or self.admin, **spec},
        }
        dry = ["--dry-run=server"] if dry_run else []
        return self.cluster.kubectl("create", *dry, "-f", "-", input=json.dumps(body), as_user=as_user, check=False)

    def editor(self, name: str) -> str:
        """A user of its own (`name-xxxx`) bound to `edit` in the namespace, once `edit` aggregates sessions."""
        user = f"{name}-{secrets.token_hex(2)}"
        self.cluster.kubectl(
            "create", "rolebinding", f"{user}-edits", "--clusterrole=edit", f"--user={user}", "-n", self.namespace
        )

        def aggregated() -> bool | None:
            return "sandboxsessions" in self.cluster.kubectl("get", "clusterrole", "edit", "-o", "json").stdout or None

        wait_for("edit aggregating sessions", aggregated, timeout=30)
        return user

    def session(self, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.kube.request("GET", session_path(self.namespace, name))
        except Exception:
            return None
        return found

    def phase(self, name: str, phase: SessionPhase, timeout: float = 90) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            s = self.session(name)
            return s if s is not None and (s.get("status") or {}).get("phase") == phase else None

        return wait_for(f"session {name} {phase}", probe, timeout)["status"]

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.kubectl_json(
            "get", "pods", "-n", self.namespace, "-l", c.LABEL_SESSION_UID
        )["items"]
        return items

    def policy_images(self) -> list[str]:
        policy = self.cluster.kubectl_json("get", "validatingadmissionpolicy", f"{self.release}-sandkeep-sessions")
        images: list[str] = json.loads(
            next(v for v in policy["spec"]["variables"] if v["name"] == "images")["expression"]
        )
        return images

    def rbac(self) -> list[str]:
        """Roles and RoleBindings anywhere named like a session's (none is made any more)."""
        out = self.cluster.kubectl("get", "roles,rolebindings", "-A", "-o", "name").stdout.split()
        return [n for n in out if "/session-" in n]


def test_refused_sessions_say_why_and_create_no_pod(sbed: Bed) -> None:
    sbed.controller("--retention=1h", "--dry-run")  # dry-run: the expired sandbox stays to be refused
    sbed.sandbox("old", created=timedelta(hours=2))
    sbed.sandbox("going", finalizer=True)
    sbed.kube.request("DELETE", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{sbed.namespace}/{c.SANDBOX_PLURAL}/going")
    # What the node agent reports (as the agent writes it: its field manager): a directory gone, orphans alive.
    for name, type_, state, why in (
        ("lost", c.Condition.DISK_PRESENT, "False", Reason.MANIFEST_ABSENT),
        ("orphans", c.Condition.ORPHANS_SURVIVED, "True", Reason.ORPHAN_SURVIVOR),
    ):
        obj = sbed.sandbox(name)
        cond = {"type": type_, "status": state, "lastTransitionTime": instant(), "reason": why, "message": "pid 7"}
        sbed.kube.apply_status(obj, {"conditions": [cond]}, AGENT_MANAGER)
    wait_for(
        "the lost sandbox Lost",
        lambda: (
            (sbed.kube.get_sandbox(sbed.namespace, "lost") or {}).get("status", {}).get("phase") == c.Phase.LOST or None
        ),
    )
    for sandbox, reason in (
        ("nope", Reason.SANDBOX_NOT_FOUND),
        ("old", Reason.EXPIRED),
        ("going", Reason.SANDBOX_DELETING),
        ("lost", Reason.LOST),
        ("orphans", Reason.ORPHAN_SURVIVOR),
    ):
        assert sbed.open(sandbox).returncode == 0
        status = sbed.phase(f"open-{sandbox}", SessionPhase.REFUSED)
        assert status["reason"] == reason, status["message"]
    assert "kubectl sandkeep pin old" in sbed.phase("open-old", SessionPhase.REFUSED)["message"]
    assert sbed.pods() == [] and sbed.rbac() == []
    sbed.cluster.kubectl(
        "patch",
        c.SANDBOX_PLURAL,
        "going",
        "-n",
        sbed.namespace,
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/metadata/finalizers"}]',
    )


def test_a_session_runs_its_pod_on_the_sandboxs_node_and_ends_with_its_lifetime(sbed: Bed) -> None:
    sbed.controller()
    sb = sbed.sandbox("run-1")
    assert sbed.open("run-1", lifetime="4s").returncode == 0
    status = sbed.phase("open-run-1", SessionPhase.PENDING)
    assert status["reason"] == Reason.SESSION_STARTING and status["nodeName"] == "node-a"
    (p,) = wait_for("the session's Pod", lambda: sbed.pods() or None)
    assert p["metadata"]["name"] == status["podName"] and p["spec"]["nodeName"] == "node-a"
    assert p["metadata"]["labels"][c.LABEL_SANDBOX_UID] == sb["metadata"]["uid"]
    assert p["metadata"]["namespace"] == sbed.namespace == status["podNamespace"], "in the sandbox's namespace"
    csi = p["spec"]["volumes"][0]["csi"]
    assert csi == {"driver": c.CSI_DRIVER, "readOnly": True, "volumeAttributes": {c.VOLUME_SANDBOX: "run-1"}}
    assert p["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] is True
    assert p["spec"]["containers"][0]["resources"] == DEFAULT_RESOURCES  # as the API server keeps it
    # node-a has no taints: only what the API server's DefaultTolerationSeconds adds to every Pod, no blanket
    tolerated = {(t["key"], t.get("tolerationSeconds")) for t in p["spec"].get("tolerations", [])}
    assert tolerated <= {("node.kubernetes.io/not-ready", 300), ("node.kubernetes.io/unreachable", 300)}
    assert p["spec"]["securityContext"]["runAsGroup"] == c.NOBODY
    assert sbed.rbac() == [], "no Role or RoleBinding: exec is the user's own"
    ended = sbed.phase("open-run-1", SessionPhase.ENDED, timeout=30)
    assert ended["reason"] == Reason.LIFETIME_ENDED
    wait_for("the Pod deleted", lambda: all("deletionTimestamp" in q["metadata"] for q in sbed.pods()) or None)


def test_deleting_a_session_deletes_its_pod(sbed: Bed) -> None:
    sbed.controller()
    sbed.sandbox("run-2")
    assert sbed.open("run-2", readWrite=True).returncode == 0
    (p,) = wait_for("the session's Pod", lambda: sbed.pods() or None)
    assert p["spec"]["containers"][0]["volumeMounts"][0].get("readOnly", False) is False
    assert p["spec"]["volumes"][0]["csi"]["volumeAttributes"] == {
        c.VOLUME_SANDBOX: "run-2",
        c.VOLUME_READ_WRITE: "true",
    }
    sbed.cluster.kubectl("delete", c.SESSION_PLURAL, "open-run-2", "-n", sbed.namespace)
    wait_for("the Pod deleted", lambda: all("deletionTimestamp" in q["metadata"] for q in sbed.pods()) or None)


def test_a_namespace_whose_quota_allows_no_pods_gets_its_session_refused_with_the_quotas_words(sbed: Bed) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pods", "namespace": sbed.namespace},
        "spec": {"hard": {"pods": "0"}},
    }
    sbed.cluster.kubectl("create", "-f", "-", input=json.dumps(quota))
    wait_for(
        "the quota observed",
        lambda: (
            sbed.cluster.kubectl_json("get", "resourcequota", "no-pods", "-n", sbed.namespace)
            .get("status", {})
            .get("hard")
            or None
        ),
    )
    sbed.controller()
    sbed.sandbox("run-q")
    assert sbed.open("run-q").returncode == 0
    status = sbed.phase("open-run-q", SessionPhase.REFUSED)
    assert status["reason"] == Reason.POD_REFUSED, status["message"]
    assert "exceeded quota: no-pods" in status["message"] and "pods=0" in status["message"]
    assert f"refused its Pod {sbed.namespace}/{status['podName']}" in status["message"]
    assert sbed.pods() == [] and sbed.rbac() == []
    time.sleep(2)  # settled: never retried
    again = sbed.session("open-run-q")
    assert again is not None and again["status"] == status


def test_a_namespace_enforcing_restricted_admits_the_session_pod_which_runs_once_ready(sbed: Bed) -> None:
    sbed.cluster.kubectl(
        "label", "namespace", sbed.namespace, "pod-security.kubernetes.io/enforce=restricted", "--overwrite"
    )
    sbed.controller()
    sbed.sandbox("run-r")
    assert sbed.open("run-r", readWrite=True).returncode == 0
    (p,) = wait_for("the session's Pod, admitted", lambda: sbed.pods() or None)
    assert sbed.phase("open-run-r", SessionPhase.PENDING)["reason"] == Reason.SESSION_STARTING
    # No kubelet here: write what it would once the plugin mounted the sandbox and the container started.
    container = {
        "name": c.SESSION_CONTAINER,
        "ready": True,
        "state": {"running": {"startedAt": instant()}},
        "image": p["spec"]["containers"][0]["image"],
        "imageID": "",
        "restartCount": 0,
    }
    sbed.cluster.kubectl(
        "patch",
        "pod",
        p["metadata"]["name"],
        "-n",
        sbed.namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"phase": "Running", "containerStatuses": [container]}}),
    )
    running = sbed.phase("open-run-r", SessionPhase.RUNNING, timeout=30)
    assert running["reason"] == Reason.SESSION_RUNNING
    assert running["message"] == (
        f"kubectl exec -it -n {sbed.namespace} {p['metadata']['name']} -c {c.SESSION_CONTAINER} -- sh"
    )
    assert sbed.rbac() == []


def test_as_job_creates_the_jobs_pod_in_a_restricted_namespace_from_the_recorded_origin(sbed: Bed) -> None:
    sbed.cluster.kubectl(
        "label", "namespace", sbed.namespace, "pod-security.kubernetes.io/enforce=restricted", "--overwrite"
    )
    sbed.controller()
    sbed.sandbox("run-job", origin={"pod": "build-x", "outcome": "Failed", "containers": [JOB]})
    sbed.sandbox("run-plain")
    assert sbed.open("run-job", asJob=True).returncode == 0
    (p,) = wait_for("the session's Pod, admitted under restricted", lambda: sbed.pods() or None)
    container = p["spec"]["containers"][0]
    assert (container["image"], container["workingDir"]) == (JOB["image"], JOB["workingDir"])
    assert container["volumeMounts"][0]["mountPath"] == JOB["mountPath"]
    assert sbed.open("run-plain", asJob=True).returncode == 0
    refused = sbed.phase("open-run-plain", SessionPhase.REFUSED)
    assert refused["reason"] == Reason.BAD_SESSION and "cannot be opened as its job was" in refused["message"]
    assert len(sbed.pods()) == 1


def test_without_the_admission_policy_bound_sessions_are_refused(sbed: Bed) -> None:
    sbed.controller(binding="not-installed")
    sbed.sandbox("run-3")
    assert sbed.open("run-3").returncode == 0
    assert sbed.phase("open-run-3", SessionPhase.REFUSED)["reason"] == Reason.SESSIONS_UNGUARDED
    assert sbed.pods() == []


def test_a_binding_switched_to_audit_stops_sessions_even_one_naming_another_user(sbed: Bed) -> None:
    binding = f"{sbed.release}-sandkeep-sessions"
    patch = '{"spec":{"validationActions":["Audit"]}}'
    sbed.cluster.kubectl("patch", "validatingadmissionpolicybinding", binding, "--type=merge", "-p", patch)
    wait_for("the binding auditing only", lambda: sbed.open("x", "someone-else", dry_run=True).returncode == 0 or None)
    sbed.controller()
    sbed.sandbox("run-5")
    assert sbed.open("run-5", user="someone-else").returncode == 0, "Audit lets a forged user through admission"
    status = sbed.phase("open-run-5", SessionPhase.REFUSED)
    assert status["reason"] == Reason.SESSIONS_UNGUARDED
    assert f"{binding} has validationActions ['Audit'], without Deny" in status["message"]
    assert sbed.pods() == [] and sbed.rbac() == []
    # Deny again, but the policy failing open: still refused, saying so.
    sbed.cluster.kubectl(
        "patch", "validatingadmissionpolicybinding", binding, "--type=merge", "-p", patch.replace("Audit", "Deny")
    )
    sbed.cluster.kubectl(
        "patch", "validatingadmissionpolicy", binding, "--type=merge", "-p", '{"spec":{"failurePolicy":"Ignore"}}'
    )
    sbed.cluster.kubectl("delete", c.SESSION_PLURAL, "open-run-5", "-n", sbed.namespace)
    assert sbed.open("run-5").returncode == 0
    status = sbed.phase("open-run-5", SessionPhase.REFUSED, timeout=30)
    assert status["reason"] == Reason.SESSIONS_UNGUARDED and "failurePolicy 'Ignore', not Fail" in status["message"]
    # Restored as the chart has it: served again.
    sbed.cluster.kubectl(
        "patch", "validatingadmissionpolicy", binding, "--type=merge", "-p", '{"spec":{"failurePolicy":"Fail"}}'
    )
    sbed.cluster.kubectl("delete", c.SESSION_PLURAL, "open-run-5", "-n", sbed.namespace)
    assert sbed.open("run-5").returncode == 0
    assert sbed.phase("open-run-5", SessionPhase.PENDING, timeout=30)["reason"] == Reason.SESSION_STARTING


def test_a_session_past_its_users_cap_is_refused_until_one_is_ended(sbed: Bed) -> None:
    # A user of its own: the cap counts a user's sessions in every namespace, and other tests' may still live.
    carol = sbed.editor("carol")
    sbed.controller(f"{c.SESSIONS_MAX_PER_USER.flag}=1")
    for name in ("run-6", "run-7"):
        sbed.sandbox(name)
    assert sbed.open("run-6", as_user=carol).returncode == 0
    sbed.phase("open-run-6", SessionPhase.PENDING)
    assert sbed.open("run-7", as_user=carol).returncode == 0
    status = sbed.phase("open-run-7", SessionPhase.REFUSED)
    assert status["reason"] == Reason.SESSION_LIMIT, status["message"]
    assert f"{sbed.namespace}/open-run-6" in status["message"]
    assert f"kubectl delete {c.SESSION_PLURAL} -n {sbed.namespace} open-run-6" in status["message"]
    assert len(sbed.pods()) == 1
    sbed.cluster.kubectl("delete", c.SESSION_PLURAL, "open-run-6", "open-run-7", "-n", sbed.namespace)
    assert sbed.open("run-7", as_user=carol).returncode == 0
    assert sbed.phase("open-run-7", SessionPhase.PENDING)["reason"] == Reason.SESSION_STARTING


def test_an_image_not_allowed_is_refused_at_create_and_by_the_controller(sbed: Bed) -> None:
    sbed.controller()  # --sessions-image=sandkeep:test, while the chart's policy allows its own default image
    sbed.sandbox("run-8")
    refused = sbed.open("run-8", image="evil/miner:latest")
    assert refused.returncode != 0 and "evil/miner:latest" in refused.stderr
    assert "is not one sessions may run (sessions.allowedImages: " in refused.stderr
    chart_default = sbed.policy_images()[0]
    assert sbed.open("run-8", image=chart_default).returncode == 0, "the policy allows the chart's default"
    status = sbed.phase("open-run-8", SessionPhase.REFUSED)
    assert status["reason"] == Reason.IMAGE_NOT_ALLOWED and "sandkeep:test" in status["message"]
    assert sbed.pods() == []


def test_an_editor_opens_for_themselves_only_and_execs_with_their_own_rbac(sbed: Bed) -> None:
    alice = sbed.editor("alice")
    sbed.sandbox("run-4")
    forged = sbed.open("run-4", user="bob", as_user=alice)
    assert forged.returncode != 0
    assert f'spec.user must be your own user name, "{alice}" (it is "bob")' in forged.stderr
    over = sbed.open("run-4", as_user=alice, lifetime="2h")
    assert over.returncode != 0 and "is over the cap of 1h" in over.stderr
    bad = sbed.open("run-4", as_user=alice, lifetime="soon")
    assert bad.returncode != 0 and "is not a duration" in bad.stderr
    assert sbed.cluster.kubectl("get", c.SESSION_PLURAL, "-n", sbed.namespace, "-o", "name").stdout == ""
    assert sbed.open("run-4", as_user=alice).returncode == 0

    def can(*args: str) -> bool:
        return bool(sbed.cluster.kubectl("auth", "can-i", *args, as_user=alice, check=False).stdout.strip() == "yes")

    assert can("create", c.SESSION_PLURAL, "-n", sbed.namespace)
    assert can("create", "pods/exec", "-n", sbed.namespace), "exec is edit's own pods/exec in the namespace"
    assert not can("create", "pods/exec", "-n", "default"), "and nowhere else"
    assert not can("patch", c.SESSION_PLURAL, "--subresource=status", "-n", sbed.namespace)
    assert sbed.rbac() == []


def test_the_controller_may_run_session_pods_in_any_namespace_and_grants_nothing(sbed: Bed) -> None:
    sa = f"system:serviceaccount:{sbed.namespace}:{sbed.release}-sandkeep-controller"

    def can(*args: str) -> bool:
        return bool(sbed.cluster.kubectl("auth", "can-i", *args, as_user=sa, check=False).stdout.strip() == "yes")

    def allowed(verb: str, what: str) -> bool:
        """RBAC's own answer (a SubjectAccessReview: kubectl's can-i reads a subresource its own way)."""
        resource, _, sub = what.partition("/")
        attributes = {"namespace": sbed.namespace, "verb": verb, "resource": resource, "subresource": sub}
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": sa, "groups": ["system:serviceaccounts"], "resourceAttributes": attributes},
        }
        out = sbed.cluster.kubectl_json("create", "-f", "-", input=json.dumps(review))
        return bool(out["status"].get("allowed"))

    for verb in ("create", "delete", "get", "list"):  # never watch: a session looks at its own Pod
        assert can(verb, "pods", "-n", sbed.namespace) and can(verb, "pods", "-A"), f"the controller cannot {verb} pods"
    for verb, what in (("create", "pods/exec"), ("create", "roles"), ("create", "rolebindings"), ("bind", "roles")):
        assert not allowed(verb, what), f"the controller may {verb} {what}"
    assert can("patch", c.SESSION_PLURAL, "--subresource=status", "-A") and not can("create", c.SESSION_PLURAL, "-A")
    for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
        assert can("get", f"{kind}/{sbed.release}-sandkeep-sessions")
        assert not can("get", f"{kind}/other") and not can("list", kind) and not can("patch", f"{kind}/other")


# --- the agent's half, on real directories -----------------------------------------------------------------
def test_the_agent_reads_a_workspaces_owner_never_through_a_link(tmp_path: Path) -> None:
    # Whom a session runs as (spec.origin's owner, from the sizer): the workspace's own uid and gid, and none
    # when the workspace, or a directory above it, is a link (what a kubelet would follow, and mount).
    from controller.agent.sizer import workspace_stat

    real = tmp_path / "root" / "team" / "run-1" / c.WORKSPACE_DIR
    real.mkdir(parents=True)
    st = real.stat()
    found = workspace_stat(tmp_path / "root", "team", "run-1")
    assert isinstance(found, os.stat_result) and (found.st_dev, found.st_ino) == (st.st_dev, st.st_ino)
    assert (found.st_uid, found.st_gid) == (st.st_uid, st.st_gid)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    swapped = tmp_path / "root" / "team" / "run-2"
    swapped.mkdir()
    (swapped / c.WORKSPACE_DIR).symlink_to(elsewhere)
    assert workspace_stat(tmp_path / "root", "team", "run-2") is None
    (tmp_path / "root" / "linked").symlink_to(tmp_path / "root" / "team")  # a link higher up, too
    assert workspace_stat(tmp_path / "root", "linked", "run-1") is None
    assert workspace_stat(tmp_path / "root", "team", "absent") is None


def test_a_deleted_session_is_torn_down_only_when_it_was_given_a_pod() -> None:
    # Every session's DELETED is seen: only one whose status names a Pod, or whose Pod this process created
    # (its status not written yet), has anything to tear down.
    import asyncio

    from kubernetes import client as k8s

    from controller.api.kube import Kube
    from controller.cluster.session_decide import object_name
    from controller.cluster.sessions import Sessions

    async def main() -> None:
        ours = Sessions(Kube(k8s.Configuration()), SETTINGS, lambda _o, _t: False, lambda _ns: timedelta(hours=1))

        def session(name: str, pod: str | None) -> dict[str, Any]:
            status = {"podNamespace": "team", "podName": pod} if pod else {}
            meta = {"name": name, "namespace": "team", "uid": f"uid-{name}"}
            return {"metadata": meta, "spec": {"sandbox": "sb"}, "status": status}

        ours.started.add(("team", "early"))  # its Pod created here, its status not written yet
        for name, pod in (("started", "session-uid-started"), ("early", None), ("refused", None)):
            ours.on_session("DELETED", session(name, pod))
        assert sorted(ours.gone) == [("team", "early"), ("team", "started")]
        assert not ours.started
        assert ours.gone[("team", "started")] == {object_name(session("started", None))}

    asyncio.run(main())
