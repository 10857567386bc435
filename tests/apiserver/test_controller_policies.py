"""SandboxPolicies with a real `sandkeep controller` against the real API server: a shortened policy on existing
sandboxes, a window per outcome, a second policy superseded, and history limits (by group, by CronJob).

The controller's status, pins and expiry are in test_controller.py; the `start` fixture is this folder's
conftest.py, the helpers tests/bed/controller_harness.py.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from controller.api.kube import Kube
from controller.rules import contracts as c
from controller.rules.durations import format_instant, instant_or_none, parse_instant
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import (
    HOUR,
    condition,
    get,
    get_policy,
    gone,
    instant,
    metric_value,
    phase_is,
    sandbox,
    status_of,
    wait_for,
)


def test_a_shortened_policy_applies_to_existing_sandboxes(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    start("--retention=1h")
    # 30 s between the apply and the new deadline: a loaded machine must still show the new deadline first.
    kube.create_sandbox(namespace, sandbox("old", created=-timedelta(seconds=30)))
    first = wait_for("status", lambda: status_of(kube, namespace, "old").get("deadline"))
    policy = {
        "apiVersion": c.API_VERSION,
        "kind": c.POLICY_KIND,
        "metadata": {"name": "short", "namespace": namespace},
        "spec": {"retention": "60s"},
    }
    cluster.apply(policy)
    moved = wait_for(
        "the new deadline", lambda: (d := status_of(kube, namespace, "old").get("deadline")) != first and d
    )
    created = parse_instant(get(kube, namespace, "old")["spec"]["createdAt"])  # type: ignore[index]
    assert moved == format_instant(created + timedelta(seconds=60))  # type: ignore[operator]
    wait_for("the sandbox to be deleted under the new window", lambda: gone(kube, namespace, "old"), timeout=60)


def test_each_outcome_is_kept_for_its_own_window_by_the_settings_and_by_a_policy(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 28: a success goes after the cluster's 3 s, a failure and one without an outcome keep the 1h window
    # until a SandboxPolicy gives failures 2 s; the one without an outcome still takes retention.
    start("--retention=1h", "--retention-succeeded=3s")
    for name, outcome in (("fine", c.Outcome.SUCCEEDED), ("broke", c.Outcome.FAILED), ("plain", None)):
        origin = {} if outcome is None else {"origin": {"pod": f"{name}-pod", "outcome": outcome.value}}
        kube.create_sandbox(namespace, sandbox(name, **origin))
    wait_for("the success to be deleted", lambda: gone(kube, namespace, "fine"), timeout=30)
    for name in ("broke", "plain"):
        status = wait_for(
            "status", lambda n=name: status_of(kube, namespace, n).get("deadline") and status_of(kube, namespace, n)
        )
        created = parse_instant(get(kube, namespace, name)["spec"]["createdAt"])  # type: ignore[index]
        assert (
            status["deadline"] == format_instant(created + HOUR) and status["deadlineSource"] == c.DeadlineSource.WINDOW
        )  # type: ignore[operator]
    cluster.apply(
        {
            "apiVersion": c.API_VERSION,
            "kind": c.POLICY_KIND,
            "metadata": {"name": "failures-briefly", "namespace": namespace},
            "spec": {c.RETENTION_BY_OUTCOME: {"failed": "2s"}},
        }
    )
    wait_for("the failure to be deleted under the policy", lambda: gone(kube, namespace, "broke"), timeout=30)
    assert status_of(kube, namespace, "plain")["phase"] == c.Phase.RETAINED


def test_a_second_policy_is_superseded_and_the_oldest_applies(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    """Two SandboxPolicies in one namespace: the older applies (not the first by name), the newer is marked
    Active=False Superseded by the controller, and deleting the older hands the namespace to the other."""

    def policy(name: str, retention: str) -> dict[str, Any]:
        meta = {"name": name, "namespace": namespace}
        return {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": meta, "spec": {"retention": retention}}

    def active(name: str) -> dict[str, Any] | None:
        return condition(get_policy(kube, namespace, name), c.PolicyCondition.ACTIVE)

    def deadline_is(retention: timedelta) -> bool:
        obj = get(kube, namespace, "run") or {}
        created = instant_or_none(obj.get("spec", {}).get("createdAt"))
        return created is not None and (obj.get("status") or {}).get("deadline") == format_instant(created + retention)

    start("--retention=1h")
    cluster.apply(policy("zz-older", "2h"))
    older = wait_for("the only policy to be Active", lambda: active("zz-older"))
    assert older["status"] == "True" and older["reason"] == c.Reason.IN_FORCE, older
    time.sleep(1.1)  # creationTimestamp counts seconds: the second policy is younger, not tied
    cluster.apply(policy("aa-newer", "3h"))  # first by name, so only its age keeps it from applying
    newer = wait_for(
        "the newer policy to be marked", lambda: (cd := active("aa-newer")) and cd["status"] == "False" and cd
    )
    assert newer["reason"] == c.Reason.SUPERSEDED and f"{namespace}/zz-older applies instead" in newer["message"]
    wait_for(
        "the older to name the superseded one", lambda: "aa-newer" in (active("zz-older") or {}).get("message", "")
    )
    assert active("zz-older")["status"] == "True"  # type: ignore[index]
    kube.create_sandbox(namespace, sandbox("run"))
    wait_for("the older policy's window on the sandbox", lambda: deadline_is(timedelta(hours=2)))
    cluster.kubectl("delete", "sbp", "zz-older", "-n", namespace)
    wait_for("the newer policy to apply", lambda: (cd := active("aa-newer")) and cd["status"] == "True")
    wait_for("its window on the sandbox", lambda: deadline_is(timedelta(hours=3)))


def test_history_limits_release_the_oldest_of_a_group_keep_the_newest_failure_and_never_a_pinned_one(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 28, item 2: one success per job-name group, and the newest failure kept past its 1h window.
    ctl = start("--retention=1h")
    limits = {"groupBy": "job-name", "succeeded": 1, "keepLastFailed": 1}
    cluster.apply(
        {
            "apiVersion": c.API_VERSION,
            "kind": c.POLICY_KIND,
            "metadata": {"name": "history", "namespace": namespace},
            "spec": {c.HISTORY_LIMITS: limits},
        }
    )
    wait_for("the policy to be in force", lambda: condition(get_policy(kube, namespace, "history"), "Active"))

    def run(name: str, outcome: c.Outcome, minutes: int, group: str = "nightly", **meta: Any) -> None:
        origin = {"pod": f"{name}-pod", "outcome": outcome.value, "labels": {"job-name": group}}
        body = sandbox(name, created=-timedelta(minutes=minutes), origin=origin)
        body["metadata"] |= meta
        kube.create_sandbox(namespace, body)

    pin = {c.ANN_PIN_UNTIL: instant(2 * HOUR), c.ANN_PINNED_AT: instant()}
    run("s-old", c.Outcome.SUCCEEDED, 3)
    run("s-pinned", c.Outcome.SUCCEEDED, 2, annotations=pin)
    run("s-new", c.Outcome.SUCCEEDED, 1)
    run("s-other", c.Outcome.SUCCEEDED, 5, group="weekly")
    run("f-old", c.Outcome.FAILED, 120)
    run("f-new", c.Outcome.FAILED, 90)
    for name in ("s-old", "f-old"):
        wait_for(f"{name} to be deleted", lambda n=name: gone(kube, namespace, n), timeout=30)
    kept = phase_is(kube, namespace, "f-new", c.Phase.RETAINED)
    assert kept["deadlineSource"] == c.DeadlineSource.HISTORY and "deadline" not in kept
    assert phase_is(kube, namespace, "s-pinned", c.Phase.PINNED)
    assert phase_is(kube, namespace, "s-new", c.Phase.RETAINED) and phase_is(
        kube, namespace, "s-other", c.Phase.RETAINED
    )
    run("s-newest", c.Outcome.SUCCEEDED, 0)  # s-new is now beyond the limit: decided again from the view alone
    wait_for("s-new to be deleted", lambda: gone(kube, namespace, "s-new"), timeout=30)

    def counted(reason: c.Reason) -> float:
        return metric_value(ctl.metrics(), c.M_DELETIONS_REQUESTED, reason=reason)

    # Counted once the DELETE's answer is back, which can be just after the object is gone.
    wait_for("the two history releases counted", lambda: counted(c.Reason.HISTORY_LIMIT) == 2, timeout=10)
    assert counted(c.Reason.WINDOW) == 1 and counted(c.Reason.HISTORY_LIMIT) == 2
    for name in ("s-pinned", "s-newest", "s-other", "f-new"):
        assert not gone(kube, namespace, name), name


def test_history_limits_by_cronjob_keep_the_newest_run_of_each_cronjob(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 28, item 2: groupBy cronjob (the CRD takes it) groups the runs whose Jobs the CronJob controller named.
    start("--retention=1h")
    body = {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": {"name": "cron", "namespace": namespace}}
    cluster.apply(body | {"spec": {c.HISTORY_LIMITS: {"groupBy": c.GROUP_BY_CRONJOB, "succeeded": 1}}})
    wait_for("the policy to be in force", lambda: condition(get_policy(kube, namespace, "cron"), "Active"))

    def run(name: str, job: str, minutes: int) -> None:
        origin = {"pod": f"{name}-pod", "outcome": "Succeeded", "owner": {"kind": "Job", "name": job}}
        kube.create_sandbox(namespace, sandbox(name, created=-timedelta(minutes=minutes), origin=origin))

    minute = int(time.time()) // 60
    run("older", f"nightly-{minute - 30}", 20)
    run("newer", f"nightly-{minute - 10}", 5)
    run("by-hand", "nightly-build-7", 30)  # not a name the CronJob controller gives: in no group
    wait_for("the older run to be deleted", lambda: gone(kube, namespace, "older"), timeout=30)
    for name in ("newer", "by-hand"):
        assert phase_is(kube, namespace, name, c.Phase.RETAINED), name
