"""The standalone mode: one host, one root, no cluster. `sandkeep retain | pin | ls | sweep`.

The sweep is the reference's pass in Python, built on the disk store and the one rule:

1. leftover tombstones first (a crash between rename and delete, or a delete that failed): deleted, unless one
   holds an unexpired pin (restored) or is a young one of another live process (left alone); a stuck one is
   logged when first seen and then at most once a day (the rate limit is this process's memory; whether it is
   stuck is recomputed on every pass);
2. every manifest read ONCE, a transient read held (`ManifestUnread`), the one rule decides
   (`policy.deadline`), in-use sandboxes held;
3. right before acting: a fresh read that must be byte-for-byte the pass's read (else `ManifestChanged`),
   the rename to a tombstone, a read through the tombstone (a pin that landed in between puts it back), then
   the safe delete (`fsdelete`). One structured line per decision, with a reason code (`logs.say`).

Exit codes: 0 done, 1 a command did not do what was asked (say, pinning an absent sandbox), 2 bad input,
3 the root is locked by another process or owned by another uid.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from controller import fsdelete, logs
from controller.contracts import Reason
from controller.durations import Invalid, format_duration, format_instant, parse_duration, parse_instant
from controller.inuse import Usage, pid_alive, scan_usage
from controller.models import Settings, is_namespace_name, is_object_name
from controller.policy import Policy, Verdict, deadline
from controller.store import (
    Absent,
    Entry,
    Mismatch,
    Present,
    Read,
    Root,
    RootRefused,
    StoreError,
    Stray,
    Tombstone,
    Transient,
    Unparsed,
    Unreadable,
    same_read,
    standalone_id,
)

log = logging.getLogger("sandkeep.sweep")

STUCK_AFTER = timedelta(minutes=10)  # a tombstone older than this is stuck, not a delete in progress
RELOG_EVERY = timedelta(days=1)  # a stuck tombstone's line is repeated at most this often

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 3

Clock = Callable[[], datetime]
InUse = Callable[[Path], Usage]
Hook = Callable[[Entry, Tombstone], None]


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

    `after_decide` (after the decision and the in-use check, before the fresh read), `before_rename` (after
    the fresh read) and `after_rename` (before the read through the tombstone) are seams for tests: a pin or a
    replacement landing at exactly that point. `in_use` defaults to the real /proc check; `clock` and `alive`
    are injectable so a day of stuck-tombstone logging can be tested in a second.
    """

    def __init__(
        self,
        root: Root,
        policy: Policy,
        *,
        clock: Clock = utcnow,
        in_use: InUse | None = None,
        alive: Callable[[int], bool] = pid_alive,
        after_decide: Hook | None = None,
        before_rename: Hook | None = None,
        after_rename: Hook | None = None,
    ) -> None:
        self.root = root
        self.policy = policy
        self.clock = clock
        self.in_use = in_use if in_use is not None else in_use_checker()
        self.alive = alive
        self.after_decide = after_decide
        self.before_rename = before_rename
        self.after_rename = after_rename
        self.pid = os.getpid()
        self._said: dict[str, datetime] = {}  # rate limit of repeated lines (stuck tombstones, strays)
        self._report = PassReport()

    # --- logging -----------------------------------------------------------------------------------

    def _decide(self, entry: str, action: str, reason: Reason, *, level: int = logging.INFO, **detail: Any) -> None:
        self._report.decisions.append(Decision(entry, action, reason, detail))
        if level >= 0 and log.isEnabledFor(level):
            logs.say(log, f"sweep_{action.replace('-', '_')}", level=level, reason=reason, entry=entry, **detail)

    def _decide_once(self, entry: str, action: str, reason: Reason, now: datetime, **detail: Any) -> None:
        """Record every pass; say it when first seen and then at most once per RELOG_EVERY."""
        said = self._said.get(entry)
        quiet = said is not None and now - said < RELOG_EVERY
        if not quiet:
            self._said[entry] = now
        self._decide(entry, action, reason, level=-1 if quiet else logging.WARNING, **detail)

    # --- one pass ----------------------------------------------------------------------------------

    def run_pass(self) -> PassReport:
        """One pass over the root: leftovers, then sandboxes, then strays. Never raises for one bad entry."""
        self._report = PassReport()
        now = self.clock()
        scan = self.root.scan()
        held_pinned = [t for t in scan.tombstones if self._leftover(t, now) == "pinned-held"]
        reads = self.root.read_many(scan.sandboxes)
        for entry in scan.sandboxes:
            try:
                self._consider(entry, reads[(entry.namespace, entry.name)])
            except Exception as err:  # one bad entry never aborts the pass
                self._decide(f"{entry.namespace}/{entry.name}", "held", Reason.DELETE_FAILED, error=str(err))
        for stray in scan.strays:
            self._stray(stray, now)
        for t in held_pinned:
            self._leftover(t, self.clock())
        seen = {d.entry for d in self._report.decisions} | {d.detail.get("tombstone") for d in self._report.decisions}
        self._said = {k: v for k, v in self._said.items() if k in seen}  # forget what is gone: bounded memory
        if not self.policy.dry_run:  # rmdir removes only an empty one: a namespace this pass emptied, say
            for ns in sorted({e.namespace for e in scan.sandboxes} | set(scan.empty_namespaces)):
                self.root.remove_empty_namespace(ns)
        return self._report

    def _leftover(self, t: Tombstone, now: datetime) -> str | None:
        try:
            return self._clear_tombstone(t, now)
        except Exception as err:  # one bad tombstone never aborts the pass
            self._decide_once(t.name, "held", Reason.DELETE_FAILED, now, error=str(err))
            return None

    def _clear_tombstone(self, t: Tombstone, now: datetime) -> str | None:
        """A leftover tombstone: deleted, or restored when it holds a live pin, or left to its live maker.

        Returns "pinned-held" for a pinned one whose name was taken, which the pass retries once at its end.
        A manifest that cannot be read just now holds it: deleting on an unknown cannot be undone.
        """
        owner, age = t.pid, t.age(now)
        if owner is not None and owner != self.pid and timedelta(0) <= age < STUCK_AFTER and self.alive(owner):
            self._decide_once(t.name, "held", Reason.TOMBSTONE_FOREIGN, now, pid=owner)
            return None
        read = self.root.read_tombstone(t)
        if isinstance(read, Transient):
            self._decide_once(t.name, "held", Reason.MANIFEST_UNREAD, now, errno=read.errno)
            return None
        if isinstance(read, Present):
            verdict = deadline(read.manifest.facts(), self.policy, now)
            if verdict.pinned and not verdict.expired:
                target = f"{read.manifest.namespace}/{read.manifest.name}"
                if not self.policy.dry_run and self.root.restore(t, read.manifest.namespace, read.manifest.name):
                    self._said.pop(t.name, None)
                    self._decide(t.name, "restored", Reason.TOMBSTONE_PINNED, sandbox=target)
                    return None
                self._decide_once(t.name, "held", Reason.TOMBSTONE_PINNED, now, sandbox=target, restored=False)
                return "pinned-held"
        if self.policy.dry_run:
            self._decide(t.name, "would-delete", Reason.TOMBSTONE_LEFTOVER)
            return None
        result = self.root.delete_tombstone(t)
        if result.ok:
            self._said.pop(t.name, None)
            self._decide(t.name, "deleted", Reason.TOMBSTONE_LEFTOVER, files=result.files)
        else:
            self._stuck(t, result, now)
        return None

    def _stuck(self, t: Tombstone, result: fsdelete.DeleteResult, now: datetime) -> None:
        code = os.strerror(result.errno) if result.errno is not None else None
        self._decide_once(
            t.name, "stuck", Reason.TOMBSTONE_STUCK, now, cause=result.reason, errno=code, path=result.path
        )

    def _consider(self, entry: Entry, read: Read) -> None:
        """Decide one sandbox on the pass's one read, then act only if nothing changed since."""
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
        cause, verdict = _expiry(read, self.policy, now)
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
        if self._held_in_use(entry, key):
            return
        if self.after_decide is not None:
            self.after_decide(entry, _NO_TOMBSTONE)
        fresh = self.root.read(entry.namespace, entry.name)
        if isinstance(fresh, Transient) or not same_read(read, fresh):
            reason = Reason.MANIFEST_UNREAD if isinstance(fresh, Transient) else Reason.MANIFEST_CHANGED
            self._decide(key, "held", reason)
            return
        self._tombstone_and_delete(entry, key, read, cause, now)

    def _held_in_use(self, entry: Entry, key: str) -> bool:
        """Asked right before the rename: a sandbox someone uses (or might: unknown) is held this pass."""
        try:
            usage = self.in_use(entry.path)
        except Exception as err:
            self._decide(key, "held", Reason.IN_USE_UNKNOWN, error=str(err))
            return True
        if usage.holds:
            reason = usage.reason or (Reason.IN_USE if usage.in_use else Reason.IN_USE_UNKNOWN)
            self._decide(key, "held", reason, holders=",".join(usage.holders[:5]) or None)
            return True
        return False

    def _tombstone_and_delete(self, entry: Entry, key: str, read: Read, cause: Reason, now: datetime) -> None:
        if self.before_rename is not None:
            self.before_rename(entry, _NO_TOMBSTONE)
        try:
            t = self.root.tombstone(entry.namespace, entry.name, id=standalone_id(), now=now)
        except StoreError as err:
            self._decide(key, "held", Reason.RENAME_FAILED, errno=os.strerror(err.errno) if err.errno else None)
            return
        if self.after_rename is not None:
            self.after_rename(entry, t)
        moved = self.root.read_tombstone(t)
        if not same_read(read, moved):
            restored = self.root.restore(t, entry.namespace, entry.name)
            self._decide(key, "held", Reason.MANIFEST_CHANGED, tombstone=t.name, restored=restored)
            return
        started = time.monotonic()
        result = self.root.delete_tombstone(t)
        if result.ok:
            self._decide(
                key, "deleted", cause, tombstone=t.name, files=result.files, seconds=f"{time.monotonic() - started:.3f}"
            )
            return
        self._said[t.name] = now
        self._decide(
            key,
            "stuck",
            Reason.TOMBSTONE_STUCK,
            level=logging.WARNING,
            tombstone=t.name,
            cause=result.reason,
            errno=os.strerror(result.errno) if result.errno is not None else None,
            path=result.path,
        )

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


