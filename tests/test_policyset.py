"""Which of several SandboxPolicies in one namespace applies, and the Active condition each one carries."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from controller import contracts as c
from controller.policyset import in_force, policy_statuses

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
