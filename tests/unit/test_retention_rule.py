"""Retention that knows the job (issue 28): windows by outcome, in the one rule. Properties and examples."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from controller.rules import contracts as c
from controller.rules.contracts import DeadlineSource, Outcome, Reason
from controller.rules.durations import format_instant
from controller.rules.models import Manifest, Settings
from controller.rules.objects import namespace_policy, sandbox_facts
from controller.rules.policy import Ceiling, Facts, Policy, Windows, deadline, effective_policy

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)
D = timedelta(days=1)

instants = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))
spans = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=400))
maybe_spans = st.one_of(st.none(), spans)
outcomes = st.one_of(st.none(), st.sampled_from(list(Outcome)))
pins = st.one_of(st.none(), st.just("not-a-time"), instants.map(format_instant))
window_sets = st.builds(Windows, maybe_spans, maybe_spans, maybe_spans)
policies = st.builds(Policy, spans, spans, by_outcome=window_sets)


@st.composite
def facts(draw: st.DrawFn) -> Facts:
    return Facts(
        created_at=draw(st.one_of(st.none(), instants)),
        retain_until=draw(st.one_of(st.none(), instants)),
        pin_until=draw(pins),
        pinned_at=draw(st.one_of(st.none(), st.just("garbage"), instants.map(format_instant))),
        outcome=draw(outcomes),
    )


def _unpinned(f: Facts) -> Facts:
    return Facts(f.created_at, f.retain_until, outcome=f.outcome)


def _not_earlier(later: Policy, earlier: Policy, f: Facts, now: datetime) -> None:
    """The deadline under `later` is never before the one under `earlier`, and never expired where it is not."""
    a, b = deadline(f, earlier, now), deadline(f, later, now)
    if a.deadline is not None:
        assert b.deadline is not None and b.deadline >= a.deadline
    assert a.expired or not b.expired


# --- properties ----------------------------------------------------------------------------------------


@given(facts(), policies, instants)
def test_a_pin_never_shortens_whatever_the_outcome_windows(f: Facts, policy: Policy, now: datetime) -> None:
    with_pin, without = deadline(f, policy, now), deadline(_unpinned(f), policy, now)
    if without.deadline is not None:
        assert with_pin.deadline is not None and with_pin.deadline >= without.deadline
    assert without.expired or not with_pin.expired


@given(facts(), policies, st.sampled_from(list(Outcome)), spans, instants)
def test_a_longer_outcome_window_never_brings_a_deadline_earlier(f, policy, outcome, more, now) -> None:
    own = policy.by_outcome.of(outcome)
    longer = {outcome.lower(): (policy.retention if own is None else own) + more}
    windows = Windows(**{o.lower(): policy.by_outcome.of(o) for o in Outcome} | longer)
    _not_earlier(Policy(policy.retention, policy.max_pin, by_outcome=windows), policy, f, now)


@given(facts(), policies, spans, instants)
def test_a_longer_retention_never_brings_a_deadline_earlier(f: Facts, policy: Policy, more, now) -> None:
    _not_earlier(Policy(policy.retention + more, policy.max_pin, by_outcome=policy.by_outcome), policy, f, now)


@given(facts(), policies, st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=100)), instants)
def test_a_later_created_at_or_retain_until_never_brings_a_deadline_earlier(f: Facts, policy, later, now) -> None:
    base = _unpinned(f)
    for moved in (
        Facts(None if f.created_at is None else f.created_at + later, f.retain_until, outcome=f.outcome),
        Facts(f.created_at, None if f.retain_until is None else f.retain_until + later, outcome=f.outcome),
    ):
        a, b = deadline(base, policy, now), deadline(moved, policy, now)
        if a.deadline is not None:
            assert b.deadline is not None and b.deadline >= a.deadline


@given(facts(), policies, st.sampled_from(list(Outcome)), maybe_spans, instants)
def test_an_outcome_window_changes_only_the_sandboxes_of_that_outcome(f: Facts, policy, outcome, other, now) -> None:
    windows = Windows(**{o.lower(): policy.by_outcome.of(o) for o in Outcome} | {outcome.lower(): other})
    changed = Policy(policy.retention, policy.max_pin, by_outcome=windows)
    if f.outcome is not outcome:
        assert deadline(f, changed, now) == deadline(f, policy, now)


@given(facts(), policies, instants)
def test_the_window_is_the_outcomes_own_else_retention_and_the_earlier_of_retain_until_stays(f, policy, now) -> None:
    verdict = deadline(_unpinned(f), policy, now)
    if f.created_at is None:
        return
    own = policy.by_outcome.of(f.outcome)
    window = policy.retention if own is None else own
    assert policy.window(f.outcome) == window
    expected = f.created_at + window
    if f.retain_until is not None and f.retain_until < expected:
        assert (verdict.deadline, verdict.source) == (f.retain_until, DeadlineSource.RETAIN)
    else:
        assert (verdict.deadline, verdict.source) == (expected, DeadlineSource.WINDOW)


# --- examples ------------------------------------------------------------------------------------------

KEEP_FAILURES = Policy(3 * D, 30 * D, by_outcome=Windows(failed=14 * D, succeeded=timedelta(0)))


def test_failures_are_kept_longer_successes_go_at_once_and_the_rest_take_retention() -> None:
    created = NOW - 5 * D
    assert deadline(Facts(created, outcome=Outcome.FAILED), KEEP_FAILURES, NOW).deadline == created + 14 * D
    success = deadline(Facts(created, outcome=Outcome.SUCCEEDED), KEEP_FAILURES, NOW)
    assert success.expired and success.deadline == created and success.reasons == (Reason.WINDOW,)
    for unset in (Outcome.UNKNOWN, None):
        assert deadline(Facts(created, outcome=unset), KEEP_FAILURES, NOW).deadline == created + 3 * D


def test_retain_until_still_ends_a_failure_earlier_than_its_window() -> None:
    f = Facts(NOW - D, retain_until=NOW + D, outcome=Outcome.FAILED)
    verdict = deadline(f, KEEP_FAILURES, NOW)
    assert (verdict.deadline, verdict.source) == (NOW + D, DeadlineSource.RETAIN)


def test_a_success_whose_window_is_zero_is_still_kept_by_its_pin() -> None:
    f = Facts(NOW - H, pin_until=format_instant(NOW + D), pinned_at=format_instant(NOW - H), outcome=Outcome.SUCCEEDED)
    verdict = deadline(f, KEEP_FAILURES, NOW)
    assert verdict.pinned and not verdict.expired


def test_outcome_windows_are_held_under_the_ceiling_and_say_so() -> None:
    ceiling = Ceiling(30 * D, 60 * D)
    greedy = Policy(3 * D, 7 * D, by_outcome=Windows(failed=365 * D, succeeded=D))
    policy, reasons = effective_policy(Policy(72 * H, 30 * D), ceiling, greedy)
    assert policy.by_outcome == Windows(failed=30 * D, succeeded=D) and reasons == (Reason.POLICY_CEILING,)
    modest = Policy(3 * D, 7 * D, by_outcome=Windows(failed=14 * D))
    assert effective_policy(Policy(72 * H, 30 * D), ceiling, modest) == (modest, ())


def test_a_sandbox_policy_sets_windows_per_outcome_and_each_one_left_out_takes_the_default() -> None:
    default = Policy(72 * H, 30 * D, by_outcome=Windows(failed=7 * D, unknown=2 * D))
    spec = {"retention": "1d", c.RETENTION_BY_OUTCOME: {"failed": "14d", "succeeded": "0"}}
    policy, problems = namespace_policy({"spec": spec}, default)
    assert problems == [] and policy.retention == D
    assert policy.by_outcome == Windows(failed=14 * D, succeeded=timedelta(0), unknown=2 * D)
    bad, problems = namespace_policy({"spec": {c.RETENTION_BY_OUTCOME: {"failed": "soon"}}}, default)
    assert bad.by_outcome == default.by_outcome
    assert problems and problems[0].startswith(f"spec.{c.RETENTION_BY_OUTCOME}.failed")


def test_a_sandbox_and_a_manifest_give_the_rule_their_outcome() -> None:
    obj = {"spec": {"createdAt": format_instant(NOW), "origin": {"pod": "p", "outcome": "Failed"}}}
    assert sandbox_facts(obj).outcome is Outcome.FAILED
    assert sandbox_facts({"spec": {"origin": {"outcome": "Exploded"}}}).outcome is None
    assert sandbox_facts({"spec": {}}).outcome is None
    body = {"namespace": "a", "name": "b", "createdAt": format_instant(NOW), "origin": {"outcome": "Succeeded"}}
    assert Manifest.model_validate(body).facts().outcome is Outcome.SUCCEEDED  # retain --outcome: no Pod
    assert Manifest.model_validate(body | {"origin": None}).facts().outcome is None


def test_the_cluster_settings_set_a_window_per_outcome(monkeypatch) -> None:
    monkeypatch.setenv("SANDKEEP_RETENTION_FAILED", "14d")
    monkeypatch.setenv("SANDKEEP_RETENTION_SUCCEEDED", "1h")
    assert Settings().policy().by_outcome == Windows(failed=14 * D, succeeded=H)
