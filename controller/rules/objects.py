"""What sandkeep reads from and writes into Kubernetes objects, as plain dicts: no client, no I/O.

The accessors both components share (a sandbox's key, annotations, finalizers, the facts the one rule
reads, the pin the controller judged, what the agent observed), a SandboxPolicy's spec as a Policy, and
the standard conditions (built, found, compared). `controller.api.kube` sends and receives these dicts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from controller.rules import contracts as c
from controller.rules.durations import Invalid, format_instant, instant_or_none, parse_duration, parse_instant
from controller.rules.policy import Facts, History, PinSeen, Policy, Quota, Windows
from controller.rules.sizes import parse_size

Obj = dict[str, Any]


# --- reading sandboxes -----------------------------------------------------------------------------------
def sandbox_items(page: Obj) -> list[Obj]:
    """A list response's sandboxes, each with the apiVersion/kind a list drops (callers re-post them)."""
    items: list[Obj] = page.get("items") or []
    for item in items:
        item.setdefault("apiVersion", c.API_VERSION)
        item.setdefault("kind", c.SANDBOX_KIND)
    return items


def key_of(obj: Obj) -> tuple[str, str]:
    """(namespace, name): how both components index sandboxes."""
    meta = obj["metadata"]
    return meta["namespace"], meta["name"]


def annotations_of(obj: Obj) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("annotations") or {})


def finalizers(obj: Obj) -> list[str]:
    """The object's finalizers (a copy; none is an empty list)."""
    return list(obj.get("metadata", {}).get("finalizers") or [])


def is_deleting(obj: Obj) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def sandbox_facts(obj: Obj) -> Facts:
    """What the one rule reads from a RetainedSandbox: spec times and outcome, the pin annotations (raw text) and
    the controller's record of when it first saw the pin (`status.pinSeen`, which only the components write)."""
    spec = obj.get("spec") or {}
    ann = annotations_of(obj)
    return Facts(
        created_at=instant_or_none(spec.get("createdAt")),
        retain_until=instant_or_none(spec.get("retainUntil")),
        pin_until=ann.get(c.ANN_PIN_UNTIL),
        pinned_at=ann.get(c.ANN_PINNED_AT),
        pin_seen=pin_seen_of(obj),
        outcome=outcome_of(obj),
    )


def outcome_of(obj: Obj) -> c.Outcome | None:
    """How the sandbox's job ended (`spec.origin.outcome`); None when not recorded (or not one of the enum)."""
    origin = (obj.get("spec") or {}).get("origin")
    outcome = origin.get("outcome") if isinstance(origin, dict) else None
    return c.Outcome(outcome) if outcome in tuple(c.Outcome) else None


def pin_seen_of(obj: Obj) -> PinSeen | None:
    """`status.pinSeen` as the rule reads it; None when absent or not two valid times."""
    seen = (obj.get("status") or {}).get("pinSeen")
    if not isinstance(seen, dict):
        return None
    pin, at = instant_or_none(seen.get("pinUntil")), instant_or_none(seen.get("at"))
    return PinSeen(pin, at) if pin is not None and at is not None else None


def pin_seen_status(seen: PinSeen, in_force: datetime | None) -> Obj:
    """`status.pinSeen` as the controller writes it: its record, and the pin in force after the cap (what the
    agent reads to know whether the pin still keeps the sandbox from being released for space)."""
    status = {"pinUntil": format_instant(seen.pin_until), "at": format_instant(seen.at)}
    return status | ({"inForceUntil": format_instant(in_force)} if in_force is not None else {})


def pin_pending(obj: Obj) -> bool:
    """A valid `pin-for` the controller has not yet turned into a `pin-until`: a pin about to be in force."""
    text = annotations_of(obj).get(c.ANN_PIN_FOR)
    return text is not None and not isinstance(parse_duration(text), Invalid)


def pin_holds(obj: Obj, now: datetime) -> bool:
    """Whether a pin keeps `obj` from being released for space (disk pressure or a quota), as the controller
    judged it: never from the raw annotation alone, so a pin its maxPin cap has ended reorders nothing.

    The controller's verdict is `status.pinSeen.inForceUntil` (the pin after the cap, whether or not it
    extends the deadline), for the pin `status.pinSeen.pinUntil` names. A pin it has not judged yet (a
    pin-for not yet settled, or a valid future pin-until other than the one it recorded) holds until it
    has, erring on keeping for the moment that takes; an unparseable pin is no pin, as in the rule.
    """
    if pin_pending(obj):
        return True
    text = annotations_of(obj).get(c.ANN_PIN_UNTIL)
    pin = parse_instant(text) if text is not None else None
    if not isinstance(pin, datetime):
        return False
    seen = pin_seen_of(obj)
    if seen is None or not seen.is_for(pin):
        return pin > now  # not judged yet: no cap can make a past pin keep anything
    recorded = (obj.get("status") or {}).get("pinSeen") or {}
    until = instant_or_none(recorded.get("inForceUntil"))
    return until is not None and until > now


def condition_of(obj: Obj, type_: str) -> Obj | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            found: Obj = cond
            return found
    return None


