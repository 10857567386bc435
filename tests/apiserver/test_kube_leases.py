"""controller.api.kube and controller.api.leases against the real API server: the contracts both components use.

Status ownership by server-side apply (two managers never clobber each other), Events that never raise,
guarded patches and deletes, Lease election races (exactly one winner) and the agent heartbeat.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from controller.api.kube import AGENT_MANAGER, CONTROLLER_MANAGER, Kube, KubeError, now_utc
from controller.api.leases import (
    LeaderElector,
    Observed,
    agent_heartbeats,
    agent_stale,
    read_lease,
    release,
    renew_heartbeat,
    try_acquire_or_renew,
)
from controller.rules import contracts as c
from controller.rules.objects import condition as make_condition
from tests.bed.controller_harness import sandbox, wait_for


def test_controller_and_agent_status_applies_never_clobber_each_other(kube: Kube, namespace: str) -> None:
    obj = kube.create_sandbox(namespace, sandbox("shared"))
    expired = make_condition("Expired", False, c.Reason.RETAINED, "kept")
    pinned = make_condition("Pinned", True, c.Reason.PINNED, "pinned")
    controller_status = {"phase": "Pinned", "pinnedUntil": "2030-01-01T00:00:00Z", "conditions": [expired, pinned]}
    kube.apply_status(obj, controller_status, CONTROLLER_MANAGER)
    disk = make_condition("DiskPresent", True, c.Reason.RETAINED, "on disk")
    kube.apply_status(obj, {"sizeBytes": 42, "inUse": False, "conditions": [disk]}, AGENT_MANAGER)
    status = kube.get_sandbox(namespace, "shared")["status"]  # type: ignore[index]
    assert status["phase"] == "Pinned" and status["sizeBytes"] == 42
    assert {cd["type"] for cd in status["conditions"]} == {"Expired", "Pinned", "DiskPresent"}
    # the controller unpins: it stops sending pinnedUntil and its Pinned condition; the agent's stay
    after = kube.apply_status(obj, {"phase": "Retained", "conditions": [expired]}, CONTROLLER_MANAGER)["status"]
    assert "pinnedUntil" not in after and after["sizeBytes"] == 42
    assert {cd["type"] for cd in after["conditions"]} == {"Expired", "DiskPresent"}


def test_a_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    first = make_condition("Expired", False, c.Reason.RETAINED, "a", now=now_utc() - timedelta(hours=1))
    same = make_condition("Expired", False, c.Reason.RETAINED, "b", previous=[first])
    flipped = make_condition("Expired", True, c.Reason.WINDOW, "c", previous=[first])
    assert same["lastTransitionTime"] == first["lastTransitionTime"]
    assert flipped["lastTransitionTime"] != first["lastTransitionTime"]


def test_post_event_never_raises_and_names_the_object(kube: Kube, namespace: str) -> None:
    obj = kube.create_sandbox(namespace, sandbox("evented"))
    kube.post_event(obj, c.Reason.HELD, "held for a test", type="Warning", component="sandkeep-test")
    events = kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    involved = events[0]["involvedObject"]
    assert involved["uid"] == obj["metadata"]["uid"] and involved["resourceVersion"]
    assert events[0]["reason"] == c.Reason.HELD and events[0]["type"] == "Warning"
    ghost = {"metadata": {"name": "x", "namespace": "no-such-namespace-here", "uid": "u"}}
    kube.post_event(ghost, c.Reason.HELD, "goes nowhere")  # a 404 is logged, not raised


def test_stale_patches_and_deletes_get_409(kube: Kube, namespace: str) -> None:
    old = kube.create_sandbox(namespace, sandbox("guarded"))
    new = kube.patch_annotations(old, {c.ANN_PIN_UNTIL: "2030-01-01T00:00:00Z"})
    with pytest.raises(KubeError) as patch_conflict:
        kube.patch_annotations(old, {c.ANN_PIN_UNTIL: None})
    with pytest.raises(KubeError) as delete_conflict:
        kube.delete_sandbox(old)
    assert patch_conflict.value.conflict and delete_conflict.value.conflict
    kube.delete_sandbox(new)
    assert kube.get_sandbox(namespace, "guarded") is None


def test_finalizers_are_added_and_removed_guarded_keeping_others(kube: Kube, namespace: str) -> None:
    body = sandbox("final")
    body["metadata"]["finalizers"] = ["example.com/other"]
    created = kube.create_sandbox(namespace, body)
    obj = kube.add_finalizer(created)
    assert obj["metadata"]["finalizers"] == ["example.com/other", c.FINALIZER]
    assert kube.add_finalizer(obj) is obj
    with pytest.raises(KubeError) as stale_add:
        kube.add_finalizer(created, "example.com/third")
    assert stale_add.value.conflict
    moved = kube.patch_annotations(obj, {"note": "x"})
    with pytest.raises(KubeError) as stale:
        kube.remove_finalizer(obj)
    assert stale.value.conflict
    assert kube.remove_finalizer(moved)["metadata"]["finalizers"] == ["example.com/other"]


def test_two_candidates_racing_for_the_lease_never_both_win(kube: Kube, namespace: str) -> None:
    wins: dict[str, int] = {"a": 0, "b": 0}
    both_rounds = []

    def contend(identity: str, barrier: threading.Barrier, results: dict[str, bool]) -> None:
        barrier.wait()
        results[identity] = try_acquire_or_renew(kube, namespace, "race", identity, 15)

    for _ in range(10):
        results: dict[str, bool] = {}
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=contend, args=(i, barrier, results)) for i in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        both_rounds.append(results)
        for identity, won in results.items():
            wins[identity] += won
    assert all(sum(r.values()) == 1 for r in both_rounds), both_rounds
    holder = read_lease(kube, namespace, "race")
    assert holder is not None and wins[holder.holder or ""] == 10  # the first winner keeps renewing it


def test_an_expired_lease_is_taken_over_and_a_released_one_at_once(kube: Kube, namespace: str) -> None:
    assert try_acquire_or_renew(kube, namespace, "lead", "a", 1)
    seen_by_b = Observed()
    assert not try_acquire_or_renew(kube, namespace, "lead", "b", 1, observed=seen_by_b)
    time.sleep(1.2)
    assert not try_acquire_or_renew(kube, namespace, "lead", "c", 1), "one who never saw it change cannot judge it"
    assert try_acquire_or_renew(kube, namespace, "lead", "b", 15, observed=seen_by_b)
    lease = read_lease(kube, namespace, "lead")
    assert lease is not None and lease.holder == "b" and lease.transitions == 1
    release(kube, namespace, "lead", "b")
    assert try_acquire_or_renew(kube, namespace, "lead", "a", 15)


def test_agent_heartbeat_is_renewed_and_goes_stale(kube: Kube, namespace: str) -> None:
    renew_heartbeat(kube, namespace, "node-x", "agent-x", duration_s=1)
    first = agent_heartbeats(kube, namespace)["node-x"]
    assert not agent_stale(first, now_utc())
    renew_heartbeat(kube, namespace, "node-x", "agent-x", duration_s=1)
    second = agent_heartbeats(kube, namespace)["node-x"]
    assert second.renew_time and first.renew_time and second.renew_time > first.renew_time
    wait_for("the heartbeat to go stale", lambda: agent_stale(agent_heartbeats(kube, namespace)["node-x"], now_utc()))
    assert agent_stale(agent_heartbeats(kube, namespace).get("node-y"), now_utc())


class _Down:
    """An API server this replica can no longer reach: it stops renewing without releasing (a crash)."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        raise KubeError(503, "unreachable (test)", "GET")


