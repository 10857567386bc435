"""The one deletion pipeline: from "this sandbox should go" to "its directory is gone".

Every deletion goes through it: the node agent's (an object being deleted), the standalone sweep's (an
expired manifest) and a standalone retain's that replaces a sandbox of the same name (`standalone.Replacer`).
They differ only in who asks and how they report; every step below exists once, here.

    reap(target)      the directory there? -> still the run that was asked for? -> recorded orphans
                      killed -> in use? -> still that run (a fresh read)? (the pure `next_step`) ->
                      rename to a tombstone -> the run, read back through the tombstone? -> delete
                      the tombstone (Stuck if it will not go)
    reap_unadoptable  a root entry no object can own, past its quarantine: still that inode (and that
                      manifest)? -> in use? -> rename it as a name to a tombstone -> read back -> delete
    leftover(tomb)    a young tombstone of another live process? -> readable? -> the caller's fate for
                      it: Finish (read back, delete), Keep (put back under its name) or Clear (delete)

Each call returns one typed outcome (Deleted, Held, Restored, Stuck, Refused, WouldDelete) carrying a
reason code; the caller turns it into its own report (the agent: status, Events, metrics; the sweep:
a decision line). Every step is idempotent and safe to cut short: a tombstone left by a crash is the
next pass's leftover. The pipeline is synchronous and blocking; the agent runs it in worker threads,
never on its event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from controller.node import orphan_records, orphans
from controller.node.inuse import Usage, pid_alive
from controller.node.store import (
    Mismatch,
    Present,
    Read,
    Root,
    StoreError,
    Tombstone,
    Transient,
    pid_namespace,
    same_read,
    standalone_id,
)
from controller.observe import logs
from controller.rules.contracts import Reason

log = logging.getLogger("sandkeep.reaper")

Key = tuple[str, str]
InUse = Callable[[Path], Usage]
InUseMany = Callable[[Mapping[int, Path]], Mapping[int, Usage]]  # one /proc pass answering for many
Hook = Callable[[Key, Tombstone | None], None]
Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(UTC)


# --- what the caller decided on ----------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """What the caller decided to delete, so any later read can be checked to still be that sandbox.

    The sweep decides on the manifest itself (the desired state lives there): `decided` is that read,
    and a read matches only when it says the same byte for byte, so a pin or a replacement landing in
    between holds the sandbox. The agent decides on the object (the desired state lives in the API):
    a read matches when it is the same run, createdAt and jobId agreeing; no manifest, or one that
    does not parse, is the object's (its name owns the path), one naming another sandbox never is.
    """

    decided: Read | None = None
    created_at: datetime | None = None
    job_id: str | None = None

    def matches(self, read: Read) -> bool | None:
        """True: the same sandbox; False: another one; None: cannot tell now (a transient read)."""
        if isinstance(read, Transient):
            return None
        if self.decided is not None:
            return same_read(self.decided, read)
        if isinstance(read, Mismatch):
            return False
        if not isinstance(read, Present):
            return True
        theirs = read.manifest.facts().created_at
        if self.created_at is not None and theirs is not None and self.created_at != theirs:
            return False
        return not (self.job_id and read.manifest.job_id and self.job_id != read.manifest.job_id)


@dataclass(frozen=True)
class Target:
    """A sandbox to delete: where, under which tombstone id, what was decided on, and why."""

    namespace: str
    name: str
    id: str  # the tombstone's id: the object's uid (agent) or `standalone_id()` (sweep)
    claim: Claim
    cause: Reason  # the reason a successful deletion is reported with

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)


@dataclass(frozen=True)
class Unadoptable:
    """A root entry no object can own, past its quarantine: `rel` as the scan names it (`ns`, `ns/name`),
    `ident` its (st_dev, st_ino) when it was quarantined (a replacement under the name is another entry),
    and for a sandbox-shaped one (a directory with valid names) `claim`, the read it was refused on, so a
    manifest fixed meanwhile holds it."""

    rel: str
    ident: tuple[int, int]
    claim: Claim | None = None
    cause: Reason = Reason.QUARANTINE_EXPIRED

    @property
    def key(self) -> Key | None:
        ns, _, name = self.rel.partition("/")
        return (ns, name) if self.claim is not None and name else None


# --- what a caller says about a leftover tombstone ---------------------------------------------------


@dataclass(frozen=True)
class Finish:
    """A deletion cut short: read it back against the claim, then delete it (or put it back)."""

    key: Key
    claim: Claim
    cause: Reason


@dataclass(frozen=True)
class Keep:
    """Still wanted: put it back under `key` (only when its manifest names `key`); else hold it."""

    key: Key
    reason: Reason


@dataclass(frozen=True)
class Clear:
    """Nobody's: delete it."""

    cause: Reason = Reason.TOMBSTONE_LEFTOVER


