"""The controller against the real API server: status, pins by kubectl, expiry, conflict-safe deletes.

Each test runs a real `sandkeep controller` process watching only its own namespace, with windows of a
few seconds. No agent runs here, so no finalizer is on the objects and a DELETE removes them at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.api.kube import Kube, KubeError, policy_path
from controller.cluster.decide import Context, decide, status_changed
from controller.cluster.main import add_arguments, settings_from
from controller.rules import contracts as c
from controller.rules.durations import Invalid, format_instant, instant_or_none, parse_instant
from controller.rules.objects import reopen_holder
from controller.rules.policy import Policy, deadline, phase_of
from hack.apimetrics import settled_writes, writes_by_resource
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import (
    Controller,
    condition,
    instant,
    metric_value,
    reasons_for,
    sandbox,
    wait_for,
)

HOUR = timedelta(hours=1)


@pytest.fixture
def start(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Any]:
    """start(*flags, env=...) -> a leading Controller for this test's namespace; all stopped at the end."""
    started: list[Controller] = []

    def run(*flags: str, env: dict[str, str] | None = None, lead: bool = True) -> Controller:
        log = tmp_path / f"controller-{len(started)}.log"
        ctl = Controller(cluster, namespace, log, *flags, env=env)
        started.append(ctl)
        if lead:
            ctl.wait_leader()
        return ctl

    yield run
    for ctl in started:
        ctl.stop()
        print(f"----- {ctl.log_path.name} (last 80 lines) -----\n" + "\n".join(ctl.log().splitlines()[-80:]))


