"""History limits per group (issue 28, item 2): the rule (pure) and the controller's groups, against brute force."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.cluster.decide import Context, decide
from controller.cluster.history import Groups, newer_of
from controller.rules import contracts as c
from controller.rules.contracts import DeadlineSource, Outcome, Phase, Reason
from controller.rules.durations import format_instant
from controller.rules.objects import cronjob_of, group_of, namespace_policy
from controller.rules.policy import Facts, History, Policy, deadline

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
D = timedelta(days=1)
counts = st.one_of(st.none(), st.integers(min_value=0, max_value=4))
histories = st.builds(History, st.just("job-name"), counts, counts, counts, st.integers(min_value=0, max_value=4))
policies = st.builds(
    Policy,
    st.timedeltas(min_value=timedelta(0), max_value=10 * D),
    st.timedeltas(min_value=timedelta(0), max_value=30 * D),
    history=histories,
    max_age=st.one_of(st.none(), st.timedeltas(min_value=timedelta(0), max_value=60 * D)),
)
ages = st.timedeltas(min_value=timedelta(0), max_value=60 * D)


def sandbox(name: str, age: timedelta, outcome: Outcome | None, group: str | None, **status: Any) -> dict[str, Any]:
    origin: dict[str, Any] = {"outcome": outcome.value} if outcome is not None else {}
    if group is not None and outcome is not None:
        origin["labels"] = {"job-name": group}
    spec: dict[str, Any] = {"nodeName": "n", "createdAt": format_instant(NOW - age)}
    if origin:
        spec["origin"] = origin
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec, "status": status}


# --- the rule ------------------------------------------------------------------------------------------


@given(
    policies, ages, st.sampled_from(list(Outcome)), st.integers(min_value=0, max_value=8), st.booleans(), st.booleans()
)
def test_the_history_limits_never_release_a_pinned_or_held_sandbox(policy, age, outcome, newer, pinned, held) -> None:
    pin = {"pin_until": format_instant(NOW + D), "pinned_at": format_instant(NOW - D)} if pinned else {}
    facts = Facts(NOW - age, outcome=outcome, newer=newer, **pin)  # type: ignore[arg-type]
    verdict = deadline(facts, policy, NOW)
    limit = policy.history.limit(outcome)
    beyond = Reason.HISTORY_LIMIT in verdict.reasons
    assert beyond == (limit is not None and newer >= limit and not verdict.holds(NOW) and not verdict.past_max_age)
    if verdict.holds(NOW):
        assert not beyond
    obj = sandbox("s", age, outcome, "build", inUse=held)
    if pinned:
        obj["metadata"]["annotations"] = {c.ANN_PIN_UNTIL: pin["pin_until"], c.ANN_PINNED_AT: pin["pinned_at"]}
    decision = decide(obj, Context(policy, newer=newer), NOW)
    if held:
        assert not decision.delete and decision.phase in (Phase.HELD, Phase.PINNED, Phase.RETAINED)
    if decision.verdict.holds(NOW):
        assert Reason.HISTORY_LIMIT not in decision.verdict.reasons


@given(policies, ages, st.integers(min_value=0, max_value=8))
def test_the_newest_failures_kept_outlive_their_window_but_never_max_age(policy: Policy, age, newer) -> None:
    verdict = deadline(Facts(NOW - age, outcome=Outcome.FAILED, newer=newer), policy, NOW)
    limit = policy.history.failed
    protected = newer < policy.history.keep_last_failed and (limit is None or newer < limit)
    if protected and policy.max_age is None:
        assert not verdict.expired and verdict.source is DeadlineSource.HISTORY and verdict.deadline is None
    if protected and policy.max_age is not None:
        assert verdict.deadline == NOW - age + policy.max_age and verdict.expired == (age >= policy.max_age)


@given(policies, ages, st.sampled_from(list(Outcome)), st.integers(min_value=0, max_value=8), ages)
def test_a_pin_never_shortens_whatever_the_history(policy: Policy, age, outcome, newer, pin_in) -> None:
    pin = {"pin_until": format_instant(NOW - 30 * D + pin_in), "pinned_at": format_instant(NOW - D)}
    with_pin = deadline(Facts(NOW - age, outcome=outcome, newer=newer, **pin), policy, NOW)  # type: ignore[arg-type]
    without = deadline(Facts(NOW - age, outcome=outcome, newer=newer), policy, NOW)
    assert without.expired or not with_pin.expired
    if with_pin.deadline is not None and without.deadline is not None:
        assert with_pin.deadline >= without.deadline
    if without.deadline is None:  # kept with no deadline (keepLastFailed): a pin gives it none either
        assert with_pin.deadline is None


def test_beyond_the_limit_the_oldest_go_and_a_pin_keeps_one() -> None:
    policy = Policy(30 * D, 30 * D, history=History("job-name", succeeded=2))
    within = deadline(Facts(NOW - D, outcome=Outcome.SUCCEEDED, newer=1), policy, NOW)
    assert not within.expired
    beyond = deadline(Facts(NOW - D, outcome=Outcome.SUCCEEDED, newer=2), policy, NOW)
    assert beyond.expired and beyond.reasons == (Reason.HISTORY_LIMIT,) and "limit is 2" in beyond.messages[0]
    pin = format_instant(NOW + 40 * D)
    kept = deadline(Facts(NOW - D, pin_until=pin, outcome=Outcome.SUCCEEDED, newer=5), policy, NOW)
    assert not kept.expired and kept.pinned
    other = deadline(Facts(NOW - D, outcome=Outcome.FAILED, newer=9), policy, NOW)
    assert not other.expired  # no limit for failures


def test_a_policy_reads_history_limits_and_refuses_what_it_cannot() -> None:
    spec = {c.HISTORY_LIMITS: {"groupBy": "job-name", "succeeded": 3, "keepLastFailed": 1}}
    policy, problems = namespace_policy({"spec": spec}, Policy(D, D))
    assert problems == [] and policy.history == History("job-name", succeeded=3, keep_last_failed=1)
    for bad in ({"groupBy": "team"}, {"groupBy": "owner", "failed": -1}):
        policy, problems = namespace_policy({"spec": {c.HISTORY_LIMITS: bad}}, Policy(D, D))
        assert policy.history is None and problems[0].startswith(f"spec.{c.HISTORY_LIMITS}")


def test_decide_says_history_limit_and_a_held_one_stays() -> None:
    policy = Policy(30 * D, 30 * D, history=History("job-name", succeeded=0))
    gone = decide(sandbox("s", D, Outcome.SUCCEEDED, "b"), Context(policy, newer=0), NOW)
    assert gone.delete and gone.verdict.reasons == (Reason.HISTORY_LIMIT,)
    held = decide(sandbox("s", D, Outcome.SUCCEEDED, "b", inUse=True), Context(policy, newer=0), NOW)
    assert not held.delete and held.phase is Phase.HELD


def _job_run(name: str, job: str, age: timedelta, kind: str = "Job") -> dict[str, Any]:
    obj = sandbox(name, age, Outcome.SUCCEEDED, None)
    obj["spec"]["origin"]["owner"] = {"kind": kind, "name": job}
    return obj


def _minute(at: datetime) -> int:
    return int(at.timestamp()) // 60


def test_cronjob_groups_a_cronjobs_runs_by_the_names_its_controller_gives_their_jobs() -> None:
    # The CronJob controller names a run's Job `<cronjob>-<scheduled minute since the epoch>`; a run ended an hour
    # after it was scheduled is in group CronJob/<cronjob>.
    run = _job_run("s", f"nightly-backup-{_minute(NOW - 2 * D)}", D)
    assert group_of(run, c.GROUP_BY_CRONJOB) == "CronJob/nightly-backup"
    assert group_of(run, c.GROUP_BY_OWNER) == f"Job/nightly-backup-{_minute(NOW - 2 * D)}"
    late = _job_run("s", f"weekly-{_minute(NOW - 40 * D)}", D)  # scheduled 39 days before it ended: not a run
    early = _job_run("s", f"weekly-{_minute(NOW)}", D)  # scheduled after it ended
    names = ("build-42", "release-20260101", "nightly", "-1", "x-99999999999999")
    hand_made = [_job_run("s", name, D) for name in names]
    not_a_job = _job_run("s", f"nightly-{_minute(NOW - 2 * D)}", D, kind="TaskRun")
    no_owner = sandbox("s", D, Outcome.SUCCEEDED, "nightly")
    for obj in (late, early, not_a_job, no_owner, *hand_made):
        assert group_of(obj, c.GROUP_BY_CRONJOB) is None, obj["spec"]["origin"]
    at_the_edges = (NOW - D - timedelta(days=c.CRONJOB_RUN_MAX_DAYS), NOW - D + timedelta(seconds=59))
    for scheduled in at_the_edges:
        assert cronjob_of(f"n-{_minute(scheduled)}", NOW - D) == "CronJob/n"


def test_history_limits_by_cronjob_keep_the_newest_runs_of_each_cronjob() -> None:
    limits = {"groupBy": "cronjob", "succeeded": 1}
    policy, problems = namespace_policy({"spec": {c.HISTORY_LIMITS: limits}}, Policy(D, D))
    assert problems == [] and policy.history == History(c.GROUP_BY_CRONJOB, succeeded=1)
    assert policy.history is not None
    groups = Groups()
    run_ages = (D, 2 * D, 3 * D)  # each run scheduled an hour before it ended
    runs = [
        _job_run(f"s{i}", f"nightly-{_minute(NOW - age - timedelta(hours=1))}", age) for i, age in enumerate(run_ages)
    ]
    other = _job_run("o", f"weekly-{_minute(NOW - 3 * D)}", 2 * D)
    groups.configure("ns", policy.history, [*runs, other])
    assert [groups.newer(("ns", f"s{i}")) for i in range(3)] == [0, 1, 2] and groups.newer(("ns", "o")) == 0
    gone = decide(runs[1], Context(replace(policy, retention=30 * D), newer=groups.newer(("ns", "s1"))), NOW)
    assert gone.delete and gone.verdict.reasons == (Reason.HISTORY_LIMIT,)


def test_a_sweeps_batch_counts_as_the_controllers_groups_each_namespace_apart() -> None:
    # The standalone sweep (cli/sweep.py) counts one pass's manifests at once, each namespace its own groups.
    objs = [sandbox(f"s{i}", i * D, Outcome.SUCCEEDED, "nightly") for i in range(3)]
    other = sandbox("s9", 9 * D, Outcome.SUCCEEDED, "nightly")
    other["metadata"]["namespace"] = "other"
    loose = sandbox("loose", D, None, None)
    counted = newer_of(History("job-name", succeeded=1), [*objs, other, loose])
    assert counted == {("ns", "s0"): 0, ("ns", "s1"): 1, ("ns", "s2"): 2, ("other", "s9"): 0}
    assert newer_of(None, objs) == {}


# --- the controller's groups, against brute force ------------------------------------------------------

HISTORY = History("job-name", failed=2, succeeded=1, keep_last_failed=1)
events = st.lists(
    st.tuples(
        st.booleans(),  # put (True) or drop
        st.integers(min_value=0, max_value=11),  # which sandbox
        st.integers(min_value=0, max_value=5),  # its age in days
        st.sampled_from([Outcome.FAILED, Outcome.SUCCEEDED, None]),
        st.sampled_from(["a", "b", None]),
    ),
    max_size=40,
)


def _classes(objs: dict[str, dict[str, Any]]) -> dict[tuple[str, str], tuple[bool, bool] | None]:
    """Brute force: for each sandbox, (beyond its outcome's limit, one of the newest kept failures)."""
    out: dict[tuple[str, str], tuple[bool, bool] | None] = {}
    for name, obj in objs.items():
        origin = obj["spec"].get("origin") or {}
        group, outcome = (origin.get("labels") or {}).get("job-name"), origin.get("outcome")
        if group is None or outcome is None:
            out["ns", name] = None
            continue
        mine = (obj["spec"]["createdAt"], name)
        newer = sum(
            1
            for other, o in objs.items()
            if (o["spec"].get("origin") or {}).get("outcome") == outcome
            and ((o["spec"].get("origin") or {}).get("labels") or {}).get("job-name") == group
            and (o["spec"]["createdAt"], other) != mine
            and (o["spec"]["createdAt"] > mine[0] or (o["spec"]["createdAt"] == mine[0] and other < name))
        )
        limit = HISTORY.limit(Outcome(outcome))
        out["ns", name] = (limit is not None and newer >= limit, outcome == "Failed" and newer < 1)
    return out


@given(events)
@settings(max_examples=300)
def test_the_groups_count_the_newer_and_hand_back_every_key_whose_decision_can_change(steps) -> None:
    groups = Groups()
    groups.configure("ns", HISTORY, [])
    objs: dict[str, dict[str, Any]] = {}
    for put, i, age, outcome, group in steps:
        name = f"s{i}"
        before = _classes(objs)
        if put and name not in objs:  # createdAt, origin are immutable: a name is put once while it lives
            objs[name] = sandbox(name, age * D, outcome, group)
            moved = groups.put(objs[name])
        elif not put and name in objs:
            del objs[name]
            moved = groups.drop(("ns", name))
        else:
            continue
        after = _classes(objs)
        changed = {k for k in after if k in before and before[k] != after[k]}
        assert changed <= set(moved), f"{changed - set(moved)} changed but were not handed back"
        for key, klass in after.items():
            newer = groups.newer(key)
            assert (newer is None) == (klass is None)
    groups.configure("ns", None, [])
    assert groups.where == {} and groups.members == {} and groups.slots == {}