Fate = Finish | Keep | Clear


# --- outcomes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deleted:
    reason: Reason
    tombstone: str
    files: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Held:
    """Nothing was deleted; tried again later. `tombstone` is set when the sandbox sits renamed aside."""

    reason: Reason
    tombstone: str | None = None
    key: Key | None = None  # the sandbox a held tombstone belongs to
    usage: Usage | None = None
    survivors: tuple[orphans.Survivor, ...] = ()
    refused: tuple[orphan_records.Refusal, ...] = ()  # orphan records not acted on (untrusted, over the caps)
    errno: int | None = None
    pid: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Restored:
    """A tombstone put back under its sandbox's name (its read-back said another run, or it is wanted)."""

    reason: Reason
    tombstone: str
    key: Key


@dataclass(frozen=True)
class Stuck:
    """The tombstone would not go: `cause`, `errno` and `path` say what stopped it. `tried` is False when
    it was already retried this pass (so the caller has nothing new to report)."""

    tombstone: str
    cause: Reason
    errno: int | None
    path: str | None
    first: bool  # the first failure this process saw for it
    tried: bool = True
    reason: Reason = Reason.TOMBSTONE_STUCK


@dataclass(frozen=True)
class Refused:
    """Not (or no longer) the sandbox that was asked for: nothing to delete (LOST), or another run."""

    reason: Reason


@dataclass(frozen=True)
class WouldDelete:
    """Dry run: it would have been deleted."""

    reason: Reason
    tombstone: str


Outcome = Deleted | Held | Restored | Stuck | Refused | WouldDelete


@dataclass(frozen=True)
class Renamed:
    """Renamed aside, not yet read back and deleted: what `prepare` hands to `finish`."""

    target: Target
    tomb: Tombstone


def _hold(usage: Usage) -> Held | None:
    if usage.holds:
        return Held(usage.reason or (Reason.IN_USE if usage.in_use else Reason.IN_USE_UNKNOWN), usage=usage)
    return None


@dataclass
class StuckInfo:
    """A tombstone that failed to delete: since when (monotonic), the last error, and whose it is."""

    first_failed: float
    errno: int | None
    path: str | None
    key: Key | None  # None: a tombstone nobody claims (an orphan)


@dataclass
class Hooks:
    """Seams: run at exactly one point of `reap`, with the sandbox and (after the rename) its tombstone.

    after_check: after the orphans and the in-use check, before the fresh read; before_rename: after the
    fresh read; after_rename: before the read back; before_delete: right before the tombstone's delete.
    The agent uses before_delete to report Deleting; tests use them to land a pin or a crash exactly there.
    """

    after_check: Hook | None = None
    before_rename: Hook | None = None
    after_rename: Hook | None = None
    before_delete: Hook | None = None


# --- the decision before a rename (pure) ---------------------------------------------------------


class Look(StrEnum):
    """What `reap` looks at before it may rename, in this order (`ORDER`)."""

    DIRECTORY = "directory"  # a real directory under its name (never a link)
    RUN = "run"  # the manifest is the run the caller decided on
    ORPHANS = "orphans"  # recorded orphans killed, none survived
    IN_USE = "in-use"  # nothing uses it (unknown holds)
    RUN_AGAIN = "run-again"  # still that run, read fresh right before the rename


ORDER = (Look.DIRECTORY, Look.RUN, Look.ORPHANS, Look.IN_USE, Look.RUN_AGAIN)
Stop = Held | Refused


class Go(StrEnum):
    RENAME = "rename"  # every look found nothing against it


