"""The controller's decision without a server: the phase from the verdict and the agent's observations, a status
write only on change, a session's reopen volume, in use, dry run, pins that would shorten or are out of range;
and the bounded backlog of Events. The same against the real API server is in tests/apiserver/test_controller.py.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from controller.api.kube import Kube
from controller.cluster.decide import Context, decide, status_changed
from controller.rules import contracts as c
from controller.rules.durations import format_instant
from controller.rules.objects import reopen_holder
from controller.rules.policy import Policy, deadline, phase_of
from tests.bed.controller_harness import HOUR

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
