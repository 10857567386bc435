"""Retention that knows the job (issue 28): windows by outcome and the hard end, in the one rule and the
controller's decision. Properties and examples."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from controller.cli.doctor import Report, build_report
from controller.cli.kubectl_plugin import ls_row
from controller.cluster.decide import Context, decide, status_changed, transition_events
from controller.rules import contracts as c
from controller.rules.contracts import DeadlineSource, Outcome, Phase, Reason
from controller.rules.durations import format_instant
from controller.rules.models import Manifest, Settings
from controller.rules.objects import namespace_policy, reopen_holder, sandbox_facts
from controller.rules.policy import Ceiling, Facts, Policy, Windows, deadline, effective_policy, phase_of
from tests.unit.test_policy import facts as policy_facts

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)
D = timedelta(days=1)

instants = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))
spans = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=400))
maybe_spans = st.one_of(st.none(), spans)
outcomes = st.one_of(st.none(), st.sampled_from(list(Outcome)))
window_sets = st.builds(Windows, maybe_spans, maybe_spans, maybe_spans)
policies = st.builds(Policy, spans, spans, by_outcome=window_sets)
hard_ended = st.builds(Policy, spans, spans, by_outcome=window_sets, max_age=spans)


def facts() -> st.SearchStrategy[Facts]:
    """test_policy's sandboxes, each with an outcome (or none)."""
    return st.builds(lambda f, outcome: replace(f, outcome=outcome), policy_facts(), outcomes)


def _unpinned(f: Facts) -> Facts:
    return Facts(f.created_at, f.retain_until, outcome=f.outcome)


def _not_earlier(later: Policy, earlier: Policy, f: Facts, now: datetime) -> None:
    """The deadline under `later` is never before the one under `earlier`, and never expired where it is not."""
    a, b = deadline(f, earlier, now), deadline(f, later, now)
    if a.deadline is not None:
        assert b.deadline is not None and b.deadline >= a.deadline
    assert a.expired or not b.expired


# --- properties ----------------------------------------------------------------------------------------


@given(facts(), st.one_of(policies, hard_ended), instants)
def test_a_pin_never_shortens_whatever_the_outcome_windows_or_the_hard_end(
    f: Facts, policy: Policy, now: datetime
) -> None:
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


# --- the hard end (maxAge) -----------------------------------------------------------------------------


@given(facts(), hard_ended, st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=800)))
def test_nothing_outlives_max_age_unless_in_use(f: Facts, policy: Policy, after) -> None:
    # Past createdAt + maxAge no pin, window, retainUntil or session keeps a sandbox: only a live user does.
    if f.created_at is None or policy.max_age is None:
        return
    now = f.created_at + policy.max_age + after
    verdict = deadline(f, policy, now)
    assert verdict.expired and verdict.past_max_age and verdict.reasons[-1] is Reason.MAX_AGE
    assert verdict.deadline is not None and verdict.deadline <= f.created_at + policy.max_age
    assert not verdict.holds(now)  # no pin keeps it from a release for space either
    assert phase_of(verdict, in_session=True) is Phase.EXPIRED
    assert phase_of(verdict, in_use=True, in_session=True) is Phase.HELD
    for session, in_use in ((True, False), (False, True)):
        obj = _object(f, session=session, in_use=in_use)
        decision = decide(obj, Context(policy), now)
        assert decision.delete is not in_use
        expired = next(cd for cd in decision.status["conditions"] if cd["type"] == c.Condition.EXPIRED)
        assert expired["reason"] == Reason.MAX_AGE and "hard end" in expired["message"]


@given(facts(), hard_ended, instants)
def test_the_hard_end_only_ever_brings_a_deadline_earlier_and_never_past_it(f: Facts, policy: Policy, now) -> None:
    without = deadline(f, Policy(policy.retention, policy.max_pin, by_outcome=policy.by_outcome), now)
    verdict = deadline(f, policy, now)
    if f.created_at is None or without.deadline is None:
        assert verdict == without
        return
    assert policy.max_age is not None
    end = f.created_at + policy.max_age
    assert verdict.deadline == min(without.deadline, end) and verdict.hard_end == end
    assert verdict.expired == (without.expired or end <= now)
    if verdict.pin_in_force is not None:
        assert verdict.pin_in_force <= end