def get(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get_sandbox(namespace, name)


def get_policy(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    policy: dict[str, Any] = kube.request("GET", policy_path(namespace, name))
    return policy


def status_of(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    return (get(kube, namespace, name) or {}).get("status") or {}


def phase_is(kube: Kube, namespace: str, name: str, phase: c.Phase, timeout: float = 20) -> dict[str, Any]:
    """Wait until the sandbox shows `phase`; return its status."""

    def probe() -> dict[str, Any] | None:
        status = status_of(kube, namespace, name)
        return status if status.get("phase") == phase else None

    return wait_for(f"{namespace}/{name} to be {phase}", probe, timeout)


def gone(kube: Kube, namespace: str, name: str) -> bool:
    return get(kube, namespace, name) is None


# --- pure: the decision and the phase --------------------------------------------------------------------
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def _obj(**ann: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "s", "namespace": "ns", "generation": 1, "annotations": ann},
        "spec": {"nodeName": "n", "createdAt": format_instant(NOW - HOUR)},
    }


def test_phase_follows_the_verdict_and_the_agents_observations() -> None:
    policy = Policy(retention=2 * HOUR, max_pin=timedelta(days=1))
    kept = deadline(_facts(), policy, NOW)
    gone_ = deadline(_facts(), Policy(retention=HOUR / 2, max_pin=HOUR), NOW)
    assert phase_of(kept) is c.Phase.RETAINED
    assert phase_of(gone_) is c.Phase.EXPIRED
    assert phase_of(gone_, in_use=True) is c.Phase.HELD
    assert phase_of(kept, disk_present=False) is c.Phase.LOST
    assert phase_of(gone_, node_gone=True) is c.Phase.LOST
    assert phase_of(gone_, deleting=True, node_gone=True) is c.Phase.DELETING
    assert phase_of(kept, in_session=True) is c.Phase.OPEN
    assert phase_of(gone_, in_session=True) is c.Phase.HELD
    assert phase_of(kept, in_session=True, disk_present=False) is c.Phase.LOST


def _facts() -> Any:
    from controller.rules.objects import sandbox_facts

    return sandbox_facts(_obj())


def test_an_unchanged_sandbox_needs_no_status_write() -> None:
    ctx = Context(Policy(retention=2 * HOUR, max_pin=timedelta(days=1)))
    first = decide(_obj(), ctx, NOW)
    shown = _obj() | {"status": first.status}
    later = decide(shown, ctx, NOW + timedelta(minutes=5))
    assert not status_changed(shown, later.status)
    assert first.wake_at == NOW + HOUR and not first.delete


def _session(namespace: str = "ns", pod: str = c.SESSION_POD_PREFIX + "u-1") -> dict[str, Any]:
    """The status the agent reports while a session's Pod mounts the sandbox: its reopen volume holds it."""
    return {"inUse": True, "heldBy": [reopen_holder(namespace, pod)]}


def test_a_sessions_reopen_volume_opens_a_sandbox_keeps_its_pin_and_holds_it_past_its_deadline() -> None:
    until = format_instant(NOW + 3 * HOUR)
    pinned = _obj(**{c.ANN_PIN_UNTIL: until}) | {"status": _session()}
    decision = decide(pinned, Context(Policy(retention=2 * HOUR, max_pin=timedelta(days=1))), NOW)
    assert decision.phase is c.Phase.OPEN and decision.status["pinnedUntil"] == until
    assert any(cd["type"] == c.Condition.PINNED and cd["status"] == "True" for cd in decision.status["conditions"])
    expired = decide(_obj() | {"status": pinned["status"]}, Context(Policy(retention=HOUR / 2, max_pin=HOUR)), NOW)
    assert expired.phase is c.Phase.HELD and not expired.delete
    short = Context(Policy(retention=HOUR / 2, max_pin=HOUR))
    # Another Pod's reopen volume, or a session Pod's of another namespace, holds it (in use) but does not open it.
    for status in (_session(pod="build-1"), _session(namespace="elsewhere")):
        other = decide(_obj() | {"status": status}, short, NOW)
        assert other.phase is c.Phase.HELD and not other.delete
    # A Verified entry an agent wrote before sessions mounted through the CSI driver is read no more: it
    # would have opened (and held) the sandbox until someone cleared it.
    stale = {"sessions": [{"pod": "p", "podUID": "u-1", "mount": c.MountCheck.VERIFIED}]}
    assert decide(_obj() | {"status": stale}, short, NOW).delete


def test_an_expired_sandbox_in_use_is_held_not_deleted() -> None:
    obj = _obj() | {"status": {"inUse": True}}
    decision = decide(obj, Context(Policy(retention=HOUR / 2, max_pin=HOUR)), NOW)
    assert decision.phase is c.Phase.HELD and not decision.delete


def test_dry_run_decides_but_never_deletes() -> None:
    decision = decide(_obj(), Context(Policy(retention=HOUR / 2, max_pin=HOUR, dry_run=True)), NOW)
    assert decision.phase is c.Phase.EXPIRED and not decision.delete
    assert {cd["type"]: cd["reason"] for cd in decision.status["conditions"]}["DryRun"] == c.Reason.WOULD_DELETE


def test_a_pin_that_would_shorten_retention_has_no_effect_and_says_so() -> None:
    # pin-for=0 (settled into pin-until=now) and a mistyped year: the window stands, nothing is deleted.
    ctx = Context(Policy(retention=2 * HOUR, max_pin=timedelta(days=1)))
    for pin in (format_instant(NOW), "2025-06-01T12:00:00Z"):
        decision = decide(_obj(**{c.ANN_PIN_UNTIL: pin, c.ANN_PINNED_AT: format_instant(NOW)}), ctx, NOW)
        assert decision.phase is c.Phase.RETAINED and not decision.delete
        assert decision.status["deadline"] == format_instant(NOW + HOUR) and "pinnedUntil" not in decision.status
        pinned = {cd["type"]: cd for cd in decision.status["conditions"]}["Pinned"]
        assert (pinned["status"], pinned["reason"]) == ("False", c.Reason.PIN_NO_EFFECT)
        assert "no effect" in pinned["message"] and "write a later time" in pinned["message"]


def test_an_out_of_range_pin_is_invalid_and_the_sandbox_still_expires() -> None:
    # issue 12, item 4: decide() raised OverflowError on this pin on every reconcile, so it was never deleted.
    obj = _obj(**{c.ANN_PIN_UNTIL: "0001-01-01T00:00:00+01:00"})
    decision = decide(obj, Context(Policy(retention=HOUR / 2, max_pin=HOUR)), NOW)
    assert decision.delete and decision.phase is c.Phase.EXPIRED
    valid = {cd["type"]: cd for cd in decision.status["conditions"]}["PinValid"]
    assert valid["reason"] == c.Reason.INVALID_PIN and "out of range" in valid["message"]


# --- against the API server -------------------------------------------------------------------------------
def test_flags_override_the_env_and_durations_are_read_the_human_way(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments("controller", parser)
    monkeypatch.setenv("SANDKEEP_NODE_GRACE", "5m")
    monkeypatch.setenv("SANDKEEP_RETENTION", "2d")
    settings = settings_from(parser.parse_args(["--retention=1h30m", "--watch-namespace=a", "--watch-namespace=b"]))
    assert settings.retention == timedelta(hours=1, minutes=30) and settings.node_grace == timedelta(minutes=5)
    assert settings.watch_namespaces == ("a", "b") and settings.dry_run is False
    with pytest.raises(ValueError, match="node_grace"):
        settings_from(parser.parse_args(["--node-grace=5 minutes"]))
    monkeypatch.setenv("SANDKEEP_MAX_PIN", "forever")
    with pytest.raises(ValueError, match="max_pin"):
        settings_from(parser.parse_args([]))


def test_creating_a_sandbox_sets_its_status(kube: Kube, namespace: str, start: Any) -> None:
    start("--retention=1h")
    created = kube.create_sandbox(namespace, sandbox("run-1", created=-timedelta(minutes=5)))
    status = wait_for(
        "status", lambda: status_of(kube, namespace, "run-1").get("phase") and status_of(kube, namespace, "run-1")
    )
    expected = parse_instant(created["spec"]["createdAt"]) + HOUR  # type: ignore[operator]
    assert status["phase"] == c.Phase.RETAINED
    assert status["deadline"] == format_instant(expected)
    assert status["deadlineSource"] == c.DeadlineSource.WINDOW
    assert condition({"status": status}, "Expired")["status"] == "False"  # type: ignore[index]
    assert "pinnedUntil" not in status
    wait_for("a Retained event", lambda: c.Reason.RETAINED in reasons_for(kube, namespace, "run-1"))


def test_kubectl_pin_for_moves_the_deadline_and_pins(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    start("--retention=1h")
    kube.create_sandbox(namespace, sandbox("run-2"))
    wait_for("status", lambda: status_of(kube, namespace, "run-2").get("phase") == c.Phase.RETAINED)
    before = datetime.now(UTC).replace(microsecond=0)
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "run-2", "-n", namespace, f"{c.ANN_PIN_FOR}=72h")
    status = phase_is(kube, namespace, "run-2", c.Phase.PINNED)
    obj = get(kube, namespace, "run-2")
    assert obj is not None
    ann = obj["metadata"]["annotations"]
    assert c.ANN_PIN_FOR not in ann, "pin-for is converted once and removed"
    pin_until = parse_instant(ann[c.ANN_PIN_UNTIL])
    assert isinstance(pin_until, datetime)
    assert before + timedelta(hours=72) <= pin_until <= datetime.now(UTC) + timedelta(hours=72)
    assert c.ANN_PINNED_AT in ann
    assert status["deadline"] == status["pinnedUntil"] == ann[c.ANN_PIN_UNTIL]
    assert status["deadlineSource"] == c.DeadlineSource.PIN
    wait_for("a Pinned event", lambda: c.Reason.PINNED in reasons_for(kube, namespace, "run-2"))


def test_unpinning_restores_the_window(kube: Kube, cluster: LocalCluster, namespace: str, start: Any) -> None:
    start("--retention=1h")
    created = kube.create_sandbox(namespace, sandbox("run-3"))
    window = format_instant(parse_instant(created["spec"]["createdAt"]) + HOUR)  # type: ignore[operator]
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "run-3", "-n", namespace, f"{c.ANN_PIN_UNTIL}={instant(48 * HOUR)}")
    wait_for("Pinned", lambda: status_of(kube, namespace, "run-3").get("phase") == c.Phase.PINNED)
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "run-3", "-n", namespace, f"{c.ANN_PIN_UNTIL}-")
    status = wait_for(
        "Retained", lambda: (s := status_of(kube, namespace, "run-3")).get("phase") == c.Phase.RETAINED and s
    )
    assert status["deadline"] == window and "pinnedUntil" not in status
    obj = get(kube, namespace, "run-3")
    wait_for(
        "pinned-at cleared",
        lambda: c.ANN_PINNED_AT not in ((get(kube, namespace, "run-3") or {})["metadata"].get("annotations") or {}),
    )
    assert obj is not None
    wait_for("an Unpinned event", lambda: c.Reason.UNPINNED in reasons_for(kube, namespace, "run-3"))


def test_a_pin_longer_than_max_pin_is_capped_and_says_so(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    start("--retention=1h", "--max-pin=2h")
    kube.create_sandbox(namespace, sandbox("run-cap"))
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "run-cap", "-n", namespace, f"{c.ANN_PIN_FOR}=30d")
    status = wait_for(
        "Pinned", lambda: (s := status_of(kube, namespace, "run-cap")).get("phase") == c.Phase.PINNED and s
    )
    pinned = parse_instant(status["pinnedUntil"])
    assert isinstance(pinned, datetime) and pinned <= datetime.now(UTC) + 2 * HOUR
    assert condition({"status": status}, "Pinned")["reason"] == c.Reason.PIN_CAPPED  # type: ignore[index]
    wait_for("a PinCapped event", lambda: c.Reason.PIN_CAPPED in reasons_for(kube, namespace, "run-cap"))


def test_a_forged_future_pinned_at_cannot_keep_a_pin_past_its_cap(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 25: pinned-at written in the future made the cap slide with now, so the pin never lapsed. The
    # cap now counts from the controller's own record (status.pinSeen, kept by the real CRD's schema), so
    # rewriting pinned-at again and again changes nothing: the sandbox goes once first sight + maxPin passes.
    start("--retention=1s", "--max-pin=6s")
    body = sandbox("forged")
    body["metadata"]["annotations"] = {c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z", c.ANN_PINNED_AT: "2098-01-01T00:00:00Z"}
    kube.create_sandbox(namespace, body)
    status = phase_is(kube, namespace, "forged", c.Phase.PINNED)
    seen = status["pinSeen"]
    assert seen["pinUntil"] == "2099-01-01T00:00:00Z"
    first_sight = parse_instant(seen["at"])
    assert isinstance(first_sight, datetime) and first_sight <= datetime.now(UTC)
    assert status["pinnedUntil"] == format_instant(first_sight + timedelta(seconds=6))
    for year in (2097, 2096):  # the person keeps rewriting it
        stamp = f"{c.ANN_PINNED_AT}={year}-01-01T00:00:00Z"
        cluster.kubectl("annotate", c.SANDBOX_SHORT, "forged", "-n", namespace, "--overwrite", stamp, check=False)
    wait_for("the capped pin to lapse and the sandbox to go", lambda: gone(kube, namespace, "forged"), timeout=30)
    assert datetime.now(UTC) >= first_sight + timedelta(seconds=6)


def test_an_invalid_pin_gives_a_condition_and_an_event_and_no_pin(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    start("--retention=1h")
    kube.create_sandbox(namespace, sandbox("bad-until"))
    kube.create_sandbox(namespace, sandbox("bad-for"))
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "bad-until", "-n", namespace, f"{c.ANN_PIN_UNTIL}=next-tuesday")
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "bad-for", "-n", namespace, f"{c.ANN_PIN_FOR}=forever")
    for name, annotation in (("bad-until", c.ANN_PIN_UNTIL), ("bad-for", c.ANN_PIN_FOR)):
        cond = wait_for("PinValid=False", lambda n=name: condition(get(kube, namespace, n), "PinValid"))
        assert cond["status"] == "False" and cond["reason"] == c.Reason.INVALID_PIN
        assert annotation in cond["message"] and "not pinned" in cond["message"]
        assert status_of(kube, namespace, name)["phase"] == c.Phase.RETAINED
        assert "pinnedUntil" not in status_of(kube, namespace, name)
        wait_for("an InvalidPin event", lambda n=name: c.Reason.INVALID_PIN in reasons_for(kube, namespace, n))
        warning = [
            e
            for e in kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
            if e["reason"] == c.Reason.INVALID_PIN and e["involvedObject"]["name"] == name
        ]
        assert warning[0]["type"] == "Warning"


def test_pin_for_zero_and_a_past_pin_keep_the_window_with_a_condition_and_an_event(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    start("--retention=1h")
    kube.create_sandbox(namespace, sandbox("zero"))
    kube.create_sandbox(namespace, sandbox("past"))
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "zero", "-n", namespace, f"{c.ANN_PIN_FOR}=0")
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "past", "-n", namespace, f"{c.ANN_PIN_UNTIL}=2025-01-01T00:00:00Z")
    for name in ("zero", "past"):
        cond = wait_for(
            "Pinned=False PinNoEffect",
            lambda n=name: (
                (cd := condition(get(kube, namespace, n), "Pinned")) and cd["reason"] == c.Reason.PIN_NO_EFFECT and cd
            ),
        )
        assert cond["status"] == "False" and "no effect" in cond["message"]
        status = status_of(kube, namespace, name)
        assert status["phase"] == c.Phase.RETAINED and status["deadlineSource"] == c.DeadlineSource.WINDOW
        wait_for("a PinNoEffect event", lambda n=name: c.Reason.PIN_NO_EFFECT in reasons_for(kube, namespace, n))
    time.sleep(1)
    assert not gone(kube, namespace, "zero") and not gone(kube, namespace, "past")


def test_an_expired_sandbox_is_deleted(kube: Kube, namespace: str, start: Any) -> None:
    ctl = start("--retention=3s")
    kube.create_sandbox(namespace, sandbox("short"))
    wait_for("the sandbox to be deleted", lambda: gone(kube, namespace, "short"), timeout=20)
    # one Event per expiry: why (the Expired condition's words) and the version the DELETE was guarded on
    wait_for("the Event", lambda: c.Reason.DELETE_REQUESTED in reasons_for(kube, namespace, "short"))
    assert c.Reason.EXPIRED not in reasons_for(kube, namespace, "short")
    text = ctl.metrics()
    assert metric_value(text, c.M_DELETIONS_REQUESTED, reason=c.Reason.WINDOW) == 1
    assert metric_value(text, c.M_EXPIRY_LAG + "_count") == 1
    assert metric_value(text, c.M_LEADER) == 1


def test_a_wave_of_expiries_posts_ten_events_and_one_that_names_the_rest(
    kube: Kube, namespace: str, start: Any
) -> None:
    # issue 31, item 3: a mass expiry's DeleteRequested Events are aggregated as client-go aggregates the
    # kubelet's: the first AGGREGATE_AFTER of a window one by one, the rest in one Event at its end, counted
    # and named; every sandbox is deleted and accounted for exactly once.
    from controller.cluster.events import AGGREGATE_AFTER

    names = [f"wave-{i:02d}" for i in range(3 * AGGREGATE_AFTER)]
    for name in names:
        kube.create_sandbox(namespace, sandbox(name, created=-HOUR))
    start("--retention=1s")
    wait_for("every sandbox deleted", lambda: all(gone(kube, namespace, n) for n in names), timeout=60)

    def accounted() -> tuple[list[str], list[dict[str, Any]]] | None:
        items = kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        ours = [e for e in items if e["reason"] == c.Reason.DELETE_REQUESTED]
        combined = [e for e in ours if e["message"].startswith("(combined from similar events)")]
        single = [e["involvedObject"]["name"] for e in ours if e not in combined]
        folded = sum(int(e["message"].split(": ", 1)[1].split()[0]) for e in combined)
        return (single, combined) if len(single) + folded == len(names) else None

    single, combined = wait_for("the aggregated Event", accounted, timeout=30)
    assert len(single) == AGGREGATE_AFTER and len(set(single)) == len(single)
    listed = {n for e in combined for n in e["message"].rsplit(": ", 1)[1].split(", ")}
    assert set(single) | listed == set(names) and not set(single) & listed
    assert all("expired (Window); delete requested" in e["message"] for e in combined)


def test_the_controller_exports_controller_runtimes_reconcile_and_workqueue_series(
    kube: Kube, namespace: str, start: Any
) -> None:
    # Issue 26 item 7: the series every SRE dashboard for Go operators reads, scraped from the real process.
    ctl = start("--retention=1h")
    kube.create_sandbox(namespace, sandbox("kept"))  # its status written, the key asked for again in an hour
    kube.create_sandbox(namespace, sandbox("counted", created=-timedelta(hours=2)))  # deleted at once
    wait_for("the sandbox to be deleted", lambda: gone(kube, namespace, "counted"), timeout=20)
    wait_for("the other one Retained", lambda: status_of(kube, namespace, "kept").get("phase") == c.Phase.RETAINED)

    def idle(text: str) -> bool:  # the last reconcile done, nothing waiting
        work = metric_value(text, c.M_WORKQUEUE_WORK_DURATION + "_count", name=c.Queue.CONTROLLER)
        total = sum(
            metric_value(text, c.M_RECONCILE_TOTAL, controller=c.Queue.CONTROLLER, result=r) for r in c.ReconcileResult
        )
        return work == total and metric_value(text, c.M_WORKQUEUE_UNFINISHED, name=c.Queue.CONTROLLER) == 0

    text = wait_for("the controller's queue idle", lambda: t if idle(t := ctl.metrics()) else None)
    mine = {"controller": c.Queue.CONTROLLER}
    waited = metric_value(text, c.M_RECONCILE_TOTAL, **mine, result=c.ReconcileResult.REQUEUE_AFTER)
    assert waited >= 1, "kept until its deadline: the key asked for again then (requeue_after)"
    assert metric_value(text, c.M_RECONCILE_TOTAL, **mine, result=c.ReconcileResult.SUCCESS) >= 1, "the DELETE"
    assert metric_value(text, c.M_RECONCILE_TOTAL, **mine, result=c.ReconcileResult.ERROR) == 0
    reconciles = sum(metric_value(text, c.M_RECONCILE_TOTAL, **mine, result=r) for r in c.ReconcileResult)
    assert metric_value(text, c.M_RECONCILE_TIME + "_count", **mine) == reconciles
    queue = {"name": c.Queue.CONTROLLER, "controller": c.Queue.CONTROLLER}
    assert metric_value(text, c.M_WORKQUEUE_WORK_DURATION + "_count", **queue) == reconciles
    assert metric_value(text, c.M_WORKQUEUE_QUEUE_DURATION + "_count", **queue) == reconciles, "each taken once"
    assert metric_value(text, c.M_WORKQUEUE_ADDS, **queue) == reconciles
    assert metric_value(text, c.M_WORKQUEUE_RETRIES, **queue) >= 1, "the deadline's delayed add"
    assert metric_value(text, c.M_WORKQUEUE_DEPTH, **queue, priority="0") == 0, "due in an hour: not in the queue"
    for priority in ("0", "1"):
        assert f'{c.M_WORKQUEUE_DEPTH}{{controller="controller",name="controller",priority="{priority}"}} 0.0' in text
    assert metric_value(text, c.M_WORKQUEUE_LONGEST, **queue) == 0
    assert f'{c.M_WORKQUEUE_DEPTH}{{controller="quota",name="quota",priority="0"}}' in text, "every queue is named"


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


@pytest.mark.parametrize("where", ["flag", "namespace-policy"])
def test_dry_run_deletes_nothing_and_posts_would_delete(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any, where: str
) -> None:
    if where == "flag":
        start("--retention=2s", "--dry-run")
    else:
        spec = {"retention": "2s", "dryRun": True}
        policy = {
            "apiVersion": c.API_VERSION,
            "kind": c.POLICY_KIND,
            "metadata": {"name": "dry", "namespace": namespace},
            "spec": spec,
        }
        cluster.apply(policy)
        start("--retention=1h")
    kube.create_sandbox(namespace, sandbox("kept"))
    cond = wait_for("DryRun condition", lambda: condition(get(kube, namespace, "kept"), "DryRun"), timeout=20)
    assert cond["reason"] == c.Reason.WOULD_DELETE
    wait_for("a WouldDelete event", lambda: c.Reason.WOULD_DELETE in reasons_for(kube, namespace, "kept"))
    time.sleep(1.5)  # a delete would have followed the status write within milliseconds
    assert status_of(kube, namespace, "kept")["phase"] == c.Phase.EXPIRED
    assert c.Reason.DELETE_REQUESTED not in reasons_for(kube, namespace, "kept")


def test_a_pin_landing_between_the_decision_and_the_delete_wins(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any, tmp_path: Path
) -> None:
    seam = tmp_path / "seam"
    seam.mkdir()
    ctl = start("--retention=2s", env={"SANDKEEP_TEST_BEFORE_DELETE_DIR": str(seam)})
    kube.create_sandbox(namespace, sandbox("contested"))
    reached = seam / f"{namespace}.contested.reached"
    wait_for("the controller at its DELETE", reached.exists, timeout=20)
    read_version = reached.read_text()
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "contested", "-n", namespace, f"{c.ANN_PIN_UNTIL}={instant(HOUR)}")
    (seam / f"{namespace}.contested.go").touch()
    wait_for("the conflict", lambda: "delete_conflict" in ctl.log())
    status = wait_for(
        "Pinned", lambda: (s := status_of(kube, namespace, "contested")).get("phase") == c.Phase.PINNED and s
    )
    assert status["deadlineSource"] == c.DeadlineSource.PIN
    obj = get(kube, namespace, "contested")
    assert obj is not None and obj["metadata"]["resourceVersion"] != read_version
    assert c.Reason.DELETE_REQUESTED not in reasons_for(kube, namespace, "contested")