@dataclass(frozen=True)
class Observed:
    """What the agent last reported about the disk (the controller reads it to derive the phase)."""

    in_use: bool = False
    in_session: bool = False  # a SandboxSession's Pod mounts it: its reopen volume is among `heldBy`
    disk_present: bool | None = None  # None: the agent has not said

    @property
    def held(self) -> bool:
        """Something keeps it from deletion: a process or Pod uses it, or a session has it open."""
        return self.in_use or self.in_session


def observed_of(obj: Obj) -> Observed:
    status = obj.get("status") or {}
    present = condition_of(obj, c.Condition.DISK_PRESENT)
    disk = None if present is None else present.get("status") != "False"
    namespace = (obj.get("metadata") or {}).get("namespace") or ""
    holders = status.get("heldBy") or []
    in_session = any(isinstance(h, str) and is_session_holder(h, namespace) for h in holders)
    return Observed(in_use=bool(status.get("inUse")), in_session=in_session, disk_present=disk)


def reopen_holder(namespace: str, pod: str) -> str:
    """How the agent names a Pod's reopen volume among the holders of the sandbox it mounts (`heldBy`)."""
    return c.REOPEN_HOLDER.format(namespace=namespace, pod=pod)


def is_session_holder(holder: str, namespace: str) -> bool:
    """Whether `holder` is the reopen volume of a SandboxSession's Pod in the sandbox's own namespace: what the
    agent sees now, each pass, so a session that ended stops opening the sandbox with its Pod's mount."""
    prefix, _, suffix = reopen_holder(namespace, c.SESSION_POD_PREFIX + "\0").partition("\0")
    return holder.startswith(prefix) and holder.endswith(suffix) and len(holder) > len(prefix) + len(suffix)


def namespace_policy(obj: Obj, default: Policy) -> tuple[Policy, list[str]]:
    """A SandboxPolicy's spec as a Policy; missing or unparseable fields fall back to the default.

    Returns the problems in words (the schema's pattern already refuses most bad input; this is the
    second line for values like `99999999999d` the pattern allows).
    """
    spec = obj.get("spec") or {}
    problems: list[str] = []

    def duration(field: str, fallback: Any) -> Any:
        if field not in spec:
            return fallback
        parsed = parse_duration(spec[field])
        if isinstance(parsed, Invalid):
            problems.append(f"spec.{field} {parsed}")
            return fallback
        return parsed

    retention = duration("retention", default.retention)
    max_pin = duration("maxPin", default.max_pin)
    by_outcome = _windows(spec, default.by_outcome, problems)
    max_age = duration(c.MAX_AGE, default.max_age)
    history = _history(spec, default.history, problems)
    warn_before = duration(c.WARN_BEFORE, default.warn_before)
    webhook = _webhook(spec, problems)
    limits: Obj = spec["quota"] if isinstance(spec.get("quota"), dict) else {}
    max_bytes, max_count = default.quota.max_bytes, default.quota.max_count
    if "maxBytes" in limits:
        size = parse_size(limits["maxBytes"])
        if isinstance(size, Invalid):
            problems.append(f"spec.quota.maxBytes {size}")
        else:
            max_bytes = size
    if "maxCount" in limits:
        count = limits["maxCount"]
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            max_count = count
        else:
            problems.append(f"spec.quota.maxCount {count!r}: not a whole number of sandboxes")
    priority = default.release_priority
    if "releasePriority" in spec:
        try:
            priority = c.ReleasePriority(spec["releasePriority"])
        except ValueError:
            problems.append(f"spec.releasePriority {spec['releasePriority']!r}: one of First, Normal, Last")
    quota = Quota(max_bytes, max_count)
    dry_run = bool(spec.get("dryRun", False))
    policy = Policy(retention, max_pin, dry_run, quota, priority, by_outcome, max_age, history, warn_before, webhook)
    return policy, problems


def _webhook(spec: Obj, problems: list[str]) -> str | None:
    """`spec.warnWebhook.url` when it is an http or https URL with a host; None (and a problem) otherwise."""
    given = spec.get(c.WARN_WEBHOOK)
    if given is None:
        return None
    url = given.get("url") if isinstance(given, dict) else None
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
    except ValueError:  # e.g. an unclosed [IPv6 literal
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        problems.append(f"spec.{c.WARN_WEBHOOK}.url: not an http or https URL with a host; no notices are sent")
        return None
    return url


def _history(spec: Obj, default: History | None, problems: list[str]) -> History | None:
    """`spec.historyLimits` as History; the default when absent or when its groupBy or a count does not read."""
    given = spec.get(c.HISTORY_LIMITS)
    if not isinstance(given, dict):
        return default
    where = f"spec.{c.HISTORY_LIMITS}"
    group_by = given.get("groupBy")
    if group_by not in c.GROUP_BYS:
        problems.append(f"{where}.groupBy {group_by!r}: one of {', '.join(c.GROUP_BYS)}")
        return default
    counts: dict[str, int] = {}
    fields = {"failed": "failed", "succeeded": "succeeded", "unknown": "unknown", "keepLastFailed": "keep_last_failed"}
    for field, name in fields.items():
        count = given.get(field)
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            problems.append(f"{where}.{field} {count!r}: not a whole number of sandboxes")
            return default
        counts[name] = count
    return History(group_by, **counts)