@given(facts(), hard_ended, spans, instants)
def test_a_longer_max_age_never_brings_a_deadline_earlier(f: Facts, policy: Policy, more, now) -> None:
    assert policy.max_age is not None
    longer = Policy(policy.retention, policy.max_pin, by_outcome=policy.by_outcome, max_age=policy.max_age + more)
    _not_earlier(longer, policy, f, now)


def _object(f: Facts, *, session: bool = False, in_use: bool = False) -> dict[str, object]:
    """A RetainedSandbox saying what `f` says, whether a session's Pod mounts it, and whether the agent sees it
    in use."""
    ann = {k: v for k, v in ((c.ANN_PIN_UNTIL, f.pin_until), (c.ANN_PINNED_AT, f.pinned_at)) if v is not None}
    spec: dict[str, object] = {"nodeName": "n", "createdAt": format_instant(f.created_at) if f.created_at else "x"}
    if f.retain_until is not None:
        spec["retainUntil"] = format_instant(f.retain_until)
    if f.outcome is not None:
        spec["origin"] = {"outcome": f.outcome.value}
    status = {"inUse": in_use, "heldBy": [reopen_holder("ns", c.SESSION_POD_PREFIX + "u")] if session else []}
    return {"metadata": {"name": "s", "namespace": "ns", "annotations": ann}, "spec": spec, "status": status}


def test_a_pin_keeps_a_sandbox_until_its_hard_end_and_no_later() -> None:
    policy = Policy(3 * D, 90 * D, max_age=10 * D)
    f = Facts(NOW - 5 * D, pin_until=format_instant(NOW + 30 * D), pinned_at=format_instant(NOW - 4 * D))
    kept = deadline(f, policy, NOW)
    assert (kept.deadline, kept.source, kept.pinned_until) == (NOW + 5 * D, DeadlineSource.MAX_AGE, NOW + 5 * D)
    assert kept.pinned and not kept.expired and kept.holds(NOW) and phase_of(kept) is Phase.PINNED
    ended = deadline(f, policy, NOW + 5 * D)
    assert ended.expired and ended.reasons == (Reason.MAX_AGE,) and not ended.holds(NOW + 5 * D)


def test_a_sandbox_expired_by_its_window_and_held_says_when_its_hard_end_passes() -> None:
    policy = Policy(D, 30 * D, max_age=7 * D)
    obj = _object(Facts(NOW - 8 * D), in_use=True)
    decision = decide(obj, Context(policy), NOW)
    assert decision.phase is Phase.HELD and not decision.delete
    expired = next(cd for cd in decision.status["conditions"] if cd["type"] == c.Condition.EXPIRED)
    assert expired["reason"] == Reason.MAX_AGE and expired["message"].endswith("held: something still uses it")
    before = decide(_object(Facts(NOW - 6 * D), in_use=True), Context(policy), NOW)
    assert before.phase is Phase.HELD and before.verdict.reasons == (Reason.WINDOW,)


def test_the_cluster_max_age_holds_every_namespace_and_only_a_policy_asking_more_is_told() -> None:
    default, ceiling = Policy(72 * H, 30 * D, max_age=30 * D), Ceiling(90 * D, 90 * D, max_age=30 * D)
    assert effective_policy(default, ceiling, Policy(3 * D, 7 * D)) == (Policy(3 * D, 7 * D, max_age=30 * D), ())
    assert effective_policy(default, ceiling, Policy(3 * D, 7 * D, max_age=7 * D))[0].max_age == 7 * D
    greedy, reasons = effective_policy(default, ceiling, Policy(3 * D, 7 * D, max_age=365 * D))
    assert greedy.max_age == 30 * D and reasons == (Reason.POLICY_CEILING,)
    none = Ceiling(90 * D, 90 * D)
    assert effective_policy(Policy(72 * H, 30 * D), none, Policy(3 * D, 7 * D, max_age=timedelta(0)))[1] == ()