def _expiry(read: Read, policy: Policy, now: datetime) -> tuple[Reason | None, Verdict | None]:
    """The cause to delete on, or (None, verdict) to keep. No usable manifest is expired, as in the reference."""
    if isinstance(read, Present):
        verdict = deadline(read.manifest.facts(), policy, now)
        if not verdict.expired:
            return None, verdict
        return (verdict.reasons[-1] if verdict.reasons else Reason.EXPIRED), verdict
    if isinstance(read, Absent):
        return read.reason, None
    if isinstance(read, Unparsed | Unreadable):
        return read.reason, None
    return Reason.EXPIRED, None


# --- the CLI -------------------------------------------------------------------------------------------


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


def _duration_arg(text: str) -> timedelta:
    parsed = parse_duration(text)
    if isinstance(parsed, Invalid):
        raise argparse.ArgumentTypeError(str(parsed))
    return parsed


def _instant_arg(text: str) -> datetime:
    parsed = parse_instant(text)
    if isinstance(parsed, Invalid):
        raise argparse.ArgumentTypeError(str(parsed))
    return parsed


def _ref_arg(text: str) -> tuple[str, str]:
    ns, sep, name = text.partition("/")
    if not sep or not is_namespace_name(ns) or not is_object_name(name):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAMESPACE/NAME with Kubernetes names, e.g. team-a/run-42")
    return ns, name


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root",
        type=Path,
        default=os.environ.get("SANDKEEP_ROOT"),
        help="the sandbox root (default: $SANDKEEP_ROOT)",
    )
    if command == "retain":
        parser.add_argument("source", type=Path, help="the finished job's directory (moved by rename, never copied)")
        parser.add_argument("--namespace", required=True, help="the sandbox's namespace (a DNS-1123 label)")
        parser.add_argument("--name", required=True, help="the sandbox's name (a DNS-1123 subdomain)")
        parser.add_argument("--job-id", default=None, help="the job's id (default: the name)")
        parser.add_argument("--retention", type=_duration_arg, default=None, help="the window recorded now (72h)")
        parser.add_argument("--created-at", type=_instant_arg, default=None, help="when the job ran (default: now)")
        parser.add_argument("--node", default=None, help="the node name recorded in the manifest")
        parser.add_argument(
            "--exclude", action="extend", nargs="+", default=[], metavar="GLOB", help="remove these first (transcripts)"
        )
    elif command == "pin":
        parser.add_argument("sandbox", type=_ref_arg, metavar="NAMESPACE/NAME")
        how = parser.add_mutually_exclusive_group(required=True)
        how.add_argument("--for", dest="for_", type=_duration_arg, metavar="DURATION", help="pin for this long (72h)")
        how.add_argument("--until", type=_instant_arg, metavar="RFC3339", help="pin until this instant")
        how.add_argument("--clear", action="store_true", help="remove the pin")
        parser.add_argument("--max-pin", type=_duration_arg, default=None, help="the cap to warn against (30d)")
    elif command in ("ls", "sweep"):
        parser.add_argument("--retention", type=_duration_arg, default=None, help="the window (default 72h)")
        parser.add_argument("--max-pin", type=_duration_arg, default=None, help="the longest pin honoured (30d)")
        if command == "ls":
            parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
        else:
            parser.add_argument("--dry-run", action="store_true", help="decide and log, delete nothing")
            when = parser.add_mutually_exclusive_group()
            when.add_argument("--once", action="store_true", help="one pass, then exit (the default)")
            when.add_argument("--interval", type=_duration_arg, default=None, help="repeat every DURATION (10m)")
            parser.add_argument(
                "--ignore-pid",
                type=int,
                action="append",
                default=[],
                metavar="PID",
                help="a pid whose use does not count (e.g. an init that cannot be inspected); repeatable",
            )
            parser.add_argument(
                "--wait",
                type=float,
                default=0.0,
                metavar="SECONDS",
                help="how long to wait for another process's lock on the root (default 0: exit 3 at once)",
            )


