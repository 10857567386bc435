"""The agent's decisions, pure: what one object needs next, what a tombstone is for, what status to write.

No I/O, no clock, no client: `observe()` reduces an object (and whether a tombstone of it exists) to an
`Observation`, and `next_step()` says what to do with it, as the controller's `decide()` does. The runtime
(`runtime.py`) does what it says; the deletion itself is the shared pipeline (`controller/node/reaper.py`),
whose own pure core is `reaper.next_step`. Tested without a server in tests/unit/test_agent_decide.py.

The rule that matters: only an object being deleted (the controller's decision, or a person's `kubectl
delete`) with this agent's finalizer ever leads to the pipeline; a kept (pinned or unexpired) object is
observed and reported, never renamed; a tombstone of a kept object is put back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path

from controller.node.inuse import Usage
from controller.node.reaper import Claim, Clear, Fate, Finish, Keep
from controller.node.treesize import TreeSize
from controller.rules import objects
from controller.rules.contracts import FINALIZER, Condition, Reason, ReleasePriority
from controller.rules.durations import format_duration, instant_or_none
from controller.rules.objects import Obj, finalizers
from controller.rules.pressure import Candidate
from controller.rules.sizes import human_size

Key = tuple[str, str]
OWNED_CONDITIONS = (
    Condition.DISK_PRESENT,
    Condition.IN_USE,
    Condition.TOMBSTONE_STUCK,
    Condition.ORPHANS_SURVIVED,
    Condition.SIZE_PARTIAL,
)
OWNED_FIELDS = ("sizeBytes", "size", "fileCount", "inUse", "heldBy", "tombstone")


# --- one object ----------------------------------------------------------------------------------------


class Step(StrEnum):
    IGNORE = "ignore"  # not this node's, gone, or deleting without our finalizer: nothing of ours to do
    ADD_FINALIZER = "add-finalizer"  # ours and kept, but not yet guarded: add the finalizer first
    REPORT = "report"  # ours and kept: observe the directory and write status
    FINISH = "finish"  # being deleted and already renamed aside: read back and delete the tombstone
    REAP = "reap"  # being deleted: the whole pipeline (it holds or refuses when it must)


@dataclass(frozen=True)
class Observation:
    mine: bool  # spec.nodeName is this node
    deleting: bool  # the delete request: metadata.deletionTimestamp
    guarded: bool  # carries this agent's finalizer
    tombstone: bool  # a tombstone named after this object's uid is in the root


def observe(obj: Obj | None, node: str, tombstone: bool) -> Observation | None:
    if obj is None:
        return None
    mine = (obj.get("spec") or {}).get("nodeName") == node
    return Observation(mine, objects.is_deleting(obj), FINALIZER in finalizers(obj), tombstone)


def next_step(seen: Observation | None) -> Step:
    """What one object needs next. Only a deleting, guarded object of this node goes to the pipeline."""
    if seen is None or not seen.mine:
        return Step.IGNORE
    if seen.deleting:
        if not seen.guarded:
            return Step.IGNORE
        return Step.FINISH if seen.tombstone else Step.REAP
    return Step.REPORT if seen.guarded else Step.ADD_FINALIZER


def claim_of(obj: Obj) -> Claim:
    """What deleting this object asks for: the run it describes (createdAt, jobId), never another one.

    A job retained again under the same name is another run, which deleting this object must not delete.
    """
    spec = obj.get("spec") or {}
    return Claim(created_at=objects.sandbox_facts(obj).created_at, job_id=spec.get("jobId") or None)


def fate(obj: Obj | None) -> Fate:
    """What a tombstone of `obj` (None: of no object) is for: finish its deletion, put it back, or clear it.

    Its object deleting (and guarded): finish that deletion. Its object alive and not deleting (nothing
    the agent does leaves that; a hand-made rename would): put it back, never delete a sandbox still
    wanted. No object, or one deleting without our finalizer: nobody's, cleared.
    """
    if obj is not None and objects.is_deleting(obj) and FINALIZER in finalizers(obj):
        return Finish(objects.key_of(obj), claim_of(obj), Reason.DELETED)
    if obj is not None and not objects.is_deleting(obj):
        return Keep(objects.key_of(obj), Reason.TOMBSTONE_PINNED)
    return Clear()


# --- status ---------------------------------------------------------------------------------------------


def _strip(cond: Obj) -> Obj:
    return {k: v for k, v in cond.items() if k != "lastTransitionTime"}


def owned_view(status: Obj) -> Obj:
    """The part of a status this agent owns, in a comparable shape (condition times left out)."""
    view: Obj = {k: status[k] for k in OWNED_FIELDS if k in status}
    if status.get("phase") is not None:
        view["phase"] = status["phase"]
    conds = {cd["type"]: _strip(cd) for cd in status.get("conditions") or [] if cd.get("type") in OWNED_CONDITIONS}
    view["conditions"] = conds
    return view


def status_changed(obj: Obj, desired: Obj, *, deleting: bool) -> bool:
    """Whether applying `desired` would change anything the agent owns (phase only counts while deleting)."""
    have = owned_view(obj.get("status") or {})
    want = owned_view(desired)
    if not deleting:
        have.pop("phase", None)
        want.pop("phase", None)
    return have != want


def orphans_pending(pids: frozenset[int]) -> Usage:
    """Not in use; heldBy and the InUse condition say which orphans a deletion will reap first."""
    listed = ",".join(str(p) for p in sorted(pids))
    why = (
        f"only orphans of a killed `sandkeep exec` use it: pids {listed}, "
        "which are killed (SIGKILL) before the sandbox is deleted"
    )
    return Usage(False, (why,), Reason.ORPHANS_PENDING, pids)


def discount_orphans(
    usage: Mapping[Key, Usage], paths: Mapping[Key, Path], orphans_of: Callable[[Path], frozenset[int]]
) -> dict[Key, Usage]:
    """The pass's answers, with a sandbox used only by its own recorded orphans reported as not in use.

    Orphans (what a killed `sandkeep exec` left running) are debris: they are SIGKILLed on the way to
    deletion, before the in-use check right before the rename. Counting them as users would hold an
    expired sandbox forever, since only a deletion reaps them. Any other holder (a live command, a
    process nobody recorded, a Pod, a mount, a process that cannot be inspected) keeps it in use.
    `orphans_of` reads the records (orphans.orphan_pids); it is asked only for sandboxes held by
    processes alone, and signals nothing.
    """
    out = dict(usage)
    for key, answer in usage.items():
        if answer.in_use is True and answer.only_pids and answer.held_only_by(orphans_of(paths[key])):
            out[key] = orphans_pending(answer.pids)
    return out


# --- sizes ----------------------------------------------------------------------------------------------


def size_partial(sandbox: str, node: str, size: TreeSize, budget: timedelta) -> tuple[Reason, str] | None:
    """Why `size` is short of the whole tree, in words for condition SizePartial; None for a complete count.

    A partial size is still the size reported (sizeBytes): a lower bound, which the quota and disk pressure
    count, where a sandbox never measured would count nothing and never be released for space.
    """
    if size.complete:
        return None
    reason = size.reason or Reason.SIZE_INTERRUPTED
    counted = f"sizeBytes ({human_size(size.bytes)} in {size.files} files) is what was counted"
    why = {
        Reason.SIZE_TOO_SLOW: f"measuring it took longer than --size-budget ({format_duration(budget)})",
        Reason.SIZE_UNREADABLE: "a directory in it could not be opened or read, so what that holds is not counted",
    }.get(reason, "its tree changed under the walk in a way that made going on unsafe (a directory moved)")
    fix = " Raise agent.sizeBudget to measure it whole." if reason == Reason.SIZE_TOO_SLOW else ""
    return reason, (
        f"sandbox {sandbox} on node {node}: {why}; {counted}, a lower bound that the namespace's quota and "
        f"the node's disk pressure count. It is measured again every pass.{fix}"
    )


# --- disk pressure --------------------------------------------------------------------------------------


def age_of(obj: Obj) -> datetime | None:
    """The deadline releasing orders by: the controller's, else the recorded retainUntil, else createdAt."""
    facts = objects.sandbox_facts(obj)
    return instant_or_none((obj.get("status") or {}).get("deadline")) or facts.retain_until or facts.created_at