def test_randomized_pins_racing_expiring_deletes_never_lose_a_pinned_sandbox(
    kube: Kube, namespace: str, start: Any
) -> None:
    # 240 sandboxes expire over ~4 s; each gets one pin (a plain merge patch, as kubectl annotate sends)
    # at a random moment around its own deadline. A pin the API server accepted on a live object must
    # keep that object; a pin that came after the DELETE finds nothing (404). Both must happen.
    retention = 6.0
    count = 240
    rng = random.Random(20261129)
    ctl = start(f"--retention={int(retention)}s", "--workers=8")
    plan: dict[str, float] = {}  # name -> when, relative to its deadline, its pin is sent
    began = datetime.now(UTC)
    bodies = []
    for i in range(count):
        offset = rng.uniform(0.0, 4.0)  # its deadline is created + retention = began + offset + (a few s)
        name = f"r-{i:03d}"
        bodies.append(sandbox(name, created=timedelta(seconds=offset - retention + 3)))
        plan[name] = rng.uniform(-0.3, 1.2)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda b: kube.create_sandbox(namespace, b), bodies))
    created = {b["metadata"]["name"]: parse_instant(b["spec"]["createdAt"]) for b in bodies}
    outcome: dict[str, str] = {}
    lock = threading.Lock()

    def pin(name: str) -> None:
        due = created[name] + timedelta(seconds=retention)  # type: ignore[operator]
        time.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds() + plan[name]))
        body = {"metadata": {"annotations": {c.ANN_PIN_UNTIL: instant(HOUR)}}}
        try:
            result = kube.request(
                "PATCH", _path(namespace, name), body=body, content_type="application/merge-patch+json"
            )
            state = "deleting" if result["metadata"].get("deletionTimestamp") else "pinned"
        except KubeError as err:
            assert err.not_found, err
            state = "too-late"
        with lock:
            outcome[name] = state

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(pin, list(plan)))
    pinned = [n for n, s in outcome.items() if s == "pinned"]
    late = [n for n, s in outcome.items() if s == "too-late"]
    assert len(outcome) == count
    print(f"race: {len(pinned)} pins landed on live objects, {len(late)} came after the DELETE")
    print("controller expiry lag:", [ln for ln in ctl.metrics().splitlines() if "lag_seconds_" in ln][:16])
    time.sleep(2)  # every unpinned deadline is behind us: the controller acts well within that
    survivors = {o["metadata"]["name"] for o in kube.list_sandboxes(namespace)}
    lost_pins = [n for n in pinned if n not in survivors]
    assert lost_pins == [], f"pinned sandboxes deleted: {lost_pins}"
    assert pinned and late, f"the race did not happen both ways (pinned {len(pinned)}, late {len(late)}, began {began})"
    wait_for(
        "every pinned survivor to show Pinned",
        lambda: all(status_of(kube, namespace, n).get("phase") == c.Phase.PINNED for n in pinned),
        timeout=20,
    )