def history_setting(given: Obj) -> History:
    """A standalone sweep's history limits (`SANDKEEP_HISTORY_LIMITS`, `--history-limits`): the same object as a
    SandboxPolicy's `historyLimits`, read by the same parser; ValueError saying what is wrong."""
    problems: list[str] = []
    history = _history({c.HISTORY_LIMITS: given}, None, problems)
    if history is None:
        raise ValueError("; ".join(problems).replace(f"spec.{c.HISTORY_LIMITS}", "history limits"))
    return history


def group_of(obj: Obj, group_by: str) -> str | None:
    """The sandbox's value of `group_by` (an origin label, its owner as `Kind/name`, or the CronJob of its Job as
    `CronJob/name`); None when it has none."""
    spec = obj.get("spec") or {}
    origin = spec.get("origin")
    if not isinstance(origin, dict):
        return None
    owner = origin.get("owner")
    if group_by == c.GROUP_BY_OWNER:
        return f"{owner.get('kind')}/{owner.get('name')}" if isinstance(owner, dict) else None
    if group_by == c.GROUP_BY_CRONJOB:
        created = instant_or_none(spec.get("createdAt"))
        if not isinstance(owner, dict) or owner.get("kind") != "Job" or created is None:
            return None
        return cronjob_of(str(owner.get("name")), created)
    value = (origin.get("labels") or {}).get(group_by)
    return value if isinstance(value, str) else None


_CRONJOB_JOB = re.compile(r"(?P<cronjob>[a-z0-9][-a-z0-9.]*)-(?P<minute>[0-9]+)")


def cronjob_of(job: str, created: datetime) -> str | None:
    """`CronJob/<name>` when `job` is a name the CronJob controller gives (`<cronjob>-<scheduled minute since the
    epoch>`) and that minute is a plausible start of a run kept at `created` (at most CRONJOB_RUN_MAX_DAYS
    before, a minute of clock skew after); None otherwise.

    The Pod names only its Job, and the agent may not read Jobs (nor would a finished Job's owner still be there
    to read), so the name is the record: a hand-made Job called `build-42` or `release-20260101` has no plausible
    minute and stays in no group, rather than being released with another's runs.
    """
    found = _CRONJOB_JOB.fullmatch(job)
    if found is None:
        return None
    earliest = (created - timedelta(days=c.CRONJOB_RUN_MAX_DAYS)).timestamp() / 60
    if not earliest <= int(found["minute"]) <= created.timestamp() / 60 + 1:
        return None
    return f"CronJob/{found['cronjob']}"


def _windows(spec: Obj, default: Windows, problems: list[str]) -> Windows:
    """`spec.retentionByOutcome` as Windows; an outcome left out (or unparseable) takes the default's."""
    given: Obj = spec[c.RETENTION_BY_OUTCOME] if isinstance(spec.get(c.RETENTION_BY_OUTCOME), dict) else {}
    found: dict[str, timedelta] = {}
    for outcome in c.Outcome:
        field = outcome.lower()
        if field in given:
            parsed = parse_duration(given[field])
            if isinstance(parsed, Invalid):
                problems.append(f"spec.{c.RETENTION_BY_OUTCOME}.{field} {parsed}")
            else:
                found[field] = parsed
    return Windows(**found).over(default)


# --- conditions ------------------------------------------------------------------------------------------
def condition(
    type_: str,
    status: bool | str,
    reason: c.Reason,
    message: str,
    *,
    observed_generation: int | None = None,
    previous: Iterable[Obj] = (),
    now: datetime | None = None,
) -> Obj:
    """A standard condition; lastTransitionTime is kept from `previous` when the status did not change.

    Keeping the time is what makes a re-applied, unchanged condition a no-op for the API server.
    """
    text = ("True" if status else "False") if isinstance(status, bool) else status
    when = format_instant(now or datetime.now(UTC))
    for old in previous:
        if old.get("type") == type_ and old.get("status") == text and old.get("lastTransitionTime"):
            when = old["lastTransitionTime"]
            break
    result: Obj = {
        "type": type_,
        "status": text,
        "reason": str(reason),
        "message": message[:32768],
        "lastTransitionTime": when,
    }
    if observed_generation is not None:
        result["observedGeneration"] = observed_generation
    return result


def message_digest(message: str | int) -> int:
    """A condition message as a number: what a view keeps of it when it only ever compares messages."""
    return message if isinstance(message, int) else hash(message)


def same_condition(a: Obj | None, b: Obj | None) -> bool:
    """Equal in every field that matters (the transition time is derived, so it is not compared).

    A message may be its text or its digest (`message_digest`, as the controller's view keeps it).
    """
    if a is None or b is None:
        return a is b
    keys = ("type", "status", "reason", "observedGeneration")
    same_message = message_digest(a.get("message", "")) == message_digest(b.get("message", ""))
    return same_message and all(a.get(k) == b.get(k) for k in keys)