RENAME = Go.RENAME


def next_step(found: Mapping[Look, Stop | None]) -> Look | Stop | Go:
    """The next look to take, the reason to stop, or RENAME when every look found nothing against it.

    `found` maps each look taken to what it found (None: nothing). Pure; the property that matters
    (tests/unit/test_agent_decide.py): no set of findings with a hold or a refusal in it ever says RENAME.
    """
    for look in ORDER:
        if look not in found:
            return look
        stop = found[look]
        if stop is not None:
            return stop
    return RENAME


# --- the pipeline ------------------------------------------------------------------------------------


class RenameGuard(Protocol):
    """What another process may do to a sandbox between the in-use look and its rename: publish a Pod's reopen
    volume of it (`sandkeep csi-node`). `seen` is read before the look; `unchanged` is held across the rename
    and says whether anything happened since (the other process does it under the same lock, so it either
    lands before, and is seen, or after, and finds the sandbox gone)."""

    def seen(self, keys: Sequence[Key]) -> dict[Key, int]: ...

    def unchanged(self, key: Key, seen: int) -> contextlib.AbstractContextManager[bool]: ...


@dataclass
class Reaper:
    """The deletion steps of one root. Thread-safe: the agent runs several reaps at once (distinct keys)."""

    root: Root
    in_use: InUse | None = None  # asked for each path in turn, when there is no `in_use_many`
    in_use_many: InUseMany | None = None  # one answer for many at once (one /proc pass)
    fresh_for: float = 1.0  # seconds an in-use answer stays fresh enough to rename on (then asked again)
    stuck_after: timedelta = timedelta(minutes=10)  # a younger tombstone of a live process is in progress
    orphan_timeout: timedelta = timedelta(seconds=10)
    dry_run: bool = False
    kill: orphans.Kill = orphans.send
    alive: Callable[[int], bool] = pid_alive
    clock: Clock = utcnow
    hooks: Hooks = field(default_factory=Hooks)
    guard: RenameGuard | None = None  # another process that may take a sandbox up to its rename
    stuck: dict[str, StuckInfo] = field(default_factory=dict)  # tombstone name -> its failure
    _tried: set[str] = field(default_factory=set)  # tombstones deleted (or tried) this pass
    _lock: threading.Lock = field(default_factory=threading.Lock)
    pid: int = field(default_factory=os.getpid)
    pid_ns: int = field(default_factory=pid_namespace)  # whose /proc `alive` reads

    def __post_init__(self) -> None:
        one = self.in_use
        if (one is None) == (self.in_use_many is None):
            raise ValueError("a Reaper needs exactly one in-use check: in_use or in_use_many")
        if one is not None:
            self.in_use_many = lambda paths: {i: one(p) for i, p in paths.items()}

    def begin_pass(self) -> None:
        """A new pass: a stuck tombstone may be tried once more."""
        with self._lock:
            self._tried.clear()

    def forget(self, live: set[str]) -> None:
        """Drop the bookkeeping of tombstones no longer on disk (bounded memory on a churning node)."""
        with self._lock:
            for name in [n for n in self.stuck if n not in live]:
                del self.stuck[name]

    # --- a sandbox -------------------------------------------------------------------------------

    def reap(self, target: Target) -> Outcome:
        """Take `target` from its directory to gone, or say why not. The caller checked it should go."""
        step = self.prepare([target])[0]
        return self.finish(step) if isinstance(step, Renamed) else step

    def prepare(self, targets: Sequence[Target]) -> list[Held | Refused | Renamed]:
        """For each target, the looks before its rename, then the rename; many targets share the in-use look.

        The looks are taken in `next_step`'s order, each at most once per target, and the first that finds
        a reason to stop is that target's outcome. The first looks (directory, run, orphans) are taken for
        every target in turn; then one /proc pass answers in use for all of them, and each target is read
        fresh and renamed right after it: an answer older than `fresh_for` seconds is asked again (one
        pass for all the targets left), so a wave of a thousand deletions costs a few /proc passes, not a
        thousand, and no rename rests on an old answer. Renamed ones are finished by `finish`.
        """
        paths = [self.root.sandbox_path(*t.key) for t in targets]
        found: list[dict[Look, Stop | None]] = [{} for _ in targets]
        out: list[Held | Refused | Renamed | None] = [None] * len(targets)

        def stopped(i: int) -> bool:
            step = next_step(found[i])
            if isinstance(step, Held | Refused):
                out[i] = step
            return out[i] is not None

        for look in ORDER[: ORDER.index(Look.IN_USE)]:
            for i, target in enumerate(targets):
                if not stopped(i) and next_step(found[i]) is look:
                    found[i][look] = self._look(look, target, paths[i])
        pending = [i for i in range(len(targets)) if not stopped(i)]
        while pending:
            seen = self._seen([targets[i].key for i in pending])  # before the look: what happens after, shows
            asked = time.monotonic()
            usage = self._check_in_use({i: paths[i] for i in pending})
            left = []
            for n, i in enumerate(pending):
                if n and time.monotonic() - asked > self.fresh_for:  # the first is always fresh: progress
                    left = pending[n:]  # their answer is no longer fresh enough to rename on: ask again
                    break
                found[i][Look.IN_USE] = usage[i]
                if stopped(i):
                    continue
                found[i][Look.RUN_AGAIN] = self._look(Look.RUN_AGAIN, targets[i], paths[i])
                if not stopped(i):
                    assert next_step(found[i]) is RENAME
                    out[i] = self._rename(targets[i], seen)
            pending = left
        done = [step for step in out if step is not None]
        assert len(done) == len(targets)  # every target stopped or renamed: one outcome each, in order
        return done

    def _seen(self, keys: Sequence[Key]) -> dict[Key, int] | None:
        """The guard's marks before the in-use look; None when they cannot be read (every rename then holds)."""
        if self.guard is None:
            return {}
        try:
            return self.guard.seen(keys)
        except OSError as err:
            logs.say(log, "rename_guard_unread", reason=Reason.IN_USE_UNKNOWN, errno=err.errno)
            return None

    def _rename(self, target: Target, seen: dict[Key, int] | None = None) -> Renamed | Held:
        key = target.key
        self._hook(self.hooks.before_rename, key, None)
        if self.guard is None:
            return self._tombstone(target)
        if seen is None or key not in seen:
            return Held(Reason.IN_USE_UNKNOWN, error="whether a reopen volume holds it could not be read")
        with contextlib.ExitStack() as held:
            try:
                unchanged = held.enter_context(self.guard.unchanged(key, seen[key]))
            except OSError as err:
                return Held(Reason.IN_USE_UNKNOWN, errno=err.errno, error=str(err)[:300])
            if not unchanged:
                return Held(Reason.IN_USE, error="a Pod's reopen volume of it was published since the in-use look")
            return self._tombstone(target)

    def _tombstone(self, target: Target) -> Renamed | Held:
        key = target.key
        try:
            tomb = self.root.tombstone(*key, id=target.id, now=self.clock())
        except StoreError as err:
            return Held(err.reason, errno=err.errno, error=str(err))
        logs.say(log, "tombstoned", reason=Reason.TOMBSTONED, object="/".join(key), tombstone=tomb.name)
        self._hook(self.hooks.after_rename, key, tomb)
        return Renamed(target, tomb)

    def finish(self, renamed: Renamed) -> Outcome:
        """The last step of a reap: read the run back through its tombstone, then delete the tombstone."""
        target = renamed.target
        return self._read_back_and_delete(target.key, target.claim, renamed.tomb, target.cause)

    def _look(self, look: Look, target: Target, path: Path) -> Stop | None:
        """Take one look; None when it found no reason to stop."""
        if look is Look.DIRECTORY:
            try:
                is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
            except FileNotFoundError:
                is_dir = False
            except OSError as err:
                return Held(Reason.MANIFEST_UNREAD, errno=err.errno)
            return None if is_dir else Refused(Reason.LOST)  # a link or a file is never renamed: only reported
        if look is Look.ORPHANS:
            return self._reap_orphans(target.key, path)
        if look is Look.RUN_AGAIN:  # a re-retain or a pin may have landed during the checks
            self._hook(self.hooks.after_check, target.key, None)
        same = target.claim.matches(self.root.read(*target.key))
        if same is None:
            return Held(Reason.MANIFEST_UNREAD)
        return None if same else Refused(Reason.MANIFEST_CHANGED)

    def _reap_orphans(self, key: Key, path: Path) -> Held | None:
        """Kill recorded orphans (before the in-use check: their cwd is inside, so checking first would
        hold the sandbox forever on exactly the processes the reap exists to end). Survivors, recorded
        processes not proven the command's (never signalled) and records not trusted hold it."""
        timeout = self.orphan_timeout.total_seconds()
        reaped = orphans.reap_orphans(path, timeout=timeout, kill=self.kill)
        if reaped.signalled:
            logs.say(
                log, "orphans_reaped", reason=Reason.ORPHAN_REAPED, object="/".join(key), signalled=reaped.signalled
            )
        if reaped.hold is None:
            return None
        message = orphans.held_message(f"sandbox {key[0]}/{key[1]}", reaped, timeout)
        return Held(reaped.hold, survivors=reaped.survivors, refused=reaped.refused, error=message)

    def _check_in_use(self, paths: Mapping[int, Path]) -> dict[int, Held | None]:
        """Asked fresh right before the renames: in use, or unknown (a failed check too), holds."""
        try:
            assert self.in_use_many is not None  # __post_init__
            answers = self.in_use_many(paths)
        except Exception as err:
            return {i: Held(Reason.IN_USE_UNKNOWN, error=str(err)[:300]) for i in paths}
        return {i: _hold(answers[i]) for i in paths}

    # --- an unadoptable entry ----------------------------------------------------------------------

    def reap_unadoptable(self, entries: Sequence[Unadoptable]) -> list[Outcome]:
        """Delete root entries no object can own, as names, never following anything; one outcome each.

        Each must still be the entry that was quarantined (the same inode; for a sandbox-shaped one the same
        manifest, read fresh), and nothing may use it (one in-use pass for all; unknown holds); then it is
        renamed to a tombstone (a link or a file is renamed itself, never followed), read back, and the
        tombstone deleted like any other. Recorded orphans are not reaped: records in an entry no object
        vouches for are not trusted to name processes, and one still inside holds it as in use.
        """
        out: list[Outcome | None] = [self._still(e) for e in entries]
        pending = {i: self.root.path / e.rel for i, e in enumerate(entries) if out[i] is None}
        for i, hold in (self._check_in_use(pending) if pending else {}).items():
            out[i] = hold or self._still(entries[i]) or self._tombstone_unadoptable(entries[i])
        return [step for step in out if step is not None]

    def _still(self, entry: Unadoptable) -> Held | Refused | None:
        """None while `entry` is what was quarantined; else why not (gone, replaced, fixed, unreadable now)."""
        try:
            st = self.root.lstat_entry(entry.rel)
        except OSError as err:
            return Held(Reason.MANIFEST_UNREAD, errno=err.errno)
        if st is None:
            return Refused(Reason.LOST)
        if (st.st_dev, st.st_ino) != entry.ident:
            return Refused(Reason.MANIFEST_CHANGED)
        if entry.claim is None or entry.key is None:
            return None
        same = entry.claim.matches(self.root.read(*entry.key))
        if same is None:
            return Held(Reason.MANIFEST_UNREAD)
        return None if same else Refused(Reason.MANIFEST_CHANGED)

    def _tombstone_unadoptable(self, entry: Unadoptable) -> Outcome:
        if self.dry_run:
            return WouldDelete(entry.cause, "")
        try:
            tomb = self.root.tombstone_entry(entry.rel, entry.ident, id=standalone_id(), now=self.clock())
        except StoreError as err:
            if err.reason == Reason.MANIFEST_CHANGED:
                return Refused(err.reason)
            return Held(err.reason, errno=err.errno, error=str(err))
        logs.say(log, "tombstoned", reason=Reason.TOMBSTONED, entry=entry.rel, tombstone=tomb.name)
        if entry.key is None or entry.claim is None:
            return self._delete(tomb, entry.cause, None)
        return self._read_back_and_delete(entry.key, entry.claim, tomb, entry.cause, owned=False)

    # --- a tombstone -----------------------------------------------------------------------------

    def leftover(self, tomb: Tombstone, fate: Callable[[Read], Fate]) -> Outcome:
        """A tombstone found in the root (a crash, a failed delete, a stuck one): finish, restore or clear it.

        A young one of another live process is left to it (a pass in progress elsewhere, a retain staging);
        a process of another PID namespace (a retain in a Job's container) counts as alive, since this /proc
        cannot tell. A clock ahead of the tombstone's (a negative age) counts as old, so a bad clock cannot
        protect it forever. A manifest that cannot be read just now holds it: a delete on an unknown cannot be
        undone.
        """
        owner, age = tomb.pid, tomb.age(self.clock())
        if owner is not None and timedelta(0) <= age < self.stuck_after:
            here = tomb.made_here(self.pid_ns)
            if not here or (owner != self.pid and self.alive(owner)):
                return Held(Reason.TOMBSTONE_FOREIGN, tombstone=tomb.name, pid=owner)
        read = self.root.read_tombstone(tomb)
        if isinstance(read, Transient):
            return Held(Reason.MANIFEST_UNREAD, tombstone=tomb.name, errno=read.errno)
        chosen = fate(read)
        if isinstance(chosen, Finish):
            return self._read_back_and_delete(chosen.key, chosen.claim, tomb, chosen.cause, read)
        if isinstance(chosen, Keep):
            names_it = isinstance(read, Present) and (read.manifest.namespace, read.manifest.name) == chosen.key
            if names_it and not self.dry_run and self.root.restore(tomb, *chosen.key):
                return Restored(chosen.reason, tomb.name, chosen.key)
            return Held(chosen.reason, tombstone=tomb.name, key=chosen.key)
        return self._delete(tomb, chosen.cause, None)

    def _read_back_and_delete(
        self, key: Key, claim: Claim, tomb: Tombstone, cause: Reason, read: Read | None = None, *, owned: bool = True
    ) -> Outcome:
        """Read the manifest through the tombstone before deleting it: the one change a rename cannot see
        is a pin or a re-retain landing between the fresh read and the rename. Another run (or another
        version of it) is put back under its name, or held as a tombstone when the name is taken."""
        same = claim.matches(read if read is not None else self.root.read_tombstone(tomb))
        if same is None:
            return Held(Reason.MANIFEST_UNREAD, tombstone=tomb.name, key=key)
        if not same:
            if not self.dry_run and self.root.restore(tomb, *key):
                return Restored(Reason.MANIFEST_CHANGED, tomb.name, key)
            return Held(Reason.MANIFEST_CHANGED, tombstone=tomb.name, key=key)
        return self._delete(tomb, cause, key if owned else None)  # not owned: stuck, it is an orphan tombstone

    def _delete(self, tomb: Tombstone, cause: Reason, key: Key | None) -> Deleted | Stuck | WouldDelete:
        """Delete the tombstone's tree (fsdelete: no link followed, no mount crossed); a failure is Stuck.

        A stuck tombstone is tried once per pass (a retry walks only what is left of the tree).
        """
        if self.dry_run:
            return WouldDelete(cause, tomb.name)
        with self._lock:
            known = self.stuck.get(tomb.name)
            if known is not None and tomb.name in self._tried:
                return Stuck(tomb.name, Reason.DELETE_FAILED, known.errno, known.path, first=False, tried=False)
            self._tried.add(tomb.name)
        self._hook(self.hooks.before_delete, key, tomb)
        started = time.monotonic()
        result = self.root.delete_tombstone(tomb)
        if result.ok:
            with self._lock:
                self.stuck.pop(tomb.name, None)
            return Deleted(cause, tomb.name, result.files, time.monotonic() - started)
        with self._lock:
            info = self.stuck.get(tomb.name)
            first = info is None
            if info is None:
                info = self.stuck[tomb.name] = StuckInfo(time.monotonic(), result.errno, result.path, key)
            info.errno, info.path = result.errno, result.path
        return Stuck(tomb.name, result.reason, result.errno, result.path, first=first)

    @staticmethod
    def _hook(hook: Hook | None, key: Key | None, tomb: Tombstone | None) -> None:
        if hook is not None and key is not None:
            hook(key, tomb)
