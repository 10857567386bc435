"""The standalone mode: one host, one root, no cluster. `sandkeep retain | pin | ls | sweep`.

`sweep` runs the standalone sweep (`sweep.py`): leftover tombstones first, every manifest read once and
judged by the one rule, the safe delete through the one pipeline, one line per decision.

`retain` under a name already taken replaces the previous sandbox only as the sweep would delete it: never a
pinned one, through the same pipeline (orphans reaped, in use asked fresh, tombstone), under the root lock
(`Replacer`); anything that holds it refuses the retain and leaves the source where it was.

Exit codes: 0 done, 1 a command did not do what was asked (say, pinning an absent sandbox, or replacing a
sandbox that is pinned or in use), 2 bad input, 3 the root is locked by another process (a sweep, an agent)
or owned by another uid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError, field_validator

from controller.cli.sweep import (
    ORPHAN_TIMEOUT,
    RELOG_EVERY,
    STUCK_AFTER,
    Sweeper,
    history_newer,
    in_use_checker,
    strerror,
    utcnow,
)
from controller.node.reaper import Claim, Deleted, Held, Outcome, Reaper, Refused, Restored, Stuck, Target
from controller.node.store import (
    Entry,
    Mismatch,
    Present,
    Read,
    Refusal,
    Root,
    RootRefused,
    StoreError,
    Transient,
    standalone_id,
)
from controller.observe import logs
from controller.rules.contracts import ORIGIN_LABELS, OUTCOME_FLAG, Reason
from controller.rules.contracts import Outcome as CaptureOutcome
from controller.rules.durations import Invalid, format_duration, format_instant, parse_duration, parse_instant
from controller.rules.flags import HumanDuration, JsonObject, settings_from
from controller.rules.models import Origin, Settings, is_namespace_name, is_object_name
from controller.rules.objects import Obj, history_setting
from controller.rules.policy import Policy, deadline
from controller.rules.sizes import human_size

log = logging.getLogger("sandkeep.sweep")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LOCKED = 0, 1, 2, 3


# --- a retain that replaces a previous sandbox ---------------------------------------------------------


@dataclass
class Replacer:
    """`Root.retain`'s `replace`: a previous sandbox of the same name goes only as a deletion would go.

    Through the sweep's pipeline (`reaper`: recorded orphans reaped, in use asked fresh, the claim read
    again, tombstone, read back, delete), under the root lock, taken at the first replacement and held in
    `stack` until the retain is done, so no sweep or agent works on the root meanwhile. Whatever holds the
    previous one (a process, a surviving orphan, the lock, a pin or a retry landing meanwhile) is a refusal,
    and so is a previous sandbox retained for a cluster node (`--node`): only its object's deletion may go.
    """

    reaper: Reaper
    stack: contextlib.ExitStack
    wait: float = 0.0
    locked: bool = False

    def __call__(self, namespace: str, name: str, read: Read) -> Refusal | None:
        node = read.manifest.node if isinstance(read, Present | Mismatch) else None
        if node:  # a cluster's sandbox: its pins and sessions are in the API, which this process cannot see
            return Refusal(
                Reason.CLUSTER_OWNED,
                f"it was retained for node {node}, so its pins live on its RetainedSandbox, which a retain cannot see",
                f"Delete it through the cluster (`kubectl delete rsb -n {namespace} {name}`), then retain again once "
                "it is gone, or retain under another name",
            )
        if not self.locked:
            try:
                self.stack.enter_context(self.reaper.root.lock(wait=self.wait))
            except RootRefused as err:
                return Refusal(
                    err.reason,
                    f"replacing it deletes it, and only the holder of the root lock deletes: {err}",
                    f"In a cluster the agent holds it: `kubectl delete rsb -n {namespace} {name}` deletes the previous "
                    "one through the agent, then retain again; standalone, retry once the sweep is done (--wait), or "
                    "retain under another name",
                )
            self.locked = True
        target = Target(namespace, name, standalone_id(), Claim(decided=read), Reason.REPLACED)
        return _refusal(self.reaper.reap(target), f"{namespace}/{name}")


def _refusal(outcome: Outcome, key: str) -> Refusal | None:
    """What a replacement's pipeline outcome means for the retain: None once the name is free."""
    match outcome:
        case Deleted():
            logs.say(log, "retain_replaced", reason=Reason.REPLACED, entry=key, files=outcome.files)
            return None
        case Stuck():  # renamed aside, so the name is free; the tombstone is the sweep's to retry (and alert on)
            logs.say(
                log,
                "retain_replaced_stuck",
                level=logging.WARNING,
                reason=outcome.reason,
                entry=key,
                tombstone=outcome.tombstone,
                cause=outcome.cause,
                errno=strerror(outcome.errno),
                path=outcome.path,
            )
            return None
        case Refused(reason=Reason.LOST):
            return None  # nothing (or no directory) there any more: the name is free
        case Refused() | Restored():
            return Refusal(
                outcome.reason,
                "it changed while being replaced (a pin or another retain landed); it is kept",
                "Look at it with `sandkeep ls`, then retain again or under another name",
            )
        case Held(survivors=survivors) if survivors:
            pids = ", ".join(str(s) for s in survivors[:5])
            return Refusal(outcome.reason, f"recorded orphan commands survived being killed: {pids}")
        case Held(usage=usage) if usage is not None:
            holders = "; ".join(usage.holders[:5]) or "unknown"
            what = "in use" if usage.in_use else "whether it is in use cannot be known"
            return Refusal(outcome.reason, f"{what}: {holders}")
        case Held():
            return Refusal(outcome.reason, outcome.error or f"held ({outcome.reason})")
    return Refusal(outcome.reason, f"not deleted ({outcome.reason})")  # WouldDelete: a replacement is never dry


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


