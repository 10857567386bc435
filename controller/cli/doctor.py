"""`sandkeep doctor`: what needs a person, read from the cluster. Exit 1 when anything does.

Everything comes from what the components already publish: sandbox status and conditions (stuck
tombstones, holds), pin annotations, and the agents' heartbeat Leases (staleness, and the stuck
tombstones that have no object, which the agent lists in the Lease's `sandkeep.io/orphan-tombstones`
annotation, a disk above its high watermark with only pinned or held sandboxes left, in
`sandkeep.io/pressure`, and the entries of its root no object can own, quarantined until their grace
ends, in `sandkeep.io/quarantine`: per-node detail the API holds nowhere else). Doctor never touches a
disk and never changes an object.

The install's namespace is found, not assumed: sandkeep's Leases (the agents' heartbeats, labelled
`app.kubernetes.io/managed-by=sandkeep`, and the controller's `sandkeep-controller`) are looked up
cluster-wide, and the one namespace holding a live one is the install's (`--install-namespace` still wins).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from controller.api import kube, leases
from controller.api.kube import Kube
from controller.node.store import parse_tombstone
from controller.rules import contracts as c
from controller.rules import flags, objects
from controller.rules.durations import Invalid, format_duration, instant_or_none, parse_duration
from controller.rules.objects import Obj
from controller.rules.sizes import human_size

ORPHANS_ANNOTATION = c.ANN_ORPHAN_TOMBSTONES
LAPSING_WITHIN = timedelta(days=1)
_STUCK = re.compile(r"could not be deleted: (?P<errno>\S+) at (?P<path>.+?)\. Retried")


@dataclass
class Report:
    stuck: list[list[str]] = field(default_factory=list)
    held: list[list[str]] = field(default_factory=list)
    lapsing: list[list[str]] = field(default_factory=list)
    expiring: list[list[str]] = field(default_factory=list)  # deadlines within a day (issue 28): informative
    stale: list[list[str]] = field(default_factory=list)
    orphans: list[list[str]] = field(default_factory=list)
    pressure: list[list[str]] = field(default_factory=list)  # unrelieved disk pressure: the largest kept
    quarantined: list[list[str]] = field(default_factory=list)  # unadoptable entries, deleted after the grace
    notes: list[str] = field(default_factory=list)

    @property
    def needs_a_person(self) -> bool:
        return bool(self.stuck or self.held or self.stale or self.orphans or self.pressure or self.quarantined)


def _age(since: datetime | None, now: datetime) -> str:
    return "?" if since is None else format_duration(max(now - since, timedelta(0)))


def _ref(obj: Obj) -> str:
    ns, name = objects.key_of(obj)
    return f"{ns}/{name}"


def _stuck_row(obj: Obj, now: datetime) -> list[str] | None:
    status = obj.get("status") or {}
    cond = objects.condition_of(obj, c.Condition.TOMBSTONE_STUCK)
    if status.get("phase") != str(c.Phase.STUCK) and not (cond and cond.get("status") == "True"):
        return None
    tomb = parse_tombstone(status.get("tombstone") or "")
    since = tomb.made_at if tomb else instant_or_none(obj["metadata"].get("deletionTimestamp"))
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
        cond = objects.condition_of(obj, type_)
        if cond and cond.get("status") in ("True", "Unknown"):
            why.append(f"{cond.get('reason')}: {cond.get('message', '')}")
    if not why and status.get("heldBy"):
        why.append("held by " + "; ".join(status["heldBy"]))
    deleting = "deleting" if objects.is_deleting(obj) else "expired"
    return [_ref(obj), (obj.get("spec") or {}).get("nodeName", "?"), deleting, " | ".join(why) or "?"]


def _lapsing_row(obj: Obj, now: datetime) -> list[str] | None:
    status = obj.get("status") or {}
    until = instant_or_none(status.get("pinnedUntil")) or instant_or_none(
        objects.annotations_of(obj).get(c.ANN_PIN_UNTIL)
    )
    if until is None or not now < until <= now + LAPSING_WITHIN:
        return None
    return [_ref(obj), (obj.get("spec") or {}).get("nodeName", "?"), until.isoformat(), format_duration(until - now)]


def _expiring_row(obj: Obj, now: datetime) -> list[str] | None:
    """A sandbox the controller keeps (Retained, Pinned, Open) whose deadline comes within a day, and whether it
    was warned of (condition ExpiringSoon, its policy's warnBefore)."""
    status = obj.get("status") or {}
    until = instant_or_none(status.get("deadline"))
    kept = status.get("phase") in (c.Phase.RETAINED, c.Phase.PINNED, c.Phase.OPEN)
    if until is None or not kept or not now < until <= now + LAPSING_WITHIN or objects.is_deleting(obj):
        return None
    warned = (objects.condition_of(obj, c.Condition.EXPIRING_SOON) or {}).get("status") == "True"
    source = str(status.get("deadlineSource") or "?")
    row = [_ref(obj), (obj.get("spec") or {}).get("nodeName", "?"), until.isoformat(), format_duration(until - now)]
    return [*row, source, "yes" if warned else "no"]


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
        if (row := _expiring_row(obj, now)) is not None:
            report.expiring.append(row)
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
            report.pressure.extend(_pressure_rows(node, state))
            rows, more = _quarantine_rows(node, state)
            report.quarantined.extend(rows)
            if more:
                report.notes.append(
                    f"Node {node} has {more} more quarantined entries than listed (see its agent's log)."
                )
    return report


def _annotation(state: leases.LeaseState, key: str) -> Any:
    """One of the agent's JSON annotations on its heartbeat Lease; None when absent or not JSON."""
    text = (state.raw.get("metadata", {}).get("annotations") or {}).get(key)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _quarantine_rows(node: str, state: leases.LeaseState) -> tuple[list[list[str]], int]:
    """The agent's `sandkeep.io/quarantine` report, condition-like: entry, cause (the reason code), since
    when, when it is deleted ("never" with a grace of 0); and how many more it did not list."""
    found = _annotation(state, c.ANN_QUARANTINE)
    if not isinstance(found, dict):
        return [], 0
    items = [i for i in found.get("entries") or [] if isinstance(i, dict)]
    rows = [
        [
            node,
            str(i.get("entry", "?")),
            str(i.get("reason", "?")),
            str(i.get("since", "?")),
            str(i.get("deleteAt") or "never"),
        ]
        for i in items
    ]
    total = found.get("total")
    return rows, max(total - len(rows), 0) if isinstance(total, int) else 0


def _orphans(state: leases.LeaseState) -> list[dict[str, Any]]:
    items = _annotation(state, ORPHANS_ANNOTATION)
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _pressure_rows(node: str, state: leases.LeaseState) -> list[list[str]]:
    """The agent's `sandkeep.io/pressure` report: over its high watermark with only pinned/held ones left."""
    found = _annotation(state, c.ANN_PRESSURE)
    if not isinstance(found, dict) or not found:
        return []
    usage = f"{found.get('usedPercent', '?')}% (high {found.get('high', '?')}%)"
    rows = []
    for item in found.get("blocked") or [{}]:  # over high with nothing kept to name: still a row
        item = item if isinstance(item, dict) else {}
        why = str(item.get("why", "-"))
        if item.get("holders"):
            why += ": " + "; ".join(str(h) for h in item["holders"])[:200]
        size = human_size(item["bytes"]) if isinstance(item.get("bytes"), int) else "-"
        rows.append([node, usage, str(item.get("sandbox", "-")), size, why])
    return rows


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
        _table(
            "Disk pressure not relieved (the largest pinned and held sandboxes)",
            ["NODE", "USED", "SANDBOX", "SIZE", "KEPT BECAUSE"],
            report.pressure,
            "none",
        ),
        _table(
            "Quarantined entries (no object can own them; deleted after the agent's grace)",
            ["NODE", "ENTRY", "CAUSE", "SINCE", "DELETED AT"],
            report.quarantined,
            "none",
        ),
        _table("Agents not reporting", ["NODE", "LAST HEARTBEAT", "NOTE"], report.stale, "none"),
        _table("Pins lapsing within a day", ["SANDBOX", "NODE", "PINNED UNTIL", "LEFT"], report.lapsing, "none"),
        _table(
            "Expiring within a day",
            ["SANDBOX", "NODE", "DEADLINE", "LEFT", "SOURCE", "WARNED"],
            report.expiring,
            "none",
        ),
    ]
    verdict = "needs a person" if report.needs_a_person else "nothing needs a person"
    notes = "".join(f"{note}\n" for note in report.notes)
    return "\n".join(parts) + f"\n{notes}sandkeep doctor: {verdict}\n"