def test_replicas_whose_wall_clocks_differ_by_minutes_have_one_acting_leader(kube: Kube, namespace: str) -> None:
    # issue 12, item 12: expiry judged by renewTime vs our own wall clock let a replica whose clock runs
    # ahead steal a live Lease (two acting leaders), and one whose clock runs behind never take over.
    skews = {"behind": -timedelta(minutes=7), "ahead": timedelta(minutes=5), "late": -timedelta(minutes=12)}
    duration, retry = 2, 0.2

    async def scenario() -> list[str]:
        electors = {
            who: LeaderElector(kube, namespace, "skewed", who, duration, retry, wall=lambda s=skew: now_utc() + s)
            for who, skew in skews.items()
        }
        tasks: dict[str, asyncio.Task[None]] = {}
        leaders_seen: list[str] = []

        async def watch(seconds: float, alive: set[str]) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                acting = [w for w in alive if electors[w].is_leader]
                assert len(acting) <= 1, f"two acting leaders: {acting}"
                if acting and (not leaders_seen or leaders_seen[-1] != acting[0]):
                    leaders_seen.append(acting[0])
                await asyncio.sleep(0.02)

        try:
            tasks["behind"] = asyncio.create_task(electors["behind"].run())
            await watch(1.0, {"behind"})
            tasks["ahead"] = asyncio.create_task(electors["ahead"].run())
            await watch(3 * duration, {"behind", "ahead"})  # "ahead" sees "behind" renew and never steals
            electors["behind"].kube = _Down()  # type: ignore[assignment]
            await watch(3 * duration, {"behind", "ahead"})  # "ahead" takes over once it stops changing
            tasks["late"] = asyncio.create_task(electors["late"].run())
            await watch(3 * duration, {"ahead", "late"})  # "late" sees renewTimes in its future, never steals
            electors["ahead"].kube = _Down()  # type: ignore[assignment]
            await watch(3 * duration, {"ahead", "late"})  # ...and still takes over a dead leader in time
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        return leaders_seen

    assert asyncio.run(scenario()) == ["behind", "ahead", "late"]
    lease = read_lease(kube, namespace, "skewed")
    assert lease is not None and lease.transitions == 2, "exactly the two take-overs of a dead leader"
