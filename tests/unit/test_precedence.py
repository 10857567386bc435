"""The rule's order of precedence (issue 28, item 5): docs/architecture.md's table, row by row, against `decide()`.

Each row has a case here in which it meets the rows below it and must win; the table must name exactly these
rows in this order, so reordering the code or the table without the other fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.cluster.decide import Context, Decision, decide
from controller.rules import contracts as c
from controller.rules.contracts import DeadlineSource, Phase, Reason
from controller.rules.durations import format_instant
from controller.rules.objects import reopen_holder
from controller.rules.policy import History, Policy, Windows

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
D = timedelta(days=1)
# Every knob set, so each case meets every row below its own: failures 10 days, the rest 2, pins up to 90
# days, a hard end at 30, one success per group and the newest failure kept past its window.
HISTORY = History("job-name", succeeded=1, keep_last_failed=1)
POLICY = Policy(2 * D, 90 * D, by_outcome=Windows(failed=10 * D), max_age=30 * D, history=HISTORY)


def sandbox(
    age: timedelta | None,
    *,
    outcome: c.Outcome | None = c.Outcome.FAILED,
    retain_until: timedelta | None = None,
    pin: timedelta | None = None,
    session: bool = False,
    in_use: bool = False,
) -> dict[str, Any]:
    """A RetainedSandbox `age` old (None: no usable createdAt), with what each row reads set as asked."""
    spec: dict[str, Any] = {"nodeName": "n", "createdAt": "garbage" if age is None else format_instant(NOW - age)}
    if retain_until is not None and age is not None:
        spec["retainUntil"] = format_instant(NOW - age + retain_until)
    if outcome is not None:
        spec["origin"] = {"outcome": outcome.value}
    ann = {}
    if pin is not None:
        ann = {c.ANN_PIN_UNTIL: format_instant(NOW + pin), c.ANN_PINNED_AT: format_instant(NOW - D)}
    status: dict[str, Any] = {"inUse": in_use}
    if session:
        status["heldBy"] = [reopen_holder("ns", c.SESSION_POD_PREFIX + "u")]  # its Pod's reopen volume
    return {"metadata": {"name": "s", "namespace": "ns", "annotations": ann}, "spec": spec, "status": status}


def decided(obj: dict[str, Any], newer: int | None = None) -> Decision:
    """The decision on `obj` with `newer` sandboxes of its history group and outcome (None: in no group)."""
    return decide(obj, Context(POLICY, newer=newer), NOW)


def in_use() -> None:
    # past its hard end, pinned, in a session: in use, it is held and never deleted
    d = decided(sandbox(40 * D, pin=5 * D, session=True, in_use=True))
    assert d.phase is Phase.HELD and not d.delete and d.verdict.reasons[-1] is Reason.MAX_AGE


def max_age() -> None:
    # past its hard end with a pin, a session, a later retainUntil and a long window: deleted, cause MaxAge
    d = decided(sandbox(31 * D, pin=5 * D, session=True, retain_until=60 * D))
    assert d.delete and d.verdict.reasons[-1] is Reason.MAX_AGE and d.phase is Phase.EXPIRED


def session() -> None:
    # expired by its window, before its hard end: a session holds it (and opens it before its deadline)
    d = decided(sandbox(12 * D, session=True))
    assert d.phase is Phase.HELD and not d.delete and d.verdict.expired
    assert decided(sandbox(D, session=True)).phase is Phase.OPEN


def pin() -> None:
    # retainUntil and the window have passed: a valid pin keeps it
    d = decided(sandbox(12 * D, retain_until=D, pin=5 * D))
    assert d.phase is Phase.PINNED and not d.verdict.expired and d.verdict.source is DeadlineSource.PIN


def history_limit() -> None:
    # a success with a newer one in its group, its window and retainUntil still ahead: released; pinned, kept
    d = decided(sandbox(D, outcome=c.Outcome.SUCCEEDED, retain_until=2 * D), newer=1)
    assert d.delete and d.verdict.reasons == (Reason.HISTORY_LIMIT,)
    assert decided(sandbox(D, outcome=c.Outcome.SUCCEEDED, pin=5 * D), newer=1).phase is Phase.PINNED


def kept_last_failed() -> None:
    # the newest failure of its group, past its window and its retainUntil: kept, with no deadline but the hard end
    d = decided(sandbox(12 * D, retain_until=D), newer=0)
    assert not d.verdict.expired and d.verdict.deadline == NOW + 18 * D and Reason.KEPT_LAST_FAILED in d.verdict.reasons
    assert decided(sandbox(12 * D, retain_until=D), newer=1).delete  # the second newest is not


def retain_until() -> None:
    # earlier than its outcome's window: retainUntil decides
    d = decided(sandbox(D, retain_until=3 * D))
    assert d.verdict.source is DeadlineSource.RETAIN and d.verdict.deadline == NOW + 2 * D


def outcome_window() -> None:
    # a failure: its own 10 days, not retention's 2
    d = decided(sandbox(D))
    assert d.verdict.source is DeadlineSource.WINDOW and d.verdict.deadline == NOW + 9 * D


def retention() -> None:
    # no window of its own (a success here, or no outcome): retention
    for outcome in (c.Outcome.SUCCEEDED, None):
        assert decided(sandbox(D, outcome=outcome)).verdict.deadline == NOW + D


def no_created_at() -> None:
    d = decided(sandbox(None))
    assert d.delete and d.verdict.reasons == (Reason.NO_CREATED_AT,)
    assert decided(sandbox(None, pin=5 * D)).phase is Phase.PINNED  # every row above still wins


CASES: dict[str, Callable[[], None]] = {
    "in-use": in_use,
    "max-age": max_age,
    "session": session,
    "pin": pin,
    "history-limit": history_limit,
    "kept-last-failed": kept_last_failed,
    "retain-until": retain_until,
    "outcome-window": outcome_window,
    "retention": retention,
    "no-created-at": no_created_at,
}


def table_rows() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("### Order of precedence", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\| `([a-z-]+)` \|", section, flags=re.M)


def test_the_table_names_every_row_of_the_code_in_the_same_order() -> None:
    assert table_rows() == list(CASES)


@pytest.mark.parametrize("row", list(CASES))
def test_each_row_wins_over_the_rows_below_it(row: str) -> None:
    CASES[row]()
