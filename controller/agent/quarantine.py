"""Quarantine: root entries no object can own, watched for a grace period, then deleted through the pipeline.

Unadoptable: what the scan finds is not a sandbox (a link, a file, a bad name) and what adoption refuses (no
manifest, one that does not parse, cannot be read or names another sandbox, no usable createdAt, a namespace
that does not exist). Each is quarantined: said when first seen (and once per relog period), counted in
`sandkeep_quarantined_entries{reason}`, published on the heartbeat Lease for `doctor`, and once the agent has
watched it unadoptable for `--quarantine-grace` in all, deleted by `Reaper.reap_unadoptable` (fresh in-use
check, renamed as a name to a tombstone, never followed). One that becomes adoptable meanwhile (its manifest
fixed, its namespace created) leaves quarantine and is adopted; one replaced under its name starts again.

The clock is the agent's own: the seconds between two passes that both saw the entry as the same inode
(monotonic, at most `max_step` each), summed and kept in the root's own `.sandkeep-quarantine.json`, so a
restart goes on where it stopped. Nothing an entry's writer controls (its mtime, its contents) and no wall
clock moves it; time the agent was not running does not count, so a grace is only ever longer than asked.
A grace of 0 never deletes: quarantine then only reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from controller.agent.adoption import Refusal
from controller.agent.report import Reporter
from controller.agent.state import Part, Shared
from controller.node.reaper import Claim, Deleted, Held, Outcome, Stuck, Unadoptable
from controller.node.store import Stray
from controller.observe import logs
from controller.rules.contracts import QUARANTINE_FILE, Reason
from controller.rules.durations import format_duration, format_instant

log = logging.getLogger("sandkeep.agent")

MAX_RECORDS = 10_000  # entries timed at once (the state file stays ~1 MB); more are reported, timed later
PUBLISHED = 20  # entries named on the heartbeat Lease for `doctor` (with the total)
_STRAY_ACTION = "not a sandbox (never followed); remove it, or it is deleted after the grace"

Reap = Callable[[list[Unadoptable]], Awaitable[list[Outcome]]]


@dataclass(frozen=True)
class Sighting:
    """One unadoptable entry as this pass saw it: its scan name, why, its inode, and for a sandbox-shaped
    one the read it was refused on (so a fixed manifest holds its deletion)."""

    rel: str
    reason: Reason
    ident: tuple[int, int]
    claim: Claim | None
    action: str


@dataclass(frozen=True)
class Record:
    """How long the agent has watched one entry unadoptable, as the same inode."""

    ident: tuple[int, int]
    reason: str
    watched: float = 0.0


def advance(
    records: dict[str, Record], seen: Iterable[Sighting], step: float, limit: int = MAX_RECORDS
) -> dict[str, Record]:
    """The records after a pass that saw `seen`, `step` seconds after the last pass that counted (pure).

    An entry seen again as the same inode gains `step`; a new one, or one replaced under its name, starts
    at 0 while fewer than `limit` are timed; one not seen (gone, adopted, or unread this pass) is forgotten,
    so a later sighting starts again: every doubt makes a deletion later, never sooner.
    """
    seen = list(seen)
    out: dict[str, Record] = {}
    for s in seen:
        old = records.get(s.rel)
        if old is not None and old.ident == s.ident:
            out[s.rel] = Record(s.ident, str(s.reason), old.watched + step)
    for s in seen:
        if s.rel not in out and len(out) < limit:
            out[s.rel] = Record(s.ident, str(s.reason))
    return out


def due(records: dict[str, Record], grace: timedelta) -> list[str]:
    """The entries watched for the whole grace, oldest first; none when the grace is 0 (never delete)."""
    if grace <= timedelta(0):
        return []
    limit = grace.total_seconds()
    return sorted((rel for rel, r in records.items() if r.watched >= limit), key=lambda rel: -records[rel].watched)


def dumps(records: dict[str, Record]) -> bytes:
    body = {
        "version": 1,
        "entries": {
            rel: {"dev": r.ident[0], "ino": r.ident[1], "reason": r.reason, "watched": round(r.watched, 1)}
            for rel, r in sorted(records.items())
        },
    }
    return (json.dumps(body, indent=1) + "\n").encode()


def loads(data: bytes | None) -> dict[str, Record]:
    """The records of a state file; anything that is not one this module wrote is skipped (an empty start
    only makes deletions later)."""
    try:
        body = json.loads(data) if data else {}
    except ValueError:
        return {}
    entries = body.get("entries") if isinstance(body, dict) and body.get("version") == 1 else None
    if not isinstance(entries, dict):
        return {}
    out: dict[str, Record] = {}
    for rel, item in list(entries.items())[:MAX_RECORDS]:
        if not isinstance(item, dict):
            continue
        dev, ino, reason, watched = item.get("dev"), item.get("ino"), item.get("reason"), item.get("watched")
        if not (isinstance(dev, int) and isinstance(ino, int) and isinstance(watched, int | float)):
            continue
        if dev >= 0 and ino >= 0 and math.isfinite(watched) and watched >= 0 and isinstance(reason, str):
            out[rel] = Record((dev, ino), reason[:64], float(watched))
    return out


class Quarantine(Part):
    def __init__(self, shared: Shared, report: Reporter, reap: Reap, namespace_exists: Callable[[str], bool]) -> None:
        super().__init__(shared)
        self.report = report
        self.reap = reap
        self.namespace_exists = namespace_exists
        self.records = loads(self.root.read_private(QUARANTINE_FILE))
        self.saved = dumps(self.records)
        self.last: float | None = None  # monotonic time of the last pass that counted
        self.max_step = max(2 * self.s.scan_interval.total_seconds(), 60.0)  # a stalled loop counts no more
        self.published = ""  # JSON for the heartbeat Lease (`doctor`)

    async def tend(self, strays: list[Stray], refused: list[Refusal]) -> None:
        """One pass: time what this pass found unadoptable, say it, count it, delete what is due."""
        if not self.state.synced:
            return  # without the full listing, an object might own any of them
        seen = await asyncio.to_thread(self._sightings, strays, refused)
        now = time.monotonic()
        step = 0.0 if self.last is None else min(now - self.last, self.max_step)
        self.last = now
        self.records = advance(self.records, seen, step)
        grace = self.s.quarantine_grace
        for s in seen:
            self.report.say_limited(
                f"quarantine:{s.rel}",
                "quarantined",
                reason=Reason.QUARANTINED,
                cause=s.reason,
                entry=s.rel,
                delete_after=format_duration(grace) if grace else "never",
                action=s.action,
            )
        gone = await self._delete_due({s.rel: s for s in seen})
        left = [s for s in seen if s.rel not in gone]
        self.m.quarantined.clear()
        for reason, n in Counter(str(s.reason) for s in left).items():
            self.m.quarantined.labels(self.s.node, reason).set(n)
        self._save()
        self.published = self._publish(len(left))

    def _sightings(self, strays: list[Stray], refused: list[Refusal]) -> list[Sighting]:
        """Each unadoptable entry with its inode (lstat, never followed); one gone meanwhile is not seen."""
        out = []
        found: list[tuple[str, Reason, Claim | None, str]] = [(s.rel, s.reason, None, _STRAY_ACTION) for s in strays]
        for r in refused:
            found.append((f"{r.entry.namespace}/{r.entry.name}", r.reason, Claim(decided=r.read), r.action))
        for rel, reason, claim, action in found:
            try:
                st = self.root.lstat_entry(rel)
            except (OSError, ValueError):
                continue
            if st is None or (claim is not None and not stat.S_ISDIR(st.st_mode)):
                continue  # gone, or no longer a directory: the next scan says what it is
            out.append(Sighting(rel, reason, (st.st_dev, st.st_ino), claim, action))
        return out

    async def _delete_due(self, seen: dict[str, Sighting]) -> set[str]:
        """Delete what was watched for the whole grace, asking first whether an object or its namespace
        appeared meanwhile (then it is adopted instead, this pass or the next); the entries now gone."""
        targets = []
        for rel in due(self.records, self.s.quarantine_grace):
            s = seen[rel]
            key = tuple(rel.split("/"))
            if key in self.state.objects:
                continue
            if s.reason == Reason.NAMESPACE_MISSING and await asyncio.to_thread(self.namespace_exists, key[0]):
                continue
            targets.append(Unadoptable(rel, s.ident, s.claim))
        if not targets:
            return set()
        if self.s.dry_run:
            for t in targets:
                self.report.say_limited(
                    f"quarantine-due:{t.rel}", "quarantine_would_delete", reason=Reason.WOULD_DELETE, entry=t.rel
                )
            return set()
        outcomes = await self.reap(targets)
        for target, outcome in zip(targets, outcomes, strict=True):
            self._after(seen[target.rel], outcome)
        return {t.rel for t, o in zip(targets, outcomes, strict=True) if isinstance(o, Deleted | Stuck)}

    def _after(self, s: Sighting, outcome: Outcome) -> None:
        """Say one deletion's outcome; forget the entry unless it is still there, the same, and held."""
        if isinstance(outcome, Held) and outcome.tombstone is None:
            holders = "; ".join(outcome.usage.holders[:3]) if outcome.usage is not None else None
            self.report.say_limited(
                f"quarantine-held:{s.rel}",
                "quarantine_held",
                reason=outcome.reason,
                cause=s.reason,
                entry=s.rel,
                holders=holders,
                error=outcome.error,
                action="kept until nothing uses it (checked again every pass)",
            )
            return
        self.records.pop(s.rel, None)
        self.state.said.pop(f"quarantine:{s.rel}", None)
        self.state.said.pop(f"quarantine-held:{s.rel}", None)
        if isinstance(outcome, Deleted):
            self.m.quarantine_deletions.labels(self.s.node, str(s.reason)).inc()
            kv: dict[str, Any] = {"tombstone": outcome.tombstone, "files": outcome.files}
            logs.say(log, "quarantine_deleted", reason=Reason.QUARANTINE_EXPIRED, cause=s.reason, entry=s.rel, **kv)
        elif isinstance(outcome, Stuck):  # an orphan tombstone now: the leftover sweep retries it every pass
            self.m.deletion_failures.labels(self.s.node, str(outcome.cause)).inc()
            self.report.say_limited(
                f"stuck:{outcome.tombstone}",
                "tombstone_stuck",
                reason=outcome.reason,
                entry=s.rel,
                tombstone=outcome.tombstone,
                path=outcome.path,
                orphan=True,
            )
        else:  # gone, replaced or fixed since it was decided on: the next pass sees it as what it is now
            logs.say(log, "quarantine_left", reason=outcome.reason, cause=s.reason, entry=s.rel)

    def _save(self) -> None:
        data = dumps(self.records)
        if data == self.saved:
            return
        try:
            self.root.write_private(QUARANTINE_FILE, data)
        except OSError as err:  # the clock then restarts after a restart: later, never sooner
            self.report.say_limited(
                "quarantine-file", "quarantine_unsaved", reason=Reason.AGENT_ERROR, error=repr(err)[:300]
            )
            return
        self.saved = data

    def _publish(self, total: int) -> str:
        """What `doctor` shows: the entries closest to deletion first (at most PUBLISHED) and the total.

        Times are wall-clock estimates rounded to the minute (since, and deleteAt unless the grace is 0):
        they stay the same from pass to pass, so the Lease is written when something changes, not each pass.
        """
        if not total:
            return ""
        grace = self.s.quarantine_grace.total_seconds()
        now = time.time()
        rows = sorted(self.records.items(), key=lambda kv: -kv[1].watched)[:PUBLISHED]
        entries = [
            {
                "entry": rel[:300],
                "reason": r.reason,
                "since": _minute(now - r.watched),
                "deleteAt": _minute(now + max(grace - r.watched, 0)) if grace else None,
            }
            for rel, r in rows
        ]
        return json.dumps({"total": total, "grace": int(grace), "entries": entries}, sort_keys=True)


def _minute(unix: float) -> str:
    return format_instant(datetime.fromtimestamp(round(unix / 60) * 60, UTC))