def run(command: str, args: argparse.Namespace) -> int:
    """Run one standalone command; bad input is one line on stderr and exit 2, never a traceback."""
    try:
        if args.root is None:
            raise UsageError("--root is required (or set SANDKEEP_ROOT): the directory that holds the sandboxes")
        return _COMMANDS[command](args)
    except UsageError as err:
        print(f"sandkeep {command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except RootRefused as err:
        print(f"sandkeep {command}: {err}", file=sys.stderr)
        return EXIT_LOCKED if err.reason in (Reason.ROOT_LOCKED, Reason.ROOT_FOREIGN_OWNER) else EXIT_FAILED
    except StoreError as err:
        print(f"sandkeep {command}: {err}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as err:
        print(f"sandkeep {command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _policy(args: argparse.Namespace) -> Policy:
    try:
        settings = Settings()
    except ValueError as err:
        raise UsageError(f"bad SANDKEEP_* setting: {str(err).splitlines()[0]}") from err
    retention = args.retention if getattr(args, "retention", None) is not None else settings.retention
    max_pin = args.max_pin if getattr(args, "max_pin", None) is not None else settings.max_pin
    return Policy(retention, max_pin, bool(getattr(args, "dry_run", False)) or settings.dry_run)


def _retain(args: argparse.Namespace) -> int:
    root = Root(args.root)
    now = utcnow()
    manifest = root.retain(
        args.source,
        args.namespace,
        args.name,
        job_id=args.job_id or args.name,
        created_at=args.created_at or now,
        retention=args.retention,
        node=args.node,
        exclude=args.exclude,
        now=now,
    )
    until = f" until {manifest.retain_until}" if manifest.retain_until else ""
    print(f"retained {manifest.namespace}/{manifest.name} (job {manifest.job_id}){until}")
    return EXIT_OK


def _pin(args: argparse.Namespace) -> int:
    ns, name = args.sandbox
    now = utcnow()
    until = None if args.clear else (args.until if args.until is not None else now + args.for_)
    if until is not None and until <= now:
        raise UsageError(f"--until {format_instant(until)} is not in the future; pin until a later time")
    root = Root(args.root, create=False)
    manifest = root.pin(ns, name, until, now=now)
    if until is None:
        print(f"unpinned {ns}/{name}")
        return EXIT_OK
    verdict = deadline(manifest.facts(), _policy(args), now)
    print(f"pinned {ns}/{name} until {manifest.keep_until}")
    if Reason.PIN_CAPPED in verdict.reasons and verdict.deadline is not None:
        print(
            f"note: capped by the maximum pin ({format_duration(_policy(args).max_pin)}): kept until "
            f"{format_instant(verdict.deadline)}"
        )
    return EXIT_OK


def _row(root: Root, entry: Entry, read: Read, policy: Policy, now: datetime) -> dict[str, Any]:
    row: dict[str, Any] = {"namespace": entry.namespace, "name": entry.name, "deadline": None, "source": None}
    row.update(left=None, state="Expired", reasons=[str(read.reason)], size=root.size(entry.namespace, entry.name))
    if isinstance(read, Transient):
        row["state"] = "Unread"
    elif isinstance(read, Mismatch):
        row["state"] = "Refused"
    elif isinstance(read, Present):
        verdict = deadline(read.manifest.facts(), policy, now)
        left = verdict.time_left(now)
        row.update(
            deadline=format_instant(verdict.deadline) if verdict.deadline else None,
            source=str(verdict.source),
            left=format_duration(left) if left is not None else None,
            reasons=[str(r) for r in verdict.reasons],
            state="Expired" if verdict.expired else ("Pinned" if verdict.pinned else "Retained"),
        )
    return row


def _ls(args: argparse.Namespace) -> int:
    root = Root(args.root, create=False)
    policy, now = _policy(args), utcnow()
    scan = root.scan()
    rows = [_row(root, e, root.read(e.namespace, e.name), policy, now) for e in scan.sandboxes]
    tombs = [
        {"tombstone": t.name, "age": format_duration(t.age(now)), "stuck": t.age(now) >= STUCK_AFTER}
        for t in scan.tombstones
    ]
    strays = [{"entry": s.rel, "reason": str(s.reason)} for s in scan.strays]
    if args.output == "json":
        print(json.dumps({"sandboxes": rows, "tombstones": tombs, "strays": strays}, indent=2))
        return EXIT_OK
    header = ("NAMESPACE", "NAME", "DEADLINE", "SOURCE", "LEFT", "STATE", "SIZE")
    table = [header] + [
        (
            r["namespace"],
            r["name"],
            r["deadline"] or "-",
            r["source"] or "-",
            r["left"] or "-",
            r["state"],
            _human(r["size"]),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print(f"(no sandboxes in {root.path})")
    for t in tombs:
        print(f"tombstone {t['tombstone']}  age {t['age']}{'  STUCK' if t['stuck'] else ''}")
    for s in strays:
        print(f"not a sandbox: {s['entry']} ({s['reason']})")
    return EXIT_OK


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{size}B"


def _sweep(args: argparse.Namespace) -> int:
    root = Root(args.root)
    policy = _policy(args)
    sweeper = Sweeper(root, policy, in_use=in_use_checker(args.ignore_pid))
    stop = threading.Event()

    def _on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_term)
    with root.lock(wait=args.wait):
        logs.say(
            log,
            "sweep_started",
            root=root.path,
            retention=format_duration(policy.retention),
            max_pin=format_duration(policy.max_pin),
            dry_run=policy.dry_run,
            interval=format_duration(args.interval) if args.interval else "once",
        )
        while True:
            try:
                report = sweeper.run_pass()
            except OSError as err:  # the root itself could not be listed: say so, try again next interval
                logs.say(log, "sweep_failed", level=logging.ERROR, reason=Reason.DELETE_FAILED, root=root.path,
                         errno=os.strerror(err.errno or 0), error=str(err))  # fmt: skip
                if args.interval is None:
                    return EXIT_FAILED
                if stop.wait(args.interval.total_seconds()):
                    return EXIT_OK
                continue
            counts = {a: len(report.by_action(a)) for a in ("deleted", "held", "stuck", "kept", "would-delete")}
            logs.say(log, "sweep_pass", **{k.replace("-", "_"): v for k, v in counts.items()})
            if args.interval is None or stop.wait(args.interval.total_seconds()):
                return EXIT_OK


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "retain": _retain,
    "pin": _pin,
    "ls": _ls,
    "sweep": _sweep,
}