# --- which namespace the install lives in ------------------------------------------------------------------
@dataclass(frozen=True)
class Install:
    """Where the heartbeats are read from, or why no one namespace could be named."""

    namespace: str | None
    leftovers: tuple[str, ...] = ()  # namespaces holding only expired sandkeep Leases
    ambiguous: tuple[str, ...] = ()  # several namespaces with live ones: a person must name one


def choose_install(found: dict[str, list[leases.LeaseState]], now: datetime) -> Install:
    """The install's namespace from the sandkeep Leases found in each namespace.

    A live Lease (renewed within its own duration) is only kept by a running agent or controller, so the
    one namespace that holds one is the install; Leases everywhere else are left over from an earlier
    install (say, in `sandkeep-system` before a move to `sandkeep`). With no live Lease anywhere, the
    most recently renewed wins: a stopped install is still the install, and doctor says it is silent.
    """
    live = sorted(ns for ns, states in found.items() if any(not s.expired(now) for s in states))
    if len(live) > 1:
        return Install(None, ambiguous=tuple(live))
    if live:
        return Install(live[0], leftovers=tuple(sorted(set(found) - {live[0]})))
    if not found:
        return Install(None)
    never = datetime.min.replace(tzinfo=UTC)
    latest = max(found, key=lambda ns: (max((s.renew_time or never for s in found[ns]), default=never), ns))
    return Install(latest, leftovers=tuple(sorted(set(found) - {latest})))


