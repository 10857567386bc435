"""The one expiry rule: properties (hypothesis) and one example per clause."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import assume, given
from hypothesis import strategies as st

from controller.rules.contracts import DeadlineSource, Reason
from controller.rules.durations import format_instant
from controller.rules.models import Manifest
from controller.rules.policy import Ceiling, Facts, Policy, deadline, effective_policy

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)
D = timedelta(days=1)

instants = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))
windows = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=400))
pins = st.one_of(st.none(), st.just("not-a-time"), instants.map(format_instant))


@st.composite
def facts(draw: st.DrawFn) -> Facts:
    return Facts(
        created_at=draw(st.one_of(st.none(), instants)),
        retain_until=draw(st.one_of(st.none(), instants)),
        pin_until=draw(pins),
        pinned_at=draw(st.one_of(st.none(), st.just("garbage"), instants.map(format_instant))),
    )


# --- properties ----------------------------------------------------------------------------------------


@given(facts(), windows, windows, instants, st.integers(min_value=1, max_value=10**6))
def test_a_pinned_unexpired_sandbox_is_never_expired(f: Facts, retention, max_pin, now, ahead_s) -> None:
    # A valid pin in the future, set in the past and within maxPin of when it was set: kept, whatever else says.
    assume(max_pin > timedelta(seconds=ahead_s))
    pinned_at = now - timedelta(seconds=ahead_s // 2)
    pin = now + timedelta(seconds=ahead_s // 2 + 1)
    assume(pin - pinned_at <= max_pin)
    sandbox = Facts(f.created_at, f.retain_until, format_instant(pin), format_instant(pinned_at))
    verdict = deadline(sandbox, Policy(retention, max_pin), now.replace(microsecond=0))
    assert not verdict.expired and verdict.deadline is not None and verdict.deadline >= pin.replace(microsecond=0)
    assert verdict.pinned or Reason.PIN_NO_EFFECT in verdict.reasons


def _unpinned(f: Facts) -> Facts:
    return Facts(f.created_at, f.retain_until)


@given(facts(), windows, windows, instants)
def test_a_pin_only_ever_extends(f: Facts, retention, max_pin, now) -> None:
    # Whatever the pin says (zero, past, capped, garbage), the deadline is never earlier than without it.
    policy = Policy(retention, max_pin)
    with_pin, without = deadline(f, policy, now), deadline(_unpinned(f), policy, now)
    if with_pin.expired:
        assert without.expired
    if without.deadline is not None:
        assert with_pin.deadline is not None and with_pin.deadline >= without.deadline


@given(facts(), windows, windows, instants)
def test_a_valid_pin_that_does_not_extend_says_it_has_no_effect(f: Facts, retention, max_pin, now) -> None:
    verdict = deadline(f, Policy(retention, max_pin), now)
    valid_pin = f.pin_until is not None and Reason.INVALID_PIN not in verdict.reasons
    if valid_pin and not verdict.pinned:
        assert Reason.PIN_NO_EFFECT in verdict.reasons
        assert any("no effect" in m for m in verdict.messages)
        assert verdict.pinned_until is None
    if verdict.pinned:
        assert Reason.PIN_NO_EFFECT not in verdict.reasons


any_instants = st.datetimes(
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=14)), timezone(-timedelta(hours=12))])
)
any_spans = st.timedeltas(min_value=timedelta(0))
rfc3339_ish = st.from_regex(
    r"\A[0-9]{4}-[0-1][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:[0-5][0-9](Z|[+-][0-2][0-9]:[0-5][0-9])\Z"
)


@given(
    st.one_of(st.none(), any_instants),
    st.one_of(st.none(), any_instants),
    st.one_of(st.none(), rfc3339_ish, st.text(max_size=30)),
    st.one_of(st.none(), rfc3339_ish, st.text(max_size=30)),
    any_spans,
    any_spans,
    any_instants,
)
def test_the_rule_is_total_on_any_times_and_any_spans(created, retain, pin, pinned_at, retention, max_pin, now):
    # Year 1 and year 9999, offsets, timedelta.max: the rule answers, it never raises (issue 12, item 4).
    verdict = deadline(Facts(created, retain, pin, pinned_at), Policy(retention, max_pin), now)
    assert verdict.expired or verdict.deadline is not None


@given(facts(), windows, windows, windows, instants)
def test_shortening_the_window_never_extends_a_deadline(f: Facts, a, b, max_pin, now) -> None:
    short, long_ = sorted((a, b))
    v_short = deadline(f, Policy(short, max_pin), now)
    v_long = deadline(f, Policy(long_, max_pin), now)
    if v_short.deadline is not None and v_long.deadline is not None:
        assert v_short.deadline <= v_long.deadline
    assert v_short.expired or not v_long.expired


@given(facts(), windows, windows, instants, st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=800)))
def test_the_verdict_is_monotonic_in_now(f: Facts, retention, max_pin, t1, later) -> None:
    policy = Policy(retention, max_pin)
    if deadline(f, policy, t1).expired:
        assert deadline(f, policy, t1 + later).expired


@given(facts(), windows, windows, instants)
def test_an_expired_verdict_always_says_why(f: Facts, retention, max_pin, now) -> None:
    verdict = deadline(f, Policy(retention, max_pin), now)
    if verdict.expired:
        assert verdict.reasons
        assert verdict.reasons[-1] in {Reason.PIN_EXPIRED, Reason.WINDOW, Reason.RETAIN_UNTIL, Reason.NO_CREATED_AT}


# --- one example per clause ----------------------------------------------------------------------------


def test_the_window_decides_when_nothing_else_is_set() -> None:
    policy = Policy(72 * H, 30 * D)
    young = deadline(Facts(NOW - 71 * H), policy, NOW)
    assert (young.deadline, young.source, young.expired) == (NOW + H, DeadlineSource.WINDOW, False)
    old = deadline(Facts(NOW - 73 * H), policy, NOW)
    assert old.expired and old.reasons == (Reason.WINDOW,)


def test_a_deadline_equal_to_now_is_expired() -> None:
    assert deadline(Facts(NOW - 72 * H), Policy(72 * H, 30 * D), NOW).expired


def test_the_earlier_of_retain_until_and_the_window_wins() -> None:
    policy = Policy(72 * H, 30 * D)
    recorded_shorter = deadline(Facts(NOW - H, retain_until=NOW + H), policy, NOW)
    assert (recorded_shorter.deadline, recorded_shorter.source) == (NOW + H, DeadlineSource.RETAIN)
    window_shorter = deadline(Facts(NOW - H, retain_until=NOW + 10 * D), policy, NOW)
    assert (window_shorter.deadline, window_shorter.source) == (NOW + 71 * H, DeadlineSource.WINDOW)
    expired = deadline(Facts(NOW - H, retain_until=NOW - 1 * H), policy, NOW)
    assert expired.expired and expired.reasons == (Reason.RETAIN_UNTIL,)


def test_retention_zero_expires_every_unpinned_sandbox_but_not_a_pinned_one() -> None:
    off = Policy(timedelta(0), 30 * D)
    assert deadline(Facts(NOW), off, NOW).expired
    assert deadline(Facts(NOW - timedelta(seconds=1), retain_until=NOW + D), off, NOW).expired
    pinned = deadline(Facts(NOW, pin_until=format_instant(NOW + D), pinned_at=format_instant(NOW)), off, NOW)
    assert pinned.pinned and not pinned.expired


def test_no_created_at_is_expired() -> None:
    verdict = deadline(Facts(None, retain_until=NOW + D), Policy(72 * H, 30 * D), NOW)
    assert verdict.expired and verdict.deadline is None
    assert verdict.source is DeadlineSource.NONE and verdict.reasons == (Reason.NO_CREATED_AT,)


def test_a_valid_pin_wins_over_an_expired_window() -> None:
    f = Facts(
        NOW - 100 * D, retain_until=NOW - 90 * D, pin_until=format_instant(NOW + D), pinned_at=format_instant(NOW)
    )
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert (verdict.deadline, verdict.source, verdict.expired) == (NOW + D, DeadlineSource.PIN, False)
    assert verdict.pinned_until == NOW + D


def test_a_pin_that_extended_and_lapsed_is_expired() -> None:
    f = Facts(NOW - 80 * H, pin_until=format_instant(NOW - timedelta(seconds=1)), pinned_at=format_instant(NOW - D))
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert verdict.expired and verdict.reasons == (Reason.PIN_EXPIRED,)


def test_a_past_pin_inside_the_window_has_no_effect_and_says_so() -> None:
    # A typo in the year: the sandbox keeps its window, it is not deleted at once.
    f = Facts(NOW - H, pin_until="2025-11-29T12:00:00Z", pinned_at=format_instant(NOW))
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert (verdict.deadline, verdict.source, verdict.expired) == (NOW + 71 * H, DeadlineSource.WINDOW, False)
    assert verdict.reasons == (Reason.PIN_NO_EFFECT,) and verdict.pinned_until is None
    assert "2025-11-29T12:00:00Z has no effect" in verdict.messages[0]


def test_pin_for_zero_has_no_effect() -> None:
    # The controller turns pin-for=0 into pin-until=now: keeps the window, never "delete now".
    f = Facts(NOW - H, pin_until=format_instant(NOW), pinned_at=format_instant(NOW))
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert not verdict.expired and verdict.source is DeadlineSource.WINDOW
    assert Reason.PIN_NO_EFFECT in verdict.reasons


def test_a_pin_capped_below_the_window_has_no_effect() -> None:
    f = Facts(NOW - H, pin_until=format_instant(NOW + 365 * D), pinned_at=format_instant(NOW))
    verdict = deadline(f, Policy(72 * H, timedelta(0)), NOW)
    assert not verdict.expired and verdict.reasons == (Reason.PIN_NO_EFFECT, Reason.PIN_CAPPED)


def test_an_out_of_range_pin_is_invalid_not_a_crash() -> None:
    # issue 12, item 4: this pin made decide() raise OverflowError on every reconcile, so nothing was deleted.
    f = Facts(NOW - 73 * H, pin_until="0001-01-01T00:00:00+01:00", pinned_at="9999-12-31T23:59:59-01:00")
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert verdict.expired and verdict.reasons == (Reason.INVALID_PIN, Reason.WINDOW)
    assert "out of range" in verdict.messages[0]


def test_a_created_at_at_the_end_of_time_does_not_overflow_the_window() -> None:
    far = datetime.max.replace(tzinfo=UTC)
    verdict = deadline(Facts(far, retain_until=far), Policy(timedelta.max, timedelta.max), NOW)
    assert not verdict.expired and verdict.deadline == far


def test_an_invalid_pin_is_no_pin_and_is_reported() -> None:
    verdict = deadline(Facts(NOW - 73 * H, pin_until="next tuesday"), Policy(72 * H, 30 * D), NOW)
    assert verdict.expired and not verdict.pinned
    assert verdict.reasons == (Reason.INVALID_PIN, Reason.WINDOW)
    assert any("next tuesday" in m for m in verdict.messages)
    kept = deadline(Facts(NOW - H, pin_until="2026-13-01T00:00:00Z"), Policy(72 * H, 30 * D), NOW)
    assert not kept.expired and kept.source is DeadlineSource.WINDOW and Reason.INVALID_PIN in kept.reasons


def test_a_pin_longer_than_max_pin_is_capped_from_when_it_was_set() -> None:
    f = Facts(NOW, pin_until=format_instant(NOW + 365 * D), pinned_at=format_instant(NOW - D))
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert verdict.deadline == NOW + 29 * D and Reason.PIN_CAPPED in verdict.reasons
    assert verdict.pinned_until == NOW + 29 * D
    assert any("capped" in m for m in verdict.messages)


def test_a_forged_future_pinned_at_cannot_stretch_the_cap() -> None:
    f = Facts(NOW, pin_until=format_instant(NOW + 365 * D), pinned_at=format_instant(NOW + 300 * D))
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert verdict.deadline == NOW + 30 * D and Reason.PIN_CAPPED in verdict.reasons


def test_a_garbage_pinned_at_counts_from_now() -> None:
    f = Facts(NOW, pin_until=format_instant(NOW + 365 * D), pinned_at="yesterday")
    assert deadline(f, Policy(72 * H, 30 * D), NOW).deadline == NOW + 30 * D


def test_a_capped_pin_expires_once_the_cap_passes() -> None:
    f = Facts(NOW - 40 * D, pin_until=format_instant(NOW + 365 * D), pinned_at=format_instant(NOW - 31 * D))
    verdict = deadline(f, Policy(72 * H, 30 * D), NOW)
    assert verdict.expired and verdict.reasons == (Reason.PIN_CAPPED, Reason.PIN_EXPIRED)


def test_a_manifest_feeds_the_rule_and_a_bad_created_at_is_expired() -> None:
    good = Manifest.model_validate(
        {"namespace": "a", "name": "b", "createdAt": format_instant(NOW - H), "keepUntil": format_instant(NOW + D)}
    )
    assert deadline(good.facts(), Policy(timedelta(0), 30 * D), NOW).pinned
    bad = Manifest.model_validate({"namespace": "a", "name": "b", "createdAt": "last week"})
    assert deadline(bad.facts(), Policy(72 * H, 30 * D), NOW).reasons == (Reason.NO_CREATED_AT,)


# --- effective policy ----------------------------------------------------------------------------------


def test_effective_policy_holds_a_namespace_under_the_ceiling_and_says_so() -> None:
    default, ceiling = Policy(72 * H, 30 * D), Ceiling(90 * D, 60 * D)
    assert effective_policy(default, ceiling) == (default, ())
    mine = Policy(7 * D, 14 * D)
    assert effective_policy(default, ceiling, mine) == (mine, ())
    greedy = Policy(365 * D, 365 * D)
    assert effective_policy(default, ceiling, greedy) == (Policy(90 * D, 60 * D), (Reason.POLICY_CEILING,))


def test_a_cluster_wide_dry_run_cannot_be_turned_off_by_a_namespace() -> None:
    default, ceiling = Policy(72 * H, 30 * D, dry_run=True), Ceiling(90 * D, 60 * D)
    policy, _ = effective_policy(default, ceiling, Policy(D, D, dry_run=False))
    assert policy.dry_run
    ns_dry, _ = effective_policy(Policy(72 * H, 30 * D), ceiling, Policy(D, D, dry_run=True))
    assert ns_dry.dry_run
