"""The standalone sweep of one root: one pass, the reference's pass in Python, on the disk store and the one rule.

1. leftover tombstones first (a crash between rename and delete, or a delete that failed): deleted, unless one
   holds an unexpired pin (restored) or is a young one of another live process (left alone); a stuck one is
   logged when first seen and then at most once a day (the rate limit is this process's memory; whether it is
   stuck is recomputed on every pass);
2. every manifest read ONCE, a transient read held (`ManifestUnread`), the one rule decides
   (`policy.deadline`), in-use sandboxes held;
3. right before acting: a fresh read that must be byte-for-byte the pass's read (else `ManifestChanged`),
   the rename to a tombstone, a read through the tombstone (a pin that landed in between puts it back), then
   the safe delete (`fsdelete`). One structured line per decision, with a reason code (`logs.say`).

The deletion itself is `node/reaper.py`'s pipeline, the agent's too. `sandkeep sweep` runs it (standalone.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from controller.cluster.history import newer_of
from controller.node.inuse import Usage, pid_alive, scan_usage
from controller.node.opener import expiry
from controller.node.orphans import Kill, send
from controller.node.reaper import (
    Claim,
    Clear,
    Deleted,
    Fate,
    Held,
    Hook,
    Hooks,
    Keep,
    Key,
    Reaper,
    Refused,
    Restored,
    Stuck,
    Target,
    WouldDelete,
)
from controller.node.store import Entry, Mismatch, Present, Read, Root, Stray, Tombstone, Transient, standalone_id
from controller.observe import logs
from controller.rules.contracts import Reason
from controller.rules.durations import format_duration, format_instant
from controller.rules.policy import Policy, deadline

log = logging.getLogger("sandkeep.sweep")

# Defaults of the sweep's settings (SweepSettings: env SANDKEEP_STUCK_AFTER..., flags --stuck-after...).
STUCK_AFTER = timedelta(minutes=10)  # a tombstone older than this is stuck, not a delete in progress
RELOG_EVERY = timedelta(days=1)  # a stuck tombstone's line is repeated at most this often
ORPHAN_TIMEOUT = timedelta(seconds=10)  # how long killed orphan commands may take to end


Clock = Callable[[], datetime]
InUse = Callable[[Path], Usage]
EntryHook = Callable[[Entry, Tombstone], None]


def utcnow() -> datetime:
    return datetime.now(UTC)


def in_use_checker(ignore: Collection[int] = ()) -> InUse:
    """The real in-use check: one /proc pass (cwd, root, fds, maps, mounts of every process but this one).

    `ignore` lists pids whose use does not count: on a machine whose init cannot be inspected even by root
    (a microVM's pid 1), every answer would otherwise be "unknown", which holds every sandbox forever.
    """
    skip = (os.getpid(), *ignore)

    def check(path: Path) -> Usage:
        return scan_usage({0: path}, ignore=skip)[0]

    return check


# --- the pass ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """One decision of a pass: what (`entry`), what was done (`action`), why (`reason`)."""

    entry: str  # `ns/name`, a tombstone's name, or a stray's path relative to the root
    action: str  # deleted | kept | held | would-delete | restored | stuck | removed | reported | refused
    reason: Reason
    detail: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class PassReport:
    decisions: list[Decision] = field(default_factory=list)

    def actions(self, entry: str) -> list[tuple[str, Reason]]:
        return [(d.action, d.reason) for d in self.decisions if d.entry == entry]

    def by_action(self, action: str) -> list[Decision]:
        return [d for d in self.decisions if d.action == action]


class Sweeper:
    """The standalone sweep of one root. Call `run_pass()` while holding the root's lock.

    The deletion itself is `reaper.Reaper`'s, the same pipeline the agent runs; the sweep decides (the one
    rule on each manifest) and reports. `after_decide` (after the decision and the in-use check, before the
    fresh read), `before_rename` (after the fresh read) and `after_rename` (before the read through the
    tombstone) are seams for tests: a pin or a replacement landing at exactly that point. `in_use` defaults
    to the real /proc check; `clock`, `alive` and `kill` are injectable so a day of stuck-tombstone logging
    can be tested in a second.
    """

    def __init__(
        self,
        root: Root,
        policy: Policy,
        *,
        clock: Clock = utcnow,
        in_use: InUse | None = None,
        alive: Callable[[int], bool] = pid_alive,
        kill: Kill = send,
        stuck_after: timedelta = STUCK_AFTER,
        relog_every: timedelta = RELOG_EVERY,
        orphan_timeout: timedelta = ORPHAN_TIMEOUT,
        after_decide: EntryHook | None = None,
        before_rename: EntryHook | None = None,
        after_rename: EntryHook | None = None,
    ) -> None:
        self.root = root
        self.policy = policy
        self.clock = clock
        self.relog_every = relog_every
        self.reaper = Reaper(
            root,
            in_use if in_use is not None else in_use_checker(),
            stuck_after=stuck_after,
            orphan_timeout=orphan_timeout,
            dry_run=policy.dry_run,
            kill=kill,
            alive=alive,
            clock=clock,
            hooks=Hooks(
                after_check=_entry_hook(root, after_decide),
                before_rename=_entry_hook(root, before_rename),
                after_rename=_entry_hook(root, after_rename),
            ),
        )
        self._said: dict[str, datetime] = {}  # rate limit of repeated lines (stuck tombstones, strays)
        self._report = PassReport()

    # --- logging -----------------------------------------------------------------------------------

    def _decide(self, entry: str, action: str, reason: Reason, *, level: int = logging.INFO, **detail: Any) -> None:
        self._report.decisions.append(Decision(entry, action, reason, detail))
        if level >= 0 and log.isEnabledFor(level):
            logs.say(log, f"sweep_{action.replace('-', '_')}", level=level, reason=reason, entry=entry, **detail)

    def _decide_once(self, entry: str, action: str, reason: Reason, now: datetime, **detail: Any) -> None:
        """Record every pass; say it when first seen and then at most once per `relog_every`."""
        said = self._said.get(entry)
        quiet = said is not None and now - said < self.relog_every
        if not quiet:
            self._said[entry] = now
        self._decide(entry, action, reason, level=-1 if quiet else logging.WARNING, **detail)

    # --- one pass ----------------------------------------------------------------------------------

    def run_pass(self) -> PassReport:
        """One pass over the root: leftovers, then sandboxes, then strays. Never raises for one bad entry."""
        self._report = PassReport()
        self.reaper.begin_pass()
        now = self.clock()
        scan = self.root.scan()
        held_pinned = [t for t in scan.tombstones if self._leftover(t, now) == "pinned-held"]
        reads = self.root.read_many(scan.sandboxes)
        newer = history_newer(self.policy, reads.values())
        for entry in scan.sandboxes:
            key = (entry.namespace, entry.name)
            try:
                self._consider(entry, reads[key], newer.get(key))
            except Exception as err:  # one bad entry never aborts the pass
                self._decide(f"{entry.namespace}/{entry.name}", "held", Reason.DELETE_FAILED, error=str(err))
        for stray in scan.strays:
            self._stray(stray, now)
        for t in held_pinned:
            self._leftover(t, self.clock())
        seen = {d.entry for d in self._report.decisions} | {d.detail.get("tombstone") for d in self._report.decisions}
        self._said = {k: v for k, v in self._said.items() if k in seen}  # forget what is gone: bounded memory
        self.reaper.forget({t.name for t in self.root.tombstones()})
        if not self.policy.dry_run:  # rmdir removes only an empty one: a namespace this pass emptied, say
            for ns in sorted({e.namespace for e in scan.sandboxes} | set(scan.empty_namespaces)):
                self.root.remove_empty_namespace(ns)
        return self._report

    def _leftover(self, t: Tombstone, now: datetime) -> str | None:
        """A leftover tombstone, through the pipeline: restored when it holds a live pin, else deleted.

        Returns "pinned-held" for a pinned one whose name was taken, which the pass retries once at its end.
        """
        try:
            outcome = self.reaper.leftover(t, lambda read: self._fate(read, now))
        except Exception as err:  # one bad tombstone never aborts the pass
            self._decide_once(t.name, "held", Reason.DELETE_FAILED, now, error=str(err))
            return None
        match outcome:
            case Deleted():
                self._said.pop(t.name, None)
                self._decide(t.name, "deleted", outcome.reason, files=outcome.files)
            case Restored(key=key):
                self._said.pop(t.name, None)
                self._decide(t.name, "restored", outcome.reason, sandbox="/".join(key))
            case Held(reason=Reason.TOMBSTONE_PINNED, key=key):
                self._decide_once(t.name, "held", outcome.reason, now, sandbox=_ref(key), restored=False)
                return "pinned-held"
            case Held():
                self._decide_once(t.name, "held", outcome.reason, now, pid=outcome.pid, errno=strerror(outcome.errno))
            case WouldDelete():
                self._decide(t.name, "would-delete", outcome.reason)
            case Stuck():
                self._decide_once(
                    t.name,
                    "stuck",
                    outcome.reason,
                    now,
                    cause=outcome.cause,
                    errno=strerror(outcome.errno),
                    path=outcome.path,
                )
        return None

    def _fate(self, read: Read, now: datetime) -> Fate:
        """A leftover holding an unexpired pin is still wanted; anything else is cleared."""
        if isinstance(read, Present):
            verdict = deadline(read.manifest.facts(), self.policy, now)
            if verdict.pinned and not verdict.expired:
                return Keep((read.manifest.namespace, read.manifest.name), Reason.TOMBSTONE_PINNED)
        return Clear()

    def _consider(self, entry: Entry, read: Read, newer: int | None = None) -> None:
        """Decide one sandbox on the pass's one read (`newer`: how many of its history group and outcome are newer
        in this pass); the pipeline acts only if nothing changed since."""
        key = f"{entry.namespace}/{entry.name}"
        now = self.clock()
        if isinstance(read, Transient):
            self._decide(key, "held", Reason.MANIFEST_UNREAD, errno=os.strerror(read.errno))
            return
        if isinstance(read, Mismatch):
            self._decide(
                key, "refused", Reason.MANIFEST_MISMATCH, names=f"{read.manifest.namespace}/{read.manifest.name}"
            )
            return
        cause, verdict = expiry(read, self.policy, now, newer)
        if cause is None:
            assert verdict is not None
            left = verdict.time_left(now)
            self._decide(
                key,
                "kept",
                Reason.PINNED if verdict.pinned else Reason.RETAINED,
                level=logging.DEBUG,
                deadline=format_instant(verdict.deadline) if verdict.deadline else None,
                left=format_duration(left) if left is not None else None,
            )
            return
        if self.policy.dry_run:
            self._decide(key, "would-delete", cause)
            return
        target = Target(entry.namespace, entry.name, standalone_id(), Claim(decided=read), cause)
        outcome = self.reaper.reap(target)
        match outcome:
            case Deleted():
                self._decide(
                    key,
                    "deleted",
                    cause,
                    tombstone=outcome.tombstone,
                    files=outcome.files,
                    seconds=f"{outcome.seconds:.3f}",
                )
            case Restored():  # the read back said another version: put back, decided again next pass
                self._decide(key, "held", outcome.reason, tombstone=outcome.tombstone, restored=True)
            case Held(tombstone=str(tombstone)):
                self._decide(key, "held", outcome.reason, tombstone=tombstone, restored=False)
            case Held(usage=usage, survivors=survivors):
                holders = ",".join(usage.holders[:5]) if usage is not None else None
                pids = " ".join(str(s.pid) for s in survivors) or None
                self._decide(
                    key,
                    "held",
                    outcome.reason,
                    holders=holders or None,
                    survivors=pids,
                    errno=strerror(outcome.errno),
                    error=outcome.error,
                )
            case Refused():
                self._decide(key, "held", outcome.reason)
            case Stuck():
                self._said[outcome.tombstone] = now
                self._decide(
                    key,
                    "stuck",
                    outcome.reason,
                    level=logging.WARNING,
                    tombstone=outcome.tombstone,
                    cause=outcome.cause,
                    errno=strerror(outcome.errno),
                    path=outcome.path,
                )
            case WouldDelete():  # not reached: a dry run decides above
                self._decide(key, "would-delete", cause)

    def _stray(self, stray: Stray, now: datetime) -> None:
        """Not a sandbox: a link or a file is unlinked (never followed); a directory with a bad name is reported."""
        if stray.is_dir:
            self._decide_once(stray.rel, "reported", stray.reason, now)
            return
        if self.policy.dry_run:
            self._decide(stray.rel, "would-delete", stray.reason)
            return
        try:
            removed = self.root.remove_stray(stray)
        except OSError as err:
            self._decide_once(stray.rel, "reported", stray.reason, now, errno=os.strerror(err.errno or 0))
            return
        self._decide(stray.rel, "removed" if removed else "reported", stray.reason)


_NO_TOMBSTONE = Tombstone("", "", datetime.fromtimestamp(0, UTC), Path())


def history_newer(policy: Policy, reads: Iterable[Read]) -> dict[Key, int]:
    """The history limits over the manifests of one pass, counted as the controller counts its view's objects
    (cluster/history.py): for each manifest in a group, how many of its group and outcome are newer."""
    manifests = [r.manifest for r in reads if isinstance(r, Present)]
    return newer_of(policy.history, (m.as_object() for m in manifests))


def _entry_hook(root: Root, hook: EntryHook | None) -> Hook | None:
    """A test seam of the sweep (entry, tombstone) as the pipeline's (key, tombstone-or-None)."""
    if hook is None:
        return None
    return lambda key, tomb: hook(Entry(*key, root.sandbox_path(*key)), tomb or _NO_TOMBSTONE)


def strerror(code: int | None) -> str | None:
    """An errno in words for a decision's line; None stays None."""
    return os.strerror(code) if code is not None else None


def _ref(key: Key | None) -> str | None:
    return "/".join(key) if key is not None else None