def sandkeep_leases(client: Kube) -> dict[str, list[leases.LeaseState]]:
    """namespace -> its sandkeep Leases (agents' heartbeats and the controller's), looked up cluster-wide.

    Two server-filtered lists find the namespaces (heartbeats by label, the controller's by name); the
    Leases themselves are then read with the same calls the rest of doctor uses.
    """
    every = "/apis/coordination.k8s.io/v1/leases"
    heartbeat_selector = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY},{c.LABEL_NODE}"
    namespaces = {
        item["metadata"]["namespace"]
        for query in ({"labelSelector": heartbeat_selector}, {"fieldSelector": f"metadata.name={c.CONTROLLER_LEASE}"})
        for item in client.request("GET", every, query=query).get("items", [])
    }
    found: dict[str, list[leases.LeaseState]] = {}
    for ns in sorted(namespaces):
        states = list(leases.agent_heartbeats(client, ns).values())
        controller = leases.read_lease(client, ns, c.CONTROLLER_LEASE)
        found[ns] = states if controller is None else [*states, controller]
    return found


def _install_notes(install: Install, explicit: bool) -> list[str]:
    if explicit:
        return [f"Heartbeat Leases read from namespace {install.namespace} (--install-namespace)."]
    if install.namespace is None:
        return ["No sandkeep Lease in any namespace: is sandkeep installed? (--install-namespace names its namespace)"]
    notes = [f"Heartbeat Leases read from namespace {install.namespace} (found: it holds sandkeep's live Leases)."]
    if install.leftovers:
        notes.append(
            f"Expired sandkeep Leases also in namespace {', '.join(install.leftovers)}: left over from an earlier "
            "install? Delete them with `kubectl delete lease -n <namespace> -l app.kubernetes.io/managed-by=sandkeep`."
        )
    return notes


