"""`sandkeep doctor`: what needs a person, read from the cluster. Exit 1 when anything does.

Everything comes from what the components already publish: sandbox status and conditions (stuck
tombstones, holds), pin annotations, and the agents' heartbeat Leases (staleness, and the stuck
tombstones that have no object, which the agent lists in the Lease's `sandkeep.io/orphan-tombstones`
annotation). Doctor never touches a disk and never changes an object.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from controller import contracts as c
from controller import kube, leases
from controller.durations import Invalid, format_duration, parse_duration, parse_instant
from controller.kube import Kube, Obj
from controller.store import parse_tombstone

ORPHANS_ANNOTATION = c.ANN_ORPHAN_TOMBSTONES
LAPSING_WITHIN = timedelta(days=1)
_STUCK = re.compile(r"could not be deleted: (?P<errno>\S+) at (?P<path>.+?)\. Retried")


@dataclass
class Report:
    stuck: list[list[str]] = field(default_factory=list)
    held: list[list[str]] = field(default_factory=list)
    lapsing: list[list[str]] = field(default_factory=list)
    stale: list[list[str]] = field(default_factory=list)
    orphans: list[list[str]] = field(default_factory=list)

    @property
    def needs_a_person(self) -> bool:
        return bool(self.stuck or self.held or self.stale or self.orphans)


def _age(since: datetime | None, now: datetime) -> str:
    return "?" if since is None else format_duration(max(now - since, timedelta(0)))


def _instant(text: Any) -> datetime | None:
    parsed = parse_instant(text) if isinstance(text, str) else None
    return None if parsed is None or isinstance(parsed, Invalid) else parsed


def _ref(obj: Obj) -> str:
    ns, name = kube.key_of(obj)
    return f"{ns}/{name}"


def _stuck_row(obj: Obj, now: datetime) -> list[str] | None:
    status = obj.get("status") or {}
    cond = kube.condition_of(obj, c.Condition.TOMBSTONE_STUCK)
    if status.get("phase") != str(c.Phase.STUCK) and not (cond and cond.get("status") == "True"):
        return None
    tomb = parse_tombstone(status.get("tombstone") or "")
    since = tomb.made_at if tomb else _instant(obj["metadata"].get("deletionTimestamp"))
    m = _STUCK.search((cond or {}).get("message", ""))
    node = (obj.get("spec") or {}).get("nodeName", "?")
    errno, path = (m["errno"], m["path"]) if m else ("?", status.get("tombstone", "?"))
    return [_ref(obj), node, _age(since, now), errno, path]


def _held_row(obj: Obj) -> list[str] | None:
    status = obj.get("status") or {}
    if status.get("phase") != str(c.Phase.HELD):
        return None
    why = []
    for type_ in (c.Condition.ORPHANS_SURVIVED, c.Condition.IN_USE):
        cond = kube.condition_of(obj, type_)
        if cond and cond.get("status") in ("True", "Unknown"):
            why.append(f"{cond.get('reason')}: {cond.get('message', '')}")
    if not why and status.get("heldBy"):
        why.append("held by " + "; ".join(status["heldBy"]))
    deleting = "deleting" if kube.is_deleting(obj) else "expired"
    return [_ref(obj), (obj.get("spec") or {}).get("nodeName", "?"), deleting, " | ".join(why) or "?"]


def _lapsing_row(obj: Obj, now: datetime) -> list[str] | None:
    status = obj.get("status") or {}
    until = _instant(status.get("pinnedUntil")) or _instant(kube.annotations_of(obj).get(c.ANN_PIN_UNTIL))
    if until is None or not now < until <= now + LAPSING_WITHIN:
        return None
    return [_ref(obj), (obj.get("spec") or {}).get("nodeName", "?"), until.isoformat(), format_duration(until - now)]


def build_report(sandboxes: list[Obj], heartbeats: dict[str, leases.LeaseState], stale_after: timedelta) -> Report:
    """The whole report from what the API server returned; pure, so it is tested without a cluster too."""
    now = datetime.now(UTC)
    report = Report()
    nodes = set()
    for obj in sorted(sandboxes, key=_ref):
        nodes.add((obj.get("spec") or {}).get("nodeName"))
        if (row := _stuck_row(obj, now)) is not None:
            report.stuck.append(row)
        elif (row := _held_row(obj)) is not None:
            report.held.append(row)
        if (row := _lapsing_row(obj, now)) is not None:
            report.lapsing.append(row)
    for node in sorted(n for n in nodes | set(heartbeats) if n):
        state = heartbeats.get(node)
        age = None if state is None else state.age(now)
        if state is None:
            report.stale.append([node, "never", "no heartbeat Lease: is the agent running on this node?"])
        elif age is None or age > stale_after:
            report.stale.append([node, _age(state.renew_time, now), f"last renewed by {state.holder or '?'}"])
        if state is not None:
            for item in _orphans(state):
                report.orphans.append([node, item.get("name", "?"), str(item.get("errno", "?")), str(item.get("path"))])
    return report


def _orphans(state: leases.LeaseState) -> list[dict[str, Any]]:
    text = (state.raw.get("metadata", {}).get("annotations") or {}).get(ORPHANS_ANNOTATION)
    try:
        items = json.loads(text) if text else []
    except ValueError:
        return []
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _table(title: str, header: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f"{title}: {empty}\n"
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"{title} ({len(rows)}):"]
    for r in [header, *rows]:
        lines.append("  " + "  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


def render(report: Report) -> str:
    parts = [
        _table("Stuck tombstones", ["SANDBOX", "NODE", "AGE", "ERRNO", "PATH"], report.stuck, "none"),
        _table("Held sandboxes", ["SANDBOX", "NODE", "STATE", "WHY"], report.held, "none"),
        _table("Orphan tombstones (no object)", ["NODE", "TOMBSTONE", "ERRNO", "PATH"], report.orphans, "none"),
        _table("Agents not reporting", ["NODE", "LAST HEARTBEAT", "NOTE"], report.stale, "none"),
        _table("Pins lapsing within a day", ["SANDBOX", "NODE", "PINNED UNTIL", "LEFT"], report.lapsing, "none"),
    ]
    verdict = "needs a person" if report.needs_a_person else "nothing needs a person"
    return "\n".join(parts) + f"\nsandkeep doctor: {verdict}\n"


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    parser.add_argument("--namespace", default="sandkeep-system", help="namespace of the agents' heartbeat Leases")
    parser.add_argument("--stale-after", default="2m", help="a heartbeat older than this is stale (default 2m)")
    parser.add_argument("--sandbox-namespace", default=None, help="only sandboxes of this namespace (default: all)")


def run(command: str, args: argparse.Namespace) -> int:
    stale_after = parse_duration(args.stale_after)
    if isinstance(stale_after, Invalid):
        print(f"sandkeep doctor: --stale-after {stale_after}", file=sys.stderr)
        return 2
    try:
        client = Kube(kube.load_config(args.kubeconfig), component="sandkeep-doctor")
        sandboxes = client.list_sandboxes(namespace=args.sandbox_namespace)
        heartbeats = leases.agent_heartbeats(client, args.namespace)
    except Exception as err:  # a bad kubeconfig, no route, no access: all the same to a person here
        print(f"sandkeep doctor: cannot read the cluster: {err}; check --kubeconfig and your access", file=sys.stderr)
        return 2
    report = build_report(sandboxes, heartbeats, stale_after)
    print(render(report), end="")
    return 1 if report.needs_a_person else 0