def _path(namespace: str, name: str) -> str:
    from controller.api.kube import sandbox_path

    return sandbox_path(namespace, name)


def test_the_controller_adds_no_finalizer_and_no_kopf_annotations(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    start("--retention=1h")
    for name in ("clean-a", "clean-b"):
        kube.create_sandbox(namespace, sandbox(name))
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "clean-b", "-n", namespace, f"{c.ANN_PIN_FOR}=2h")
    wait_for("Pinned", lambda: status_of(kube, namespace, "clean-b").get("phase") == c.Phase.PINNED)
    wait_for("Retained", lambda: status_of(kube, namespace, "clean-a").get("phase") == c.Phase.RETAINED)
    for obj in kube.list_sandboxes(namespace):
        meta = obj["metadata"]
        assert not meta.get("finalizers"), meta
        assert all(k.startswith(f"{c.GROUP}/") for k in meta.get("annotations") or {}), meta.get("annotations")
        assert "kopf" not in str(meta.get("annotations")) + str(obj.get("status"))
        managers = {(f["manager"], f.get("subresource", "")) for f in meta["managedFields"]}
        status_writers = {m for m, sub in managers if sub == "status"}
        assert status_writers == {"sandkeep-controller"}, managers


def test_steady_state_makes_no_writes(kube: Kube, cluster: LocalCluster, namespace: str, start: Any) -> None:
    start("--retention=1h")
    names = [f"quiet-{i}" for i in range(20)]
    for name in names:
        kube.create_sandbox(namespace, sandbox(name))
    cluster.kubectl("annotate", c.SANDBOX_SHORT, "quiet-0", "-n", namespace, f"{c.ANN_PIN_FOR}=2h")
    for policy in ("one", "two"):  # two: one Active, one Superseded, and neither status written again
        meta = {"name": policy, "namespace": namespace}
        cluster.apply(
            {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": meta, "spec": {"retention": "1h"}}
        )
    wait_for("every status", lambda: all(status_of(kube, namespace, n).get("phase") for n in names))
    wait_for("the pin", lambda: status_of(kube, namespace, "quiet-0").get("phase") == c.Phase.PINNED)
    wait_for(
        "both policies' status",
        lambda: all(condition(get_policy(kube, namespace, p), c.PolicyCondition.ACTIVE) for p in ("one", "two")),
    )
    before = settled_writes(cluster.metrics_text, WRITTEN)  # in-flight Events (posted from their own pool) land first
    assert before is not None, "the write counters never settled for 1s within 30s"
    time.sleep(6)
    after = _writes(cluster.metrics_text())
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
    assert before, "the reading saw no writes at all: the filter is wrong"


WRITTEN = (c.SANDBOX_PLURAL, c.POLICY_PLURAL, "events")  # what the controller writes (its Lease apart)


def _writes(text: str) -> dict[str, float]:
    return {r: n for r, n in writes_by_resource(text).items() if r in WRITTEN}


def test_a_sandbox_on_a_vanished_node_is_lost_and_never_hangs_in_terminating(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    node = f"{namespace}-n"
    cluster.create_node(node, ready=True)
    start("--retention=1h", "--node-grace=2s")
    kube.create_sandbox(namespace, sandbox("on-live", node=node))
    kube.create_sandbox(namespace, sandbox("on-nothing", node=f"{namespace}-never"))
    wait_for("Lost", lambda: status_of(kube, namespace, "on-nothing").get("phase") == c.Phase.LOST, timeout=20)
    assert condition(get(kube, namespace, "on-nothing"), "Lost")["reason"] == c.Reason.NODE_GONE  # type: ignore[index]
    wait_for("a Lost event", lambda: c.Reason.LOST in reasons_for(kube, namespace, "on-nothing"))
    assert status_of(kube, namespace, "on-live")["phase"] == c.Phase.RETAINED
    # the agent's finalizer is on it, as on every adopted sandbox; then the node goes away
    patch = {"metadata": {"finalizers": [c.FINALIZER]}}
    cluster.kubectl("patch", c.SANDBOX_SHORT, "on-live", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    cluster.kubectl("delete", "node", node)
    wait_for("Lost", lambda: status_of(kube, namespace, "on-live").get("phase") == c.Phase.LOST, timeout=20)
    cluster.kubectl("delete", c.SANDBOX_SHORT, "on-live", "-n", namespace, "--wait=false")
    wait_for("the finalizer released and the object gone", lambda: gone(kube, namespace, "on-live"), timeout=20)
    wait_for("a FinalizerRemoved event", lambda: c.Reason.FINALIZER_REMOVED in reasons_for(kube, namespace, "on-live"))


def test_a_standby_takes_over_within_30s_of_the_leader_being_killed(kube: Kube, namespace: str, start: Any) -> None:
    first = start("--retention=1h", "--identity=replica-a")
    second = start("--retention=1h", "--identity=replica-b", lead=False)
    time.sleep(3)
    assert "leader_elected" not in second.log(), "two leaders at once"
    kube.create_sandbox(namespace, sandbox("before"))
    wait_for("the leader's status", lambda: status_of(kube, namespace, "before").get("phase"))
    assert "object=" + namespace + "/before" not in second.log(), "the standby wrote"
    first.kill()  # SIGKILL: no release of the Lease, the standby must wait it out
    killed = time.monotonic()
    kube.create_sandbox(namespace, sandbox("after"))
    wait_for("the standby to act", lambda: status_of(kube, namespace, "after").get("phase"), timeout=30)
    took = time.monotonic() - killed
    assert took < 30, took
    assert "leader_elected" in second.log()
    print(f"failover took {took:.1f}s")


def test_an_expired_sandbox_the_agent_sees_in_use_is_held_until_released(
    kube: Kube, namespace: str, start: Any
) -> None:
    from controller.api.kube import AGENT_MANAGER

    start("--retention=3s")
    obj = kube.create_sandbox(namespace, sandbox("busy"))
    kube.apply_status(obj, {"inUse": True, "heldBy": ["pid 4242 (cwd)"]}, AGENT_MANAGER)
    status = phase_is(kube, namespace, "busy", c.Phase.HELD)
    assert status["inUse"] is True and status["heldBy"] == ["pid 4242 (cwd)"], "the agent's fields were kept"
    wait_for("a Held event", lambda: c.Reason.HELD in reasons_for(kube, namespace, "busy"))
    time.sleep(1)
    assert not gone(kube, namespace, "busy")
    kube.apply_status(obj, {"inUse": False}, AGENT_MANAGER)
    wait_for("the released sandbox to be deleted", lambda: gone(kube, namespace, "busy"))


def test_past_its_hard_end_no_pin_or_session_keeps_a_sandbox_and_only_a_live_user_holds_it(
    kube: Kube, namespace: str, start: Any
) -> None:
    # Issue 28, item 4: with maxAge 8 s, a pinned sandbox and one a session has open go at their hard end; one
    # the agent sees in use is Held, says MaxAge and is counted, and goes once released.
    from controller.api.kube import AGENT_MANAGER

    ctl = start("--retention=1h", "--max-age=8s")
    pinned = sandbox("pinned")
    pinned["metadata"]["annotations"] = {c.ANN_PIN_UNTIL: instant(2 * HOUR), c.ANN_PINNED_AT: instant()}
    kube.create_sandbox(namespace, pinned)
    open_ = kube.create_sandbox(namespace, sandbox("open"))
    kube.apply_status(open_, {"inUse": False, "heldBy": [reopen_holder(namespace, "session-x")]}, AGENT_MANAGER)
    busy = kube.create_sandbox(namespace, sandbox("busy"))
    kube.apply_status(busy, {"inUse": True, "heldBy": ["pid 4242 (cwd)"]}, AGENT_MANAGER)
    status = phase_is(kube, namespace, "pinned", c.Phase.PINNED, timeout=6)
    created = parse_instant(get(kube, namespace, "pinned")["spec"]["createdAt"])  # type: ignore[index]
    assert status["deadlineSource"] == c.DeadlineSource.MAX_AGE
    assert status["deadline"] == status["pinnedUntil"] == format_instant(created + timedelta(seconds=8))  # type: ignore[operator]
    for name in ("pinned", "open"):
        wait_for(f"{name} to be deleted at its hard end", lambda n=name: gone(kube, namespace, n), timeout=30)
    held = phase_is(kube, namespace, "busy", c.Phase.HELD)
    expired = next(cd for cd in held["conditions"] if cd["type"] == c.Condition.EXPIRED)
    assert expired["reason"] == c.Reason.MAX_AGE and "hard end" in expired["message"]
    wait_for("the gauge", lambda: metric_value(ctl.metrics(), c.M_PAST_MAX_AGE, namespace=namespace) == 1)
    assert metric_value(ctl.metrics(), c.M_DELETIONS_REQUESTED, reason=c.Reason.MAX_AGE) == 2
    kube.apply_status(busy, {"inUse": False}, AGENT_MANAGER)
    wait_for("the released sandbox to be deleted", lambda: gone(kube, namespace, "busy"))
    wait_for("the gauge back to 0", lambda: metric_value(ctl.metrics(), c.M_PAST_MAX_AGE, namespace=namespace) == 0)


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


def test_warn_before_gives_a_condition_and_one_event_before_the_deadline(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 28, item 3: 10 s before its 20 s deadline the sandbox says ExpiringSoon, in a condition and an Event.
    start("--retention=1h")
    spec = {"retention": "20s", c.WARN_BEFORE: "10s"}
    cluster.apply(
        {
            "apiVersion": c.API_VERSION,
            "kind": c.POLICY_KIND,
            "metadata": {"name": "warn", "namespace": namespace},
            "spec": spec,
        }
    )
    wait_for("the policy to be in force", lambda: condition(get_policy(kube, namespace, "warn"), "Active"))
    kube.create_sandbox(namespace, sandbox("soon"))
    soon = wait_for(
        "ExpiringSoon", lambda: condition(get(kube, namespace, "soon"), c.Condition.EXPIRING_SOON), timeout=30
    )
    assert soon["status"] == "True" and soon["reason"] == c.Reason.EXPIRING_SOON
    assert get(kube, namespace, "soon")["status"]["phase"] == c.Phase.RETAINED  # type: ignore[index]
    wait_for("the Event", lambda: c.Reason.EXPIRING_SOON in reasons_for(kube, namespace, "soon"))
    wait_for("the sandbox to be deleted", lambda: gone(kube, namespace, "soon"), timeout=30)
    assert reasons_for(kube, namespace, "soon").count(c.Reason.EXPIRING_SOON) == 1


class Receiver:
    """A warnWebhook receiver on loopback: answers 500 to its first `failures` notices, then 200; with `hang`
    it never answers. Keeps every request's path and JSON body."""

    def __init__(self, failures: int = 0, hang: bool = False) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.requests.append((self.path, body))
                if hang:
                    receiver.released.wait(60)
                    return
                self.send_response(500 if len(receiver.requests) <= failures else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/sandkeep?token=s3cret"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def _warn_policy(cluster: LocalCluster, kube: Kube, namespace: str, url: str, retention: str) -> None:
    spec = {"retention": retention, c.WARN_BEFORE: "4s", c.WARN_WEBHOOK: {"url": url}}
    body = {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": {"name": "warn", "namespace": namespace}}
    cluster.apply(body | {"spec": spec})
    wait_for("the policy to be in force", lambda: condition(get_policy(kube, namespace, "warn"), "Active"))


def _due(kube: Kube, namespace: str, name: str) -> datetime:
    due = parse_instant(phase_is(kube, namespace, name, c.Phase.RETAINED)["deadline"])
    assert not isinstance(due, Invalid)
    return due


def _lateness(kube: Kube, namespace: str, name: str, due: datetime) -> float:
    """Wait for the sandbox to go; return how late it went after its deadline `due`, in seconds."""
    wait_for(f"{name} to be deleted", lambda: gone(kube, namespace, name), timeout=30, interval=0.05)
    return (datetime.now(UTC) - due).total_seconds()


def test_a_warn_webhook_gets_one_notice_retried_past_two_failures(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Issue 28, item 3: at ExpiringSoon the policy's webhook gets one JSON notice; a receiver that fails twice
    # gets it on the third attempt (1 s and 2 s later), and the logs name its host, never its path or query.
    receiver = Receiver(failures=2)
    try:
        ctl = start("--retention=1h")
        _warn_policy(cluster, kube, namespace, receiver.url, retention="12s")
        kube.create_sandbox(
            namespace, sandbox("soon", origin={"pod": "p", "outcome": "Succeeded", "labels": {"job-name": "nightly"}})
        )
        due = _due(kube, namespace, "soon")
        wait_for("the notice to be accepted", lambda: len(receiver.requests) >= 3, timeout=30)
        assert _lateness(kube, namespace, "soon", due) < 3
        paths = {path for path, _ in receiver.requests}
        assert paths == {"/hooks/sandkeep?token=s3cret"} and len(receiver.requests) == 3
        notice = receiver.requests[-1][1]
        assert notice["kind"] == c.WARN_NOTICE_KIND == c.Reason.EXPIRING_SOON
        assert (notice["namespace"], notice["name"], notice["node"]) == (namespace, "soon", "node-a")
        assert notice["deadlineSource"] == c.DeadlineSource.WINDOW and notice["deadline"] == format_instant(due)
        assert "within warnBefore" in notice["message"] and notice["origin"]["labels"] == {"job-name": "nightly"}
        text = ctl.metrics()
        assert metric_value(text, c.M_WARN_NOTICES, result=c.NoticeResult.SENT) == 1
        assert metric_value(text, c.M_WARN_NOTICES, result=c.NoticeResult.RETRIED) == 2
        log = ctl.log()
        assert f"host=127.0.0.1:{receiver.server.server_port}" in log and "warn_notice_sent" in log
        assert "s3cret" not in log and "/hooks" not in log
    finally:
        receiver.close()


def test_a_warn_webhook_that_is_down_never_delays_the_deletion(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # Nothing listens at the webhook's port: the notice is retried in the background and the sandbox still goes
    # at its deadline.
    receiver = Receiver()
    url = receiver.url
    receiver.close()  # its port now refuses connections
    ctl = start("--retention=1h")
    _warn_policy(cluster, kube, namespace, url, retention="8s")
    kube.create_sandbox(namespace, sandbox("soon"))
    assert _lateness(kube, namespace, "soon", _due(kube, namespace, "soon")) < 3
    assert metric_value(ctl.metrics(), c.M_WARN_NOTICES, result=c.NoticeResult.RETRIED) >= 2
    assert metric_value(ctl.metrics(), c.M_WARN_NOTICES, result=c.NoticeResult.SENT) == 0
    assert "warn_notice_retried" in ctl.log() and "s3cret" not in ctl.log()


def test_a_warn_webhook_that_hangs_is_cut_off_by_the_timeout_and_delays_nothing(
    kube: Kube, cluster: LocalCluster, namespace: str, start: Any
) -> None:
    # A receiver that takes the request and never answers: each attempt ends at --warn-webhook-timeout, and
    # the deletion is on time meanwhile.
    receiver = Receiver(hang=True)
    try:
        ctl = start("--retention=1h", "--warn-webhook-timeout=1s")
        _warn_policy(cluster, kube, namespace, receiver.url, retention="8s")
        kube.create_sandbox(namespace, sandbox("soon"))
        due = _due(kube, namespace, "soon")
        wait_for("the first attempt", lambda: receiver.requests, timeout=20)
        asked = time.monotonic()
        wait_for("the second attempt", lambda: len(receiver.requests) >= 2, timeout=10)
        assert time.monotonic() - asked < 1 + 1 + 4  # the timeout, the first backoff, slack (unbounded: 60 s)
        assert _lateness(kube, namespace, "soon", due) < 3
        assert "timed out" in ctl.log() and metric_value(ctl.metrics(), c.M_WARN_NOTICES, result="retried") >= 1
    finally:
        receiver.close()


def test_the_events_backlog_is_bounded_and_what_is_dropped_is_counted() -> None:
    # A mass expiry against a slow API server: Events wait in a backlog of at most EVENTS_BACKLOG; past it
    # a new Event is dropped and counted, so memory does not grow with the wave (client-go bounds its own).
    from kubernetes import client as k8s

    from controller.cluster.controller import Controller
    from controller.cluster.events import EVENTS_BACKLOG
    from controller.cluster.settings import ControllerSettings
    from controller.observe.metrics import ControllerMetrics

    answered = threading.Event()

    class SlowServer(Kube):
        def post_event(self, *_args: Any, **_kwargs: Any) -> None:
            answered.wait(30)

    rec = Controller(SlowServer(k8s.Configuration()), ControllerSettings(), ControllerMetrics())
    obj = _obj()

    async def wave() -> None:
        for _ in range(EVENTS_BACKLOG + 250):
            rec.events.post(obj, c.Reason.EXPIRED, "expired", "Normal")
        assert len(rec.events.backlog) == EVENTS_BACKLOG
        answered.set()
        while rec.events.backlog:
            await asyncio.sleep(0.01)

    asyncio.run(wave())
    assert rec.metrics.events_dropped._value.get() == 250
