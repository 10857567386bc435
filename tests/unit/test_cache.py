"""The one newest-version rule both caches keep (controller/api/cache.py), and both caches keeping it: the
agent's (agent/state.AgentState) and the controller's view (cluster/view.View)."""

from __future__ import annotations

from typing import Any

import pytest

from controller.agent.state import AgentState
from controller.api.cache import Gone, resource_version, supersedes, vanished
from controller.cluster.view import View
from controller.rules.objects import Obj, observed_of, reopen_holder


def sandbox(name: str, uid: str, rv: str | None, phase: str = "Retained") -> Obj:
    meta: dict[str, Any] = {"namespace": "ns", "name": name, "uid": uid}
    if rv is not None:
        meta["resourceVersion"] = rv
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": {"phase": phase}}


def test_an_older_version_of_the_same_object_never_replaces_a_newer_one() -> None:
    cached = sandbox("a", "u1", "10")
    assert not supersedes(sandbox("a", "u1", "9"), cached)
    assert supersedes(sandbox("a", "u1", "10"), cached)  # the same version again: the watch's echo of our write
    assert supersedes(sandbox("a", "u1", "11"), cached)


def test_the_versions_are_compared_as_numbers_not_as_text() -> None:
    assert supersedes(sandbox("a", "u1", "10"), sandbox("a", "u1", "9"))
    assert not supersedes(sandbox("a", "u1", "9"), sandbox("a", "u1", "10"))


def test_another_object_under_the_same_name_replaces_whatever_its_version() -> None:
    # A sandbox deleted and retained again under its name is a new uid: its version says nothing about the old one.
    assert supersedes(sandbox("a", "u2", "3"), sandbox("a", "u1", "500"))
    assert supersedes(sandbox("a", "u1", "1"), None)


def test_a_version_that_is_missing_or_not_a_number_is_older_than_any() -> None:
    assert resource_version(sandbox("a", "u1", None)) == -1
    assert resource_version(sandbox("a", "u1", "x1")) == -1
    assert not supersedes(sandbox("a", "u1", None), sandbox("a", "u1", "0"))
    assert supersedes(sandbox("a", "u1", "0"), sandbox("a", "u1", None))


def test_an_object_seen_deleted_is_never_kept_again_not_even_over_nothing() -> None:
    gone = Gone()
    gone.add("u1")
    assert not supersedes(sandbox("a", "u1", "99"), None, gone)
    assert not supersedes(sandbox("a", "u1", "99"), sandbox("a", "u1", "1"), gone)
    assert supersedes(sandbox("a", "u2", "1"), None, gone)  # a new run under the same name is another uid


def test_the_uids_seen_deleted_are_bounded_and_the_oldest_go_first() -> None:
    gone = Gone(limit=3)
    for uid in ("u1", "u2", "u3", "u4"):
        gone.add(uid)
    assert list(gone) == ["u2", "u3", "u4"] and len(gone) == 3
    assert "u1" not in gone and "u4" in gone


def test_a_relisting_says_what_vanished_while_the_watch_was_down() -> None:
    held = [("ns", "a"), ("ns", "b"), ("ns", "c")]
    assert vanished(held, {("ns", "a"), ("ns", "c"), ("ns", "new")}) == [("ns", "b")]
    assert vanished(held, set(held)) == []
    assert vanished([], {("ns", "a")}) == []


# Both caches, fed the same arrivals, hold the same version of each object.
ARRIVALS = [
    sandbox("a", "u1", "5", "Retained"),
    sandbox("a", "u1", "7", "Pinned"),
    sandbox("a", "u1", "6", "Retained"),  # late: an older answer after a newer event
    sandbox("b", "u2", "9", "Retained"),
    sandbox("b", "u3", "2", "Retained"),  # b deleted and retained again: a new uid, a lower version
    sandbox("b", "u2", "10", "Expired"),  # the old b's late answer replaces by uid rule (no deletion seen)
]


@pytest.mark.parametrize("upto", range(1, len(ARRIVALS) + 1))
def test_the_agent_cache_and_the_controller_view_keep_the_same_versions(upto: int) -> None:
    state, view = AgentState(), View()
    for obj in ARRIVALS[:upto]:
        state.remember(dict(obj, metadata=dict(obj["metadata"])))
        view.remember(dict(obj, metadata=dict(obj["metadata"])))
    assert sorted(state.objects) == sorted(view.sandboxes)
    for key, obj in state.objects.items():
        held = view.sandboxes[key]
        assert (held["metadata"]["uid"], held["metadata"]["resourceVersion"]) == (
            obj["metadata"]["uid"],
            obj["metadata"]["resourceVersion"],
        )
    expected_a = {1: "5", 2: "7"}.get(upto, "7")
    assert state.objects[("ns", "a")]["metadata"]["resourceVersion"] == expected_a


def test_the_agent_forgets_a_deleted_object_for_good_and_keeps_a_new_one_of_its_name() -> None:
    state = AgentState()
    old = sandbox("a", "u1", "5")
    state.remember(old)
    state.forget(old)
    assert ("ns", "a") not in state.objects and "u1" in state.gone
    state.remember(sandbox("a", "u1", "6"))  # the answer of a write sent before the deletion
    assert ("ns", "a") not in state.objects
    state.remember(sandbox("a", "u2", "7"))
    assert state.objects[("ns", "a")]["metadata"]["uid"] == "u2"
    state.forget(old)  # a late DELETED of the old object leaves the new one
    assert state.objects[("ns", "a")]["metadata"]["uid"] == "u2"


def test_the_controller_view_keeps_the_session_holders_a_decision_reads_and_no_other_holder() -> None:
    obj = sandbox("a", "u1", "10")
    session, other = reopen_holder("ns", "session-1234"), "pid 42 (sleep) has its working directory inside"
    obj["status"] |= {"inUse": True, "heldBy": [other, session]}
    view = View()
    view.remember(obj)
    kept = view.sandboxes.get(("ns", "a"))
    assert kept is not None and kept["status"]["heldBy"] == [session]
    assert observed_of(kept) == observed_of(obj)  # in use and in a session: Open, as from the whole object
    obj["status"]["heldBy"] = [other]
    obj["metadata"]["resourceVersion"] = "11"
    view.remember(obj)
    kept = view.sandboxes.get(("ns", "a"))
    assert kept is not None and "heldBy" not in kept["status"] and not observed_of(kept).in_session
