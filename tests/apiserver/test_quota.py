"""Quotas per namespace: the pure choice (controller/rules/quota.py) and the controller enforcing it against the
real API server, with the expiry's own guarded DELETE (fresh read, the checks again, uid+resourceVersion)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.agent.decide import candidate, release_priority
from controller.api.kube import Kube
from controller.rules import contracts as c
from controller.rules.objects import namespace_policy
from controller.rules.policy import Ceiling, Policy, Quota, effective_policy
from controller.rules.pressure import Candidate, Disk, Watermarks, choose
from controller.rules.quota import choose as quota_choose
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import condition, instant, metric_value, reasons_for, sandbox, wait_for

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MiB = 1 << 20
HOUR = timedelta(hours=1)


def member(name: str, hour: int, size: int | None = MiB, **kw: Any) -> Candidate:
    return Candidate(("team", name), size, T0 + timedelta(hours=hour), **kw)


# --- pure ----------------------------------------------------------------------------------------------
def test_within_its_quota_a_namespace_releases_nothing() -> None:
    plan = quota_choose(Quota(max_count=3, max_bytes=10 * MiB), [member("a", 1), member("b", 2)])
    assert plan.release == () and plan.within


def test_over_its_count_the_oldest_releasable_go_until_within() -> None:
    found = [member("f", 6), member("a", 1), member("b", 2, pinned=True), member("c", 3, held=True), member("d", 4)]
    found.append(member("e", 5))
    plan = quota_choose(Quota(max_count=3), found)
    assert [k[1] for k in plan.release] == ["a", "d", "e"]
    assert plan.within and plan.after.count == 3


def test_over_its_bytes_only_measured_sandboxes_are_released_and_the_count_is_not_needed() -> None:
    found = [member("unmeasured", 0, size=None), member("a", 1, 3 * MiB), member("b", 2, 3 * MiB)]
    found.append(member("c", 3, 3 * MiB))
    plan = quota_choose(Quota(max_bytes=5 * MiB), found)
    assert [k[1] for k in plan.release] == ["a", "b"]
    assert plan.within and plan.after.bytes == 3 * MiB


def test_sandboxes_already_deleting_count_as_gone() -> None:
    plan = quota_choose(Quota(max_count=1), [member("going", 1, deleting=True), member("kept", 2)])
    assert plan.release == () and plan.within and plan.before.count == 1


def test_pinned_and_held_are_never_released_and_named_when_they_keep_it_over() -> None:
    found = [member("pinned", 1, 9 * MiB, pinned=True), member("held", 2, held=True), member("old", 3)]
    plan = quota_choose(Quota(max_count=1), found)
    assert [k[1] for k in plan.release] == ["old"]
    assert not plan.within
    assert [b.key[1] for b in plan.blocked] == ["pinned", "held"]
    assert "2 sandboxes" in plan.after.words(Quota(max_count=1))


members = st.lists(
    st.builds(
        Candidate,
        key=st.tuples(st.just("team"), st.text("abcdefgh", min_size=1, max_size=4)),
        size=st.one_of(st.none(), st.integers(0, 50 * MiB)),
        deadline=st.one_of(st.none(), st.integers(0, 1000).map(lambda h: T0 + timedelta(hours=h))),
        pinned=st.booleans(),
        held=st.booleans(),
        deleting=st.booleans(),
    ),
    max_size=30,
    unique_by=lambda m: m.key,
)
quotas = st.builds(
    Quota, max_bytes=st.one_of(st.none(), st.integers(0, 200 * MiB)), max_count=st.one_of(st.none(), st.integers(0, 30))
)


@given(quotas, members)
@settings(max_examples=400, deadline=None)
def test_no_quota_ever_releases_a_pinned_held_or_deleting_sandbox_or_more_than_it_must(
    quota: Quota, found: list[Candidate]
) -> None:
    plan = quota_choose(quota, found)
    by_key = {m.key: m for m in found}
    chosen = [by_key[k] for k in plan.release]
    assert not any(m.pinned or m.held or m.deleting for m in chosen)
    assert len(set(plan.release)) == len(plan.release)
    if plan.release:  # it stopped at the first release that brought it within: one fewer would not do
        assert plan.before.over(quota)
        last = chosen[-1]
        before_last = plan.after.__class__(plan.after.count + 1, plan.after.bytes + (last.size or 0))
        assert before_last.over(quota)
    releasable = [m for m in found if not (m.pinned or m.held or m.deleting)]
    if not plan.within:  # it gave up only when nothing releasable that would help was left
        left = [m for m in releasable if m.key not in plan.release]
        count_over = quota.max_count is not None and plan.after.count > quota.max_count
        assert not left or (not count_over and all(m.size is None or m.size == 0 for m in left))


def test_the_quota_is_held_under_the_cluster_ceiling_and_a_namespace_without_one_gets_the_default() -> None:
    default = Policy(72 * HOUR, 30 * 24 * HOUR, quota=Quota(max_count=50))
    ceiling = Ceiling(90 * 24 * HOUR, 90 * 24 * HOUR, Quota(max_bytes=10 * MiB, max_count=100))
    asked = Policy(72 * HOUR, 30 * 24 * HOUR, quota=Quota(max_bytes=None, max_count=500))
    held, reasons = effective_policy(default, ceiling, asked)
    assert held.quota == Quota(max_bytes=10 * MiB, max_count=100) and reasons == (c.Reason.POLICY_CEILING,)
    unasked, _ = effective_policy(default, ceiling, None)
    assert unasked.quota == Quota(max_bytes=10 * MiB, max_count=50)
    spec = {"spec": {"retention": "3d"}}
    from_policy, problems = namespace_policy(spec, default)
    assert from_policy.quota == default.quota and not problems


def test_a_policys_quota_and_priority_are_read_and_bad_values_fall_back_saying_so() -> None:
    default = Policy(72 * HOUR, 30 * 24 * HOUR)
    good, problems = namespace_policy(
        {"spec": {"quota": {"maxBytes": "50Gi", "maxCount": 7}, "releasePriority": "Last"}}, default
    )
    assert good.quota == Quota(50 << 30, 7) and good.release_priority is c.ReleasePriority.LAST and not problems
    bad, problems = namespace_policy({"spec": {"quota": {"maxBytes": "lots", "maxCount": -2}}}, default)
    assert bad.quota == Quota() and len(problems) == 2 and "spec.quota.maxBytes" in problems[0]


def test_a_node_releases_first_the_namespaces_marked_first_and_last_those_marked_last() -> None:
    # The agent reads the priority the controller put in status (it reads no SandboxPolicy).
    def obj(name: str, hour: int, priority: str | None) -> dict[str, Any]:
        status = {"releasePriority": priority} if priority else {}
        spec = {"nodeName": "n", "createdAt": (T0 + timedelta(hours=hour)).isoformat()}
        return {"metadata": {"name": name, "namespace": "ns", "uid": name}, "spec": spec, "status": status}

    objs = [obj("last-oldest", 1, "Last"), obj("normal", 2, None), obj("first-newest", 3, "First")]
    assert [release_priority(o) for o in objs] == [1, 0, -1]
    from controller.node.inuse import Usage

    cands = [candidate(o, 10 * MiB, Usage(False, ()), T0) for o in objs]
    plan = choose(Disk(size=100 * MiB, available=5 * MiB), Watermarks(high=85, low=80), cands)
    assert [k[1] for k in plan.release] == ["first-newest", "normal"]


# --- the controller, against the real API server ---------------------------------------------------------
def policy(cluster: LocalCluster, namespace: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": {"name": "p"}, "spec": spec}
    cluster.apply(body | {"metadata": {"name": "p", "namespace": namespace}})


def make(kube: Kube, cluster: LocalCluster, namespace: str, name: str, hours_ago: float, **status: Any) -> None:
    kube.create_sandbox(namespace, sandbox(name, created=-timedelta(hours=hours_ago)))
    if status:  # what an agent would report (in use, measured size): written on the status subresource
        patch = json.dumps({"status": status})
        cluster.kubectl(
            "patch", c.SANDBOX_SHORT, name, "-n", namespace, "--subresource=status", "--type=merge", "-p", patch
        )


def names(kube: Kube, namespace: str) -> set[str]:
    return {o["metadata"]["name"] for o in kube.list_sandboxes(namespace)}


def test_over_its_count_quota_a_namespace_loses_its_oldest_unpinned_unheld_sandboxes(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    for name, hours in (("a-oldest", 6), ("d", 3), ("e", 2), ("f-newest", 1)):
        make(kube, cluster, namespace, name, hours)
    make(kube, cluster, namespace, "c-held", 4, inUse=True, heldBy=["pid 7 (sleep) cwd"])
    kube.create_sandbox(namespace, sandbox("b-pinned", created=-timedelta(hours=5)))
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "b-pinned", "-n", namespace, f"{c.ANN_PIN_UNTIL}={instant(HOUR)}")
    policy(cluster, namespace, {"retention": "3d", "quota": {"maxCount": 3}})
    ctl = start()
    wait_for("within the quota", lambda: names(kube, namespace) == {"b-pinned", "c-held", "f-newest"}, timeout=30)
    for gone in ("a-oldest", "d", "e"):
        assert c.Reason.QUOTA_EXCEEDED in reasons_for(kube, namespace, gone)
    events = kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    words = next(e["message"] for e in events if e["reason"] == c.Reason.QUOTA_EXCEEDED)
    assert "against a quota of 3 sandboxes" in words and "6 sandboxes" in words
    text = ctl.metrics()
    assert metric_value(text, c.M_DELETIONS_REQUESTED, reason=c.Reason.QUOTA_EXCEEDED) == 3
    assert metric_value(text, c.M_QUOTA_UNRELIEVED, namespace=namespace) == 0


def test_a_bytes_quota_releases_by_measured_size_and_never_an_unmeasured_sandbox(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    make(kube, cluster, namespace, "unmeasured", 9)
    for name, hours in (("a", 3), ("b", 2), ("c", 1)):
        make(kube, cluster, namespace, name, hours, sizeBytes=3 * MiB)
    policy(cluster, namespace, {"quota": {"maxBytes": "5Mi"}})
    start()
    wait_for("within 5Mi", lambda: names(kube, namespace) == {"unmeasured", "c"}, timeout=30)


def test_a_pin_landing_between_the_quota_releases_fresh_read_and_its_delete_wins(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any, tmp_path: Path
) -> None:
    seam = tmp_path / "seam"
    seam.mkdir()
    make(kube, cluster, namespace, "older", 2)
    make(kube, cluster, namespace, "newer", 1)
    policy(cluster, namespace, {"quota": {"maxCount": 1}})
    ctl = start(env={"SANDKEEP_TEST_BEFORE_DELETE_DIR": str(seam)})
    reached = seam / f"{namespace}.older.reached"
    wait_for("the controller at the older one's DELETE", reached.exists, timeout=30)
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "older", "-n", namespace, f"{c.ANN_PIN_UNTIL}={instant(HOUR)}")
    (seam / f"{namespace}.older.go").touch()
    wait_for("the conflict", lambda: "delete_conflict" in ctl.log())
    # Still over its quota, with the older one pinned now: the newer one goes instead.
    wait_for("the newer one at its DELETE", (seam / f"{namespace}.newer.reached").exists, timeout=30)
    (seam / f"{namespace}.newer.go").touch()
    wait_for("only the pinned one left", lambda: names(kube, namespace) == {"older"}, timeout=30)
    assert c.Reason.QUOTA_EXCEEDED not in reasons_for(kube, namespace, "older")


def test_a_namespace_in_dry_run_over_its_quota_is_told_what_would_go_and_keeps_everything(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    for name, hours in (("a", 3), ("b", 2), ("c", 1)):
        make(kube, cluster, namespace, name, hours)
    policy(cluster, namespace, {"dryRun": True, "quota": {"maxCount": 1}, "releasePriority": "First"})
    start()
    for name in ("a", "b"):
        wait_for(f"WouldDelete on {name}", lambda n=name: c.Reason.WOULD_DELETE in reasons_for(kube, namespace, n))
    status = wait_for("the policy in c's status", lambda: (kube.get_sandbox(namespace, "c") or {}).get("status"))
    assert status.get("dryRun") is True and status.get("releasePriority") == "First"
    assert names(kube, namespace) == {"a", "b", "c"}
    assert c.Reason.WOULD_DELETE not in reasons_for(kube, namespace, "c")


def test_a_namespace_over_quota_with_only_pinned_sandboxes_says_so_until_one_is_unpinned(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    for name, hours in (("a", 2), ("b", 1)):
        kube.create_sandbox(namespace, sandbox(name, created=-timedelta(hours=hours)))
        cluster.kubectl("annotate", c.SANDBOX_SHORT, name, "-n", namespace, f"{c.ANN_PIN_UNTIL}={instant(HOUR)}")
    ctl = start("--quota-max-count=1")  # the cluster default quota: this namespace has no policy
    wait_for("the unrelieved gauge", lambda: metric_value(ctl.metrics(), c.M_QUOTA_UNRELIEVED, namespace=namespace))
    assert "quota_unrelieved" in ctl.log() and names(kube, namespace) == {"a", "b"}
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "a", "-n", namespace, f"{c.ANN_PIN_UNTIL}-")
    wait_for("a released", lambda: names(kube, namespace) == {"b"}, timeout=30)
    wait_for("relieved", lambda: metric_value(ctl.metrics(), c.M_QUOTA_UNRELIEVED, namespace=namespace) == 0)


def test_a_policy_quota_above_the_cluster_ceiling_is_held_to_it_and_says_so(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    for name, hours in (("a", 4), ("b", 3), ("c", 2), ("d", 1)):
        make(kube, cluster, namespace, name, hours)
    policy(cluster, namespace, {"quota": {"maxCount": 10}})
    start("--quota-ceiling-count=2")
    wait_for("held to the ceiling of 2", lambda: names(kube, namespace) == {"c", "d"}, timeout=30)
    cond = wait_for("PolicyCeiling", lambda: condition(kube.get_sandbox(namespace, "d"), c.Condition.POLICY_CEILING))
    assert cond["reason"] == c.Reason.POLICY_CEILING
