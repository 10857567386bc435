"""Which of several SandboxPolicies in one namespace applies, and the Active condition each one carries."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from controller.api.kube import CONTROLLER_MANAGER, Kube
from controller.cluster.policyset import in_force, policy_statuses, write_statuses
from controller.rules import contracts as c

NOW = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def policy(name: str, created: str, generation: int = 1, conditions: list[Any] | None = None) -> dict[str, Any]:
    meta = {"name": name, "namespace": "team", "creationTimestamp": created, "generation": generation}
    return {"metadata": meta, "spec": {}, "status": {"conditions": conditions or []}}


def test_the_oldest_policy_applies_not_the_first_by_name():
    policies = {"zz-old": policy("zz-old", "2026-01-01T00:00:00Z"), "aa-new": policy("aa-new", "2026-06-01T00:00:00Z")}
    assert in_force(policies) == "zz-old"


def test_policies_created_in_the_same_second_are_ordered_by_name():
    same = "2026-01-01T00:00:00Z"
    assert in_force({"b": policy("b", same), "a": policy("a", same)}) == "a"


def test_no_policy_applies_in_a_namespace_without_one():
    assert in_force({}) is None


def test_a_lone_policy_is_active_in_force():
    status = policy_statuses("team", {"only": policy("only", "2026-01-01T00:00:00Z", generation=3)}, NOW)["only"]
    assert status["observedGeneration"] == 3
    [cond] = status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (c.PolicyCondition.ACTIVE, "True", c.Reason.IN_FORCE)
    assert "superseded" not in cond["message"]


def test_every_other_policy_is_superseded_and_names_the_one_that_applies():
    policies = {
        "first": policy("first", "2026-01-01T00:00:00Z"),
        "second": policy("second", "2026-02-01T00:00:00Z"),
        "third": policy("third", "2026-03-01T00:00:00Z"),
    }
    statuses = policy_statuses("team", policies, NOW)
    assert statuses["first"]["conditions"][0]["status"] == "True"
    assert "without effect: second, third" in statuses["first"]["conditions"][0]["message"]
    for loser in ("second", "third"):
        cond = statuses[loser]["conditions"][0]
        assert (cond["status"], cond["reason"]) == ("False", c.Reason.SUPERSEDED)
        assert cond["message"].startswith("SandboxPolicy team/first applies instead")


def test_an_unchanged_condition_keeps_its_transition_time_so_reapplying_is_a_no_op():
    then = "2026-05-05T05:05:05Z"
    old = [{"type": "Active", "status": "True", "reason": "InForce", "message": "x", "lastTransitionTime": then}]
    statuses = policy_statuses("team", {"p": policy("p", "2026-01-01T00:00:00Z", conditions=old)}, NOW)
    assert statuses["p"]["conditions"][0]["lastTransitionTime"] == then
    demoted = policy_statuses(
        "team",
        {"p": policy("p", "2026-01-01T00:00:00Z", conditions=old), "o": policy("o", "2025-01-01T00:00:00Z")},
        NOW,
    )
    assert demoted["p"]["conditions"][0]["lastTransitionTime"] != then


# --- against the real API server ---------------------------------------------------------------------------
def _policies(client: Kube, namespace: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in client.list_policies(namespace)}


def test_the_controller_marks_the_oldest_active_and_a_newer_one_superseded_with_no_write_when_steady(
    kube: Kube, kubectl: Any, namespace: str
) -> None:
    # The older policy sorts last by name, so the test tells "oldest applies" from "first by name applies".
    kubectl("create", "-f", "-", input=_policy_manifest(namespace, "zz-team", "3d"))
    time.sleep(1.1)  # creationTimestamp has one-second resolution
    kubectl("create", "-f", "-", input=_policy_manifest(namespace, "aa-late", "1h"))

    assert sorted(write_statuses(kube, namespace, _policies(kube, namespace))) == ["aa-late", "zz-team"]

    header, *rows = kubectl("get", c.POLICY_SHORT, "-n", namespace).stdout.splitlines()
    active_at = header.index("ACTIVE")
    assert {row.split()[0]: row[active_at:].split()[0] for row in rows} == {"zz-team": "True", "aa-late": "False"}
    late = _policies(kube, namespace)["aa-late"]
    [cond] = late["status"]["conditions"]
    assert (cond["reason"], cond["observedGeneration"]) == (c.Reason.SUPERSEDED, 1)
    assert f"SandboxPolicy {namespace}/zz-team applies instead" in cond["message"]
    managers = {(f["manager"], f.get("subresource")) for f in late["metadata"]["managedFields"]}
    assert (CONTROLLER_MANAGER, "status") in managers

    before = {n: p["metadata"]["resourceVersion"] for n, p in _policies(kube, namespace).items()}
    assert write_statuses(kube, namespace, _policies(kube, namespace)) == []  # steady: nothing written
    assert {n: p["metadata"]["resourceVersion"] for n, p in _policies(kube, namespace).items()} == before

    kubectl("delete", c.POLICY_SHORT, "zz-team", "-n", namespace)
    assert write_statuses(kube, namespace, _policies(kube, namespace)) == ["aa-late"]
    [cond] = _policies(kube, namespace)["aa-late"]["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("True", c.Reason.IN_FORCE)


def test_a_policy_deleted_before_its_status_is_written_is_skipped(kube: Kube, kubectl: Any, namespace: str) -> None:
    kubectl("create", "-f", "-", input=_policy_manifest(namespace, "gone", "3d"))
    seen = _policies(kube, namespace)
    kubectl("delete", c.POLICY_SHORT, "gone", "-n", namespace)
    assert write_statuses(kube, namespace, seen) == []


def _policy_manifest(namespace: str, name: str, retention: str) -> str:
    body = {
        "apiVersion": c.API_VERSION,
        "kind": c.POLICY_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"retention": retention},
    }
    return json.dumps(body)
