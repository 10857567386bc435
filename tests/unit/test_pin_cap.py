"""No annotation stretches a pin past its cap (issue 25, items 1 and 2): properties over whole histories.

A history is a sequence of steps; at each one the clock moves (forward, or back a little: clocks are
stepped), a person writes anything into the pin annotations or removes them, and the controller decides
on the object as it then is, its status replaced by the decision's (as its server-side apply does). After
every step: the deadline is never past max(the window, the time sandkeep first saw the pin in force +
maxPin), and the agent's reading of the object (`pin_holds`) agrees with the controller's verdict.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controller.cluster.decide import Context, decide
from controller.rules import contracts as c
from controller.rules.durations import format_instant, parse_instant
from controller.rules.objects import pin_holds
from controller.rules.policy import Facts, Policy, deadline

START = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
RETENTION = timedelta(hours=2)
MAX_PIN = timedelta(days=1)
POLICY = Policy(RETENTION, MAX_PIN)

instants = st.datetimes(min_value=datetime(1960, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC))
texts = st.one_of(
    instants.map(format_instant),
    st.sampled_from(["garbage", "", "9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z", "2026-11-29T12:00:00.5Z"]),
    st.text(max_size=30),
)
# What a person may do to the object in one step: write or remove either annotation, or nothing.
actions = st.one_of(
    st.tuples(st.sampled_from([c.ANN_PIN_UNTIL, c.ANN_PINNED_AT]), st.one_of(st.none(), texts)),
    st.just(None),
)
ticks = st.timedeltas(min_value=timedelta(minutes=-5), max_value=timedelta(days=3))


def sandbox(annotations: dict[str, str], status: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team-a", "name": "run-1", "annotations": dict(annotations)},
        "spec": {"nodeName": "node-1", "createdAt": format_instant(START)},
        "status": status,
    }


@given(st.lists(st.tuples(ticks, actions), min_size=1, max_size=40))
def test_no_history_of_annotations_keeps_a_sandbox_past_its_cap(history: list[tuple[timedelta, Any]]) -> None:
    now, annotations, status = START, {}, {}
    first_seen: tuple[datetime, datetime] | None = None  # (the pin in force, when it first appeared)
    window = START + RETENTION
    for tick, action in history:
        now += tick
        if action is not None:
            key, value = action
            if value is None:
                annotations.pop(key, None)
            else:
                annotations[key] = value
        pin = parse_instant(annotations.get(c.ANN_PIN_UNTIL))
        if not isinstance(pin, datetime):
            first_seen = None
        elif first_seen is None or first_seen[0] != pin.replace(microsecond=0):
            first_seen = (pin.replace(microsecond=0), now)
        decision = decide(sandbox(annotations, status), Context(POLICY), now)
        status = decision.status
        verdict = decision.verdict
        bound = max(window, first_seen[1] + MAX_PIN) if first_seen is not None else window
        assert verdict.deadline is not None and verdict.deadline <= bound, (verdict, first_seen, now)
        # The agent reads the controller's verdict from the object, never the raw annotation.
        in_force = verdict.holds(now)
        assert pin_holds(sandbox(annotations, status), now) == in_force
        if verdict.pinned and not verdict.expired:
            assert in_force, "a pin that keeps the sandbox also keeps it from release for space"


def test_a_future_pinned_at_no_longer_slides_the_cap_with_the_clock() -> None:
    # The hole: pinned-at in the future made the reference `now` at every look, so the pin never lapsed.
    annotations = {c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z", c.ANN_PINNED_AT: "2098-01-01T00:00:00Z"}
    first = decide(sandbox(annotations, {}), Context(POLICY), START)
    record = {"pinUntil": "2099-01-01T00:00:00Z", "at": format_instant(START)}
    assert first.status["pinSeen"] == record | {"inForceUntil": format_instant(START + MAX_PIN)}
    later = decide(sandbox(annotations, first.status), Context(POLICY), START + 2 * MAX_PIN)
    assert later.verdict.expired and later.verdict.deadline == START + MAX_PIN
    assert not pin_holds(sandbox(annotations, later.status), START + 2 * MAX_PIN)


def test_a_pin_that_does_not_extend_the_deadline_still_keeps_the_sandbox_from_release_for_space() -> None:
    # A pin earlier than the window's end changes no deadline, but the person asked to keep it until then: a
    # quota or disk pressure must not take it first (the agent reads the same answer from status.pinSeen).
    annotations = {c.ANN_PIN_UNTIL: format_instant(START + RETENTION / 2)}
    decision = decide(sandbox(annotations, {}), Context(POLICY), START)
    assert not decision.verdict.pinned and c.Reason.PIN_NO_EFFECT in decision.verdict.reasons
    assert decision.verdict.pin_in_force == START + RETENTION / 2
    assert "pinnedUntil" not in decision.status
    assert pin_holds(sandbox(annotations, decision.status), START + RETENTION / 4)
    assert not pin_holds(sandbox(annotations, decision.status), START + RETENTION / 2)


def test_removing_or_rewriting_pinned_at_after_the_first_sight_changes_nothing() -> None:
    pin = {c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z"}
    status = decide(sandbox(pin, {}), Context(POLICY), START).status
    for forged in ({}, {c.ANN_PINNED_AT: "garbage"}, {c.ANN_PINNED_AT: "2200-01-01T00:00:00Z"}):
        again = decide(sandbox(pin | forged, status), Context(POLICY), START + 3 * MAX_PIN)
        assert again.verdict.deadline == START + MAX_PIN and again.verdict.expired


def test_a_new_pin_is_a_new_pin_first_seen_when_it_changed() -> None:
    # Re-pinning is a person's explicit act (pin-for=72h again): the cap counts from when it changed.
    status = decide(sandbox({c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z"}, {}), Context(POLICY), START).status
    later = START + 5 * MAX_PIN
    repinned = decide(sandbox({c.ANN_PIN_UNTIL: "2099-06-01T00:00:00Z"}, status), Context(POLICY), later)
    assert repinned.verdict.pinned and repinned.verdict.deadline == later + MAX_PIN
    assert repinned.status["pinSeen"]["at"] == format_instant(later)


def test_an_earlier_pinned_at_counts_from_its_time_at_first_sight() -> None:
    # A pin restored with its old pinned-at, or copied from a manifest at adoption, keeps its earlier start:
    # the bounded direction is always taken.
    at = START - timedelta(hours=20)
    annotations = {c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z", c.ANN_PINNED_AT: format_instant(at)}
    decision = decide(sandbox(annotations, {}), Context(POLICY), START)
    assert decision.verdict.deadline == at + MAX_PIN
    assert decision.status["pinSeen"]["at"] == format_instant(at)


def test_one_instant_written_two_ways_is_one_pin() -> None:
    status = decide(sandbox({c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z"}, {}), Context(POLICY), START).status
    same = {c.ANN_PIN_UNTIL: "2099-01-01T01:00:00+01:00"}
    assert decide(sandbox(same, status), Context(POLICY), START + 2 * MAX_PIN).verdict.expired


@given(st.one_of(st.none(), texts), st.one_of(st.none(), texts), instants)
def test_the_rule_without_a_record_never_counts_from_after_now(pin: str | None, pinned_at: str | None, now) -> None:
    verdict = deadline(Facts(START, pin_until=pin, pinned_at=pinned_at), POLICY, now)
    if verdict.pin_seen is not None:
        assert verdict.pin_seen.at <= now
        assert verdict.deadline is not None and verdict.deadline <= max(START + RETENTION, now + MAX_PIN)


def test_the_controllers_view_keeps_the_record_the_cap_counts_from() -> None:
    # The view keeps only what a decision reads: without status.pinSeen in it, every look was a first sight
    # and the cap slid forward by maxPin each time the pin came due (found on the real API server).
    from controller.cluster.view import _slim

    annotations = {c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z"}
    first = decide(sandbox(annotations, {}), Context(POLICY), START)
    viewed = _slim(json.loads(json.dumps(sandbox(annotations, first.status))))  # as it comes back from the server
    assert decide(viewed, Context(POLICY), START + 2 * MAX_PIN).verdict.expired