def test_a_sandbox_policy_sets_max_age_and_the_settings_give_the_default_and_ceiling(monkeypatch) -> None:
    policy, problems = namespace_policy({"spec": {c.MAX_AGE: "30d"}}, Policy(72 * H, 30 * D))
    assert policy.max_age == 30 * D and problems == []
    bad, problems = namespace_policy({"spec": {c.MAX_AGE: "forever"}}, Policy(72 * H, 30 * D, max_age=D))
    assert bad.max_age == D and problems[0].startswith(f"spec.{c.MAX_AGE}")
    assert Settings().policy().max_age is None and Settings().ceiling().max_age is None
    monkeypatch.setenv("SANDKEEP_MAX_AGE", "60d")
    assert Settings().policy().max_age == Settings().ceiling().max_age == 60 * D


# --- warnings (warnBefore) -----------------------------------------------------------------------------


def test_warn_before_adds_expiring_soon_once_at_its_time_and_wakes_for_it() -> None:
    policy = Policy(3 * D, 30 * D, warn_before=D)
    obj = _object(Facts(NOW - D))  # deadline NOW + 2d
    early = decide(obj, Context(policy), NOW)
    assert early.wake_at == NOW + D and all(
        cd["type"] != c.Condition.EXPIRING_SOON for cd in early.status["conditions"]
    )
    late = decide(obj, Context(policy), NOW + D)
    soon = next(cd for cd in late.status["conditions"] if cd["type"] == c.Condition.EXPIRING_SOON)
    assert (
        soon["status"] == "True"
        and soon["reason"] == Reason.EXPIRING_SOON
        and "within warnBefore (1d" in soon["message"]
    )
    assert late.wake_at == NOW + 2 * D
    events = transition_events(obj | {"status": early.status}, late.status)
    assert [e[0] for e in events] == [Reason.EXPIRING_SOON]
    assert transition_events(obj | {"status": late.status}, late.status) == []  # once
    pinned = decide(_object(Facts(NOW - D, pin_until=format_instant(NOW + 9 * D))), Context(policy), NOW + D)
    assert all(cd["type"] != c.Condition.EXPIRING_SOON for cd in pinned.status["conditions"])
    assert status_changed(obj | {"status": late.status}, pinned.status)  # the condition is applied away
    off = decide(obj, Context(Policy(3 * D, 30 * D)), NOW + D)
    assert all(cd["type"] != c.Condition.EXPIRING_SOON for cd in off.status["conditions"])


def test_kubectl_sandkeep_ls_marks_it_and_doctor_lists_what_expires_within_a_day() -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    obj = _object(Facts(now - D)) | {"metadata": {"name": "soon", "namespace": "ns"}}
    late = decide(obj, Context(Policy(D + 2 * H, 30 * D, warn_before=3 * H)), now)  # deadline in 2h, warned
    warned = obj | {"status": late.status}
    assert ls_row(warned, now, wide=False, all_namespaces=False)[4].endswith("(in 2h) ExpiringSoon")
    quiet = obj | {"status": decide(obj, Context(Policy(D + 2 * H, 30 * D)), now).status}
    assert "ExpiringSoon" not in ls_row(quiet, now, wide=False, all_namespaces=False)[4]
    later = obj | {
        "metadata": {"name": "later", "namespace": "ns"},
        "status": {"phase": "Retained", "deadline": format_instant(now + 3 * D)},
    }
    report = build_report([warned, quiet | {"metadata": {"name": "quiet", "namespace": "ns"}}, later], {}, H)
    assert [(r[0], r[4], r[5]) for r in report.expiring] == [("ns/quiet", "window", "no"), ("ns/soon", "window", "yes")]
    assert not Report(expiring=report.expiring).needs_a_person  # informative: nothing needs a person
