"""The node side's pure decisions, without a server: the agent's next_step and fate, the pipeline's next_step.

The property that matters, checked over every sequence hypothesis can find: nothing leads to a rename
of a kept sandbox (one whose object is not being deleted: pinned or unexpired, as the controller
decided) or of a held one (in use, use unknown, orphans that survived, another run, a read that failed).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controller.agent.decide import (
    Observation,
    Step,
    claim_of,
    discount_orphans,
    fate,
    next_step,
    observe,
    orphans_pending,
    status_changed,
)
from controller.node.inuse import Usage
from controller.node.reaper import ORDER, RENAME, Claim, Clear, Finish, Held, Keep, Look, Refused, Stop
from controller.node.reaper import next_step as pipeline_step
from controller.node.store import Absent, Mismatch, Present, Transient
from controller.rules import contracts as c
from controller.rules.contracts import Reason
from controller.rules.models import Manifest

NODE = "n1"
NOW_PATH = Path("/nonexistent/ns/run-1")  # never opened: the orphan reader is the test's


def obj(*, node: str = NODE, deleting: bool = False, guarded: bool = True, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "run-1", "namespace": "ns", "uid": "u-1", "resourceVersion": "7"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    if guarded:
        meta["finalizers"] = [c.FINALIZER]
    return {"metadata": meta, "spec": {"nodeName": node, "createdAt": "2026-11-01T00:00:00Z", **spec}}


# --- the agent: one object -----------------------------------------------------------------------------


def test_a_kept_object_is_guarded_then_reported_never_deleted() -> None:
    assert next_step(observe(obj(guarded=False), NODE, tombstone=False)) is Step.ADD_FINALIZER
    assert next_step(observe(obj(), NODE, tombstone=False)) is Step.REPORT
    assert next_step(observe(obj(), NODE, tombstone=True)) is Step.REPORT  # its tombstone is put back, by fate


def test_a_deleted_object_is_reaped_or_its_tombstone_finished() -> None:
    assert next_step(observe(obj(deleting=True), NODE, tombstone=False)) is Step.REAP
    assert next_step(observe(obj(deleting=True), NODE, tombstone=True)) is Step.FINISH


def test_another_nodes_object_a_gone_one_and_one_without_our_finalizer_are_left_alone() -> None:
    assert next_step(observe(obj(node="n2", deleting=True), NODE, tombstone=False)) is Step.IGNORE
    assert next_step(observe(None, NODE, tombstone=False)) is Step.IGNORE
    assert next_step(observe(obj(deleting=True, guarded=False), NODE, tombstone=True)) is Step.IGNORE


def test_a_tombstone_is_finished_for_a_deleting_object_put_back_for_a_kept_one_cleared_for_none() -> None:
    assert isinstance(fate(obj(deleting=True)), Finish)
    kept = fate(obj())
    assert isinstance(kept, Keep) and kept.key == ("ns", "run-1")
    assert isinstance(fate(None), Clear)
    assert isinstance(fate(obj(deleting=True, guarded=False)), Clear)


observations = st.builds(Observation, st.booleans(), st.booleans(), st.booleans(), st.booleans())


@given(st.lists(observations, min_size=1, max_size=20))
def test_no_sequence_of_observations_sends_a_kept_or_foreign_object_to_the_pipeline(seen: list[Observation]) -> None:
    for o in seen:
        step = next_step(o)
        if step in (Step.REAP, Step.FINISH):
            assert o.mine and o.deleting and o.guarded
        if not o.deleting:
            assert step in (Step.IGNORE, Step.ADD_FINALIZER, Step.REPORT)


@given(st.booleans(), st.booleans(), st.sampled_from([None, "n1", "n2"]))
def test_a_tombstone_of_a_kept_object_is_never_cleared(deleting: bool, guarded: bool, node: str | None) -> None:
    o = None if node is None else obj(node=node, deleting=deleting, guarded=guarded)
    chosen = fate(o)
    if o is not None and not deleting:
        assert isinstance(chosen, Keep)
    if isinstance(chosen, Clear):
        assert o is None or (deleting and not guarded)


# --- the pipeline: the looks before a rename -----------------------------------------------------------

stops: st.SearchStrategy[Stop] = st.sampled_from(
    [
        Held(Reason.IN_USE),
        Held(Reason.IN_USE_UNKNOWN),
        Held(Reason.ORPHAN_SURVIVOR),
        Held(Reason.MANIFEST_UNREAD),
        Refused(Reason.MANIFEST_CHANGED),
        Refused(Reason.LOST),
    ]
)
findings = st.dictionaries(st.sampled_from(list(Look)), st.one_of(st.none(), stops))


def test_the_looks_come_in_order_orphans_before_the_in_use_check_and_the_run_read_twice() -> None:
    found: dict[Look, Stop | None] = {}
    taken = []
    while (step := pipeline_step(found)) is not RENAME:
        assert isinstance(step, Look)
        taken.append(step)
        found[step] = None
    assert taken == list(ORDER)
    assert taken.index(Look.ORPHANS) < taken.index(Look.IN_USE) < taken.index(Look.RUN_AGAIN)


@given(findings)
def test_nothing_found_against_it_is_the_only_way_to_a_rename(found: dict[Look, Stop | None]) -> None:
    step = pipeline_step(found)
    if step is RENAME:
        assert all(found.get(look, "missing") is None for look in ORDER)
    if any(v is not None for v in found.values()) and all(look in found for look in ORDER):
        assert isinstance(step, Held | Refused)


@given(st.lists(st.tuples(st.sampled_from(list(Look)), st.one_of(st.none(), stops)), max_size=30))
def test_no_sequence_of_findings_with_a_hold_ever_renames(events: list[tuple[Look, Stop | None]]) -> None:
    found: dict[Look, Stop | None] = {}
    for look, what in events:
        found.setdefault(look, what)  # each look is taken once, as reap() does
        if pipeline_step(found) is RENAME:
            assert not any(v is not None for v in found.values())


# --- the run comparison --------------------------------------------------------------------------------


def manifest(created: str = "2026-11-01T00:00:00Z", job: str = "job-1", ns: str = "ns") -> Manifest:
    return Manifest.model_validate({"namespace": ns, "name": "run-1", "createdAt": created, "jobId": job or ""})


def test_the_agent_claims_the_run_its_object_describes() -> None:
    claim = claim_of(obj(jobId="job-1"))
    assert claim.matches(Present(manifest(), "{}")) is True
    assert claim.matches(Present(manifest(created="2026-11-02T00:00:00Z"), "{}")) is False  # retained again
    assert claim.matches(Present(manifest(job="job-2"), "{}")) is False
    assert claim.matches(Absent()) is True  # its name owns the path
    assert claim.matches(Mismatch(manifest(ns="other"), "{}")) is False
    assert claim.matches(Transient(errno.EIO)) is None


def test_the_sweep_claims_the_exact_bytes_it_decided_on() -> None:
    read = Present(manifest(), '{"a": 1}')
    claim = Claim(decided=read)
    assert claim.matches(Present(manifest(), '{"a": 1}')) is True
    assert claim.matches(Present(manifest(), '{"a": 1, "keepUntil": "x"}')) is False  # a pin landed
    assert claim.matches(Transient(errno.EMFILE)) is None


# --- status ---------------------------------------------------------------------------------------------


def test_a_status_write_is_needed_only_when_something_the_agent_owns_changed() -> None:
    have = obj()
    cond = {"type": "InUse", "status": "False", "reason": "Retained", "lastTransitionTime": "t0"}
    have["status"] = {"inUse": False, "conditions": [cond], "phase": "Retained"}
    same = {"inUse": False, "conditions": [{**cond, "lastTransitionTime": "t1"}]}
    assert not status_changed(have, same, deleting=False)
    assert status_changed(have, {**same, "inUse": True}, deleting=False)
    assert status_changed(have, {**same, "phase": "Deleting"}, deleting=True)


def test_a_sandbox_used_only_by_its_recorded_orphans_is_reported_not_in_use() -> None:
    key = ("ns", "run-1")
    busy = Usage(True, ("pid 41", "pid 42"), Reason.IN_USE, frozenset({41, 42}), only_pids=True)
    out = discount_orphans({key: busy}, {key: NOW_PATH}, lambda _p: frozenset({41, 42}))
    assert out[key] == orphans_pending(frozenset({41, 42}))
    other = discount_orphans({key: busy}, {key: NOW_PATH}, lambda _p: frozenset({41}))
    assert other[key] is busy