def _label_arg(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or key not in ORIGIN_LABELS:
        raise argparse.ArgumentTypeError(f"{text!r}: KEY=VALUE with KEY one of {', '.join(ORIGIN_LABELS)}")
    return key, value


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
            OUTCOME_FLAG,
            choices=[str(o) for o in CaptureOutcome],
            default=None,
            help="how the job ended, recorded in the manifest (spec.origin.outcome): a policy may keep each outcome "
            "for its own time (SANDKEEP_RETENTION_FAILED, ...)",
        )
        parser.add_argument(
            "--label",
            action="append",
            default=[],
            type=_label_arg,
            metavar="KEY=VALUE",
            help=f"a pipeline label recorded with {OUTCOME_FLAG} (spec.origin.labels), one of "
            f"{', '.join(ORIGIN_LABELS)}: what --history-limits groups by; repeatable",
        )
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
        for outcome in CaptureOutcome:
            parser.add_argument(
                f"--retention-{outcome.lower()}",
                type=_duration_arg,
                default=None,
                help=f"the window of sandboxes whose job ended {outcome} (default: --retention)",
            )
        parser.add_argument("--max-pin", type=_duration_arg, default=None, help="the longest pin honoured (30d)")
        parser.add_argument(
            "--history-limits",
            default=None,
            metavar="JSON",
            help="keep at most N per outcome in each group, as a SandboxPolicy's historyLimits: "
            '{"groupBy": "job-name", "succeeded": 3, "failed": 10, "keepLastFailed": 1} (default: none)',
        )
        parser.add_argument(
            "--stuck-after", type=_duration_arg, default=None, help="a tombstone this old is stuck (10m)"
        )
        if command == "ls":
            parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
        else:
            parser.add_argument("--dry-run", action="store_true", default=None, help="decide and log, delete nothing")
            parser.add_argument("--relog-every", type=_duration_arg, default=None, help="repeat a stuck line (1d)")
            parser.add_argument(
                "--orphan-timeout", type=_duration_arg, default=None, help="wait for killed orphans (10s)"
            )
            when = parser.add_mutually_exclusive_group()
            when.add_argument("--once", action="store_true", help="one pass, then exit (the default)")
            when.add_argument("--interval", type=_duration_arg, default=None, help="repeat every DURATION (10m)")
    if command in ("retain", "sweep"):  # both delete: a retain when it replaces a sandbox of the same name
        if command == "retain":
            parser.add_argument(
                "--orphan-timeout", type=_duration_arg, default=None, help="wait for killed orphans (10s)"
            )
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
    except StoreError as err:  # RootRefused too; a retain refused a replacement for the lock says RootLocked
        print(f"sandkeep {command}: {err}", file=sys.stderr)
        return EXIT_LOCKED if err.reason in (Reason.ROOT_LOCKED, Reason.ROOT_FOREIGN_OWNER) else EXIT_FAILED
    except ValueError as err:
        print(f"sandkeep {command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


class SweepSettings(Settings):
    """The standalone commands' settings: `SANDKEEP_*` env vars, overridden by flags (`flags.settings_from`)."""

    stuck_after: HumanDuration = STUCK_AFTER
    relog_every: HumanDuration = RELOG_EVERY
    orphan_timeout: HumanDuration = ORPHAN_TIMEOUT
    # A SandboxPolicy's historyLimits, for every namespace of the root (issue 28): `{"groupBy": "job-name", ...}`.
    history_limits: JsonObject | None = None

    @field_validator("history_limits")
    @classmethod
    def _history(cls, v: Obj | None) -> Obj | None:
        if v is not None:
            history_setting(v)  # the policy's own parser: a bad one stops the command at start, saying why
        return v

    def policy(self) -> Policy:
        history = history_setting(self.history_limits) if self.history_limits is not None else None
        return replace(super().policy(), history=history)


def _settings(args: argparse.Namespace) -> SweepSettings:
    try:
        return settings_from(SweepSettings, args)
    except ValidationError as err:  # the setting and what is wrong with it, not pydantic's header line
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise UsageError(f"bad SANDKEEP_* setting {where}: {first['msg']}") from err
    except ValueError as err:
        raise UsageError(f"bad SANDKEEP_* setting: {str(err).splitlines()[0]}") from err


def _policy(args: argparse.Namespace) -> Policy:
    return _settings(args).policy()


def _retain(args: argparse.Namespace) -> int:
    root = Root(args.root)
    settings, now = _settings(args), utcnow()
    reaper = Reaper(
        root,
        in_use_checker(args.ignore_pid),
        stuck_after=settings.stuck_after,
        orphan_timeout=settings.orphan_timeout,
    )
    with contextlib.ExitStack() as stack:
        manifest = root.retain(
            args.source,
            args.namespace,
            args.name,
            job_id=args.job_id or args.name,
            created_at=args.created_at or now,
            retention=args.retention,
            node=args.node,
            exclude=args.exclude,
            origin=_origin(args),
            now=now,
            replace=Replacer(reaper, stack, wait=args.wait),
        )
    until = f" until {manifest.retain_until}" if manifest.retain_until else ""
    print(f"retained {manifest.namespace}/{manifest.name} (job {manifest.job_id}){until}")
    return EXIT_OK


def _origin(args: argparse.Namespace) -> Origin | None:
    """What `retain` records of the job: its outcome and pipeline labels (labels need an outcome: no group
    counts a sandbox without one)."""
    if args.outcome is None:
        if args.label:
            raise UsageError(f"--label needs {OUTCOME_FLAG}: the history limits count each outcome apart")
        return None
    return Origin(outcome=CaptureOutcome(args.outcome), labels=dict(args.label))


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


def _row(root: Root, entry: Entry, read: Read, policy: Policy, now: datetime, newer: int | None) -> dict[str, Any]:
    row: dict[str, Any] = {"namespace": entry.namespace, "name": entry.name, "deadline": None, "source": None}
    row.update(left=None, state="Expired", reasons=[str(read.reason)], size=root.size(entry.namespace, entry.name))
    if isinstance(read, Transient):
        row["state"] = "Unread"
    elif isinstance(read, Mismatch):
        row["state"] = "Refused"
    elif isinstance(read, Present):
        verdict = deadline(read.manifest.facts(newer), policy, now)
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
    settings, now = _settings(args), utcnow()
    policy = settings.policy()
    scan = root.scan()
    reads = root.read_many(scan.sandboxes)
    newer = history_newer(policy, reads.values())
    rows = []
    for e in scan.sandboxes:
        key = (e.namespace, e.name)
        rows.append(_row(root, e, reads[key], policy, now, newer.get(key)))
    tombs = [
        {"tombstone": t.name, "age": format_duration(t.age(now)), "stuck": t.age(now) >= settings.stuck_after}
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
            human_size(r["size"]),
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


def _sweep(args: argparse.Namespace) -> int:
    root = Root(args.root)
    settings = _settings(args)
    policy = settings.policy()
    sweeper = Sweeper(
        root,
        policy,
        in_use=in_use_checker(args.ignore_pid),
        stuck_after=settings.stuck_after,
        relog_every=settings.relog_every,
        orphan_timeout=settings.orphan_timeout,
    )
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
                logs.say(
                    log,
                    "sweep_failed",
                    level=logging.ERROR,
                    reason=Reason.DELETE_FAILED,
                    root=root.path,
                    errno=os.strerror(err.errno or 0),
                    error=str(err),
                )
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