class DoctorError(Exception):
    """Doctor cannot say which namespace to read, or cannot read the cluster: the words a person reads."""


def examine(
    client: Kube, stale_after: timedelta, *, install_namespace: str | None = None, sandbox_namespace: str | None = None
) -> Report:
    """The whole report, read from the cluster: `sandkeep doctor` and `kubectl sandkeep doctor` both call this.

    The install's namespace is found from sandkeep's Leases unless `install_namespace` names it.
    """
    try:
        sandboxes = client.list_sandboxes(namespace=sandbox_namespace)
        install = Install(install_namespace) if install_namespace else choose_install(sandkeep_leases(client), _now())
        if install.ambiguous:
            raise DoctorError(
                f"namespaces {', '.join(install.ambiguous)} all hold live sandkeep Leases; "
                "name the one to read with --install-namespace"
            )
        heartbeats = leases.agent_heartbeats(client, install.namespace) if install.namespace else {}
    except DoctorError:
        raise
    except Exception as err:  # no route, no access: all the same to a person here
        raise cannot_read(err) from err
    report = build_report(sandboxes, heartbeats, stale_after)
    report.notes = _install_notes(install, explicit=bool(install_namespace))
    return report


def cannot_read(err: Exception) -> DoctorError:
    """A bad kubeconfig, no route, no access: all the same to a person reading doctor's answer."""
    return DoctorError(
        f"cannot read the cluster: {err}; check --kubeconfig and your access "
        "(finding the install lists Leases cluster-wide; --install-namespace reads one namespace only)"
    )


def _now() -> datetime:
    return datetime.now(UTC)


_SECTIONS = {
    "stuck": ["sandbox", "node", "age", "errno", "path"],
    "held": ["sandbox", "node", "state", "why"],
    "orphans": ["node", "tombstone", "errno", "path"],
    "pressure": ["node", "used", "sandbox", "size", "keptBecause"],
    "quarantined": ["node", "entry", "cause", "since", "deletedAt"],
    "stale": ["node", "lastHeartbeat", "note"],
    "lapsing": ["sandbox", "node", "pinnedUntil", "left"],
    "expiring": ["sandbox", "node", "deadline", "left", "source", "warned"],
}


def as_json(report: Report) -> str:
    """The report for scripts: each table as a list of objects keyed like its columns, and the verdict."""
    doc: dict[str, Any] = {
        name: [dict(zip(keys, row, strict=True)) for row in getattr(report, name)] for name, keys in _SECTIONS.items()
    }
    doc["notes"] = report.notes
    doc["needsAPerson"] = report.needs_a_person
    return json.dumps(doc, indent=2) + "\n"


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    flags.add_renamed(
        parser,
        "--install-namespace",
        "--namespace",
        help="namespace sandkeep is installed in (default: found from its Leases, cluster-wide)",
    )
    parser.add_argument("--stale-after", default="2m", help="a heartbeat older than this is stale (default 2m)")
    parser.add_argument("--sandbox-namespace", default=None, help="only sandboxes of this namespace (default: all)")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="text (default) or json")


def run(command: str, args: argparse.Namespace) -> int:
    stale_after = parse_duration(args.stale_after)
    if isinstance(stale_after, Invalid):
        print(f"sandkeep doctor: --stale-after {stale_after}", file=sys.stderr)
        return 2
    try:
        try:
            client = Kube(kube.load_config(args.kubeconfig), component="sandkeep-doctor")
        except Exception as err:  # a kubeconfig that does not load
            raise cannot_read(err) from err
        report = examine(
            client, stale_after, install_namespace=args.install_namespace, sandbox_namespace=args.sandbox_namespace
        )
    except DoctorError as err:
        print(f"sandkeep doctor: {err}", file=sys.stderr)
        return 2
    print(as_json(report) if args.output == "json" else render(report), end="")
    return 1 if report.needs_a_person else 0