PRIORITY = {ReleasePriority.FIRST: -1, ReleasePriority.NORMAL: 0, ReleasePriority.LAST: 1}


def release_priority(obj: Obj) -> int:
    """Its namespace's place in the release order, as the controller reports it (status.releasePriority)."""
    text = (obj.get("status") or {}).get("releasePriority")
    return next((rank for p, rank in PRIORITY.items() if p.value == text), 0)


def dry_run(obj: Obj) -> bool:
    """Its namespace is in dry-run, as the controller reports it (status.dryRun): released in words only."""
    return (obj.get("status") or {}).get("dryRun") is True


def candidate(obj: Obj, size: int | None, usage: Usage | None, now: datetime) -> Candidate:
    """One sandbox as the pressure choice sees it. No answer from the in-use scan yet holds (unknown)."""
    return Candidate(
        key=objects.key_of(obj),
        size=size,
        deadline=age_of(obj),
        pinned=objects.pin_holds(obj, now),
        held=usage is None or usage.holds,
        deleting=objects.is_deleting(obj),
        priority=release_priority(obj),
        holders=usage.holders if usage is not None else ("not checked yet",),
    )


def release_refusal(fresh: Obj | None, uid: str, now: datetime) -> str | None:
    """Why a sandbox chosen for release must not be, read fresh just before the DELETE; None: go ahead.

    The DELETE then carries uid and resourceVersion preconditions, so a pin landing after this read
    makes it a 409 and the sandbox stays.
    """
    if fresh is None or fresh["metadata"].get("uid") != uid:
        return "gone or replaced"
    if objects.is_deleting(fresh):
        return "already being deleted"
    if objects.pin_holds(fresh, now):
        return "pinned"
    return None
