"""The controller's decision for one sandbox, pure: its status, its conditions, whether to delete, when to
look again.

No I/O, no clock, no client: `decide(obj, ctx, now)` runs the one rule (`rules/policy.py`) on what the
object says and what surrounds it (`Context`: the namespace's policy, the node's fate), and
`transition_events` says which Events a status change deserves. The reconciler (`reconciler.py`) does
what it says. Tested without a server in tests/test_controller.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from controller.rules import contracts as c
from controller.rules.contracts import Phase, Reason
from controller.rules.durations import Invalid, format_duration, format_instant, parse_duration
from controller.rules.objects import (
    Obj,
    annotations_of,
    condition,
    observed_of,
    pin_seen_status,
    same_condition,
    sandbox_facts,
)
from controller.rules.policy import EXPIRY_CAUSES, Policy, Verdict, deadline, phase_of

# status fields and condition types this controller owns (the agent owns the rest; see controller.api.kube)
OWNED_FIELDS = (
    "phase",
    "deadline",
    "deadlineSource",
    "pinnedUntil",
    "pinSeen",  # read back by the rule (the maxPin cap counts from it) and by the agent and the quota
    "observedGeneration",
    "dryRun",
    "releasePriority",
)
OWNED_CONDITIONS = (
    c.Condition.EXPIRED,
    c.Condition.PINNED,
    c.Condition.PIN_VALID,
    c.Condition.POLICY_CEILING,
    c.Condition.DRY_RUN,
    c.Condition.LOST,
    c.Condition.EXPIRING_SOON,
)


@dataclass(frozen=True)
class Decision:
    """What the controller wants for one sandbox now: its status, whether to delete, when to look again."""

    verdict: Verdict
    phase: Phase
    status: Obj  # exactly the controller-owned status fields (server-side applied as a whole)
    delete: bool  # expired, unpinned, not in use, not dry-run, not already deleting
    wake_at: datetime | None  # the next instant the decision can change with nothing else changing
    node_lost: bool = False


@dataclass(frozen=True)
class Context:
    """Everything outside the object the decision reads: the namespace's policy, the node's fate and its place in
    its history group."""

    policy: Policy
    policy_reasons: tuple[Reason, ...] = ()
    policy_problems: tuple[str, ...] = ()
    node_gone_since: datetime | None = None
    node_grace: timedelta = timedelta(minutes=10)
    newer: int | None = None  # sandboxes of its history group and outcome newer than it (cluster/history.py)


def expiry_cause(verdict: Verdict) -> Reason:
    return next((r for r in verdict.reasons if r in EXPIRY_CAUSES), Reason.EXPIRED)


def instant_words(value: datetime | None) -> str:
    return format_instant(value) if value is not None else "never"


def decide(obj: Obj, ctx: Context, now: datetime) -> Decision:
    """Run the one rule on `obj` and turn the verdict into status, conditions and an action. Pure.

    Messages hold absolute times only, never "in 3h", so the same object under the same policy always
    gives the same status and an unchanged sandbox costs no write.
    """
    verdict = deadline(replace(sandbox_facts(obj), newer=ctx.newer), ctx.policy, now)
    observed = observed_of(obj)
    lost_at = ctx.node_gone_since + ctx.node_grace if ctx.node_gone_since is not None else None
    node_lost = lost_at is not None and lost_at <= now
    phase = phase_of(
        verdict,
        in_use=observed.in_use,
        in_session=observed.in_session,
        disk_present=observed.disk_present,
        node_gone=node_lost,
    )
    previous = (obj.get("status") or {}).get("conditions") or []
    generation = obj.get("metadata", {}).get("generation")

    def cond(type_: str, status: bool, reason: Reason, message: str) -> Obj:
        return condition(type_, status, reason, message, observed_generation=generation, previous=previous, now=now)

    source = verdict.source.value
    # Past its hard end a session no longer holds it (the sessions end it): only a live user the agent sees.
    held = observed.in_use or (observed.in_session and not verdict.past_max_age)
    conditions = [_expired_condition(verdict, held, source, cond), _pinned_condition(verdict, cond)]
    invalid = _pin_problems(obj, verdict)
    ann = annotations_of(obj)
    if invalid:
        conditions.append(cond(c.Condition.PIN_VALID, False, Reason.INVALID_PIN, "; ".join(invalid)))
    elif c.ANN_PIN_UNTIL in ann:
        conditions.append(
            cond(c.Condition.PIN_VALID, True, Reason.PINNED, f"{c.ANN_PIN_UNTIL} is a valid RFC 3339 time")
        )
    if ctx.policy_reasons or ctx.policy_problems:
        reason = Reason.POLICY_CEILING if ctx.policy_reasons else Reason.INVALID_POLICY
        words = list(ctx.policy_problems)
        if ctx.policy_reasons:
            words.insert(0, "the namespace's SandboxPolicy exceeds the cluster ceiling and is held to it")
        conditions.append(cond(c.Condition.POLICY_CEILING, True, reason, "; ".join(words)))
    eligible = verdict.expired and not held
    if eligible and ctx.policy.dry_run:
        would = f"would delete: expired at {instant_words(verdict.deadline)} ({expiry_cause(verdict)}); dry-run is on"
        conditions.append(cond(c.Condition.DRY_RUN, True, Reason.WOULD_DELETE, f"{would}, nothing is deleted"))
    warn_at = _warn_at(verdict, ctx.policy)
    if warn_at is not None and warn_at <= now:
        ahead = format_duration(verdict.deadline - warn_at) if verdict.deadline is not None else ""
        soon = f"expires at {instant_words(verdict.deadline)} ({source}), within warnBefore ({ahead})"
        conditions.append(cond(c.Condition.EXPIRING_SOON, True, Reason.EXPIRING_SOON, f"{soon}; pin it to keep it"))
    if node_lost:
        node = obj["spec"].get("nodeName")
        lost = f"node {node} is gone since {instant_words(ctx.node_gone_since)}; the directory went with its disk"
        conditions.append(cond(c.Condition.LOST, True, Reason.NODE_GONE, lost))
    status: Obj = {"phase": phase.value, "deadlineSource": source, "conditions": conditions}
    if verdict.deadline is not None:
        status["deadline"] = format_instant(verdict.deadline)
    if verdict.pinned_until is not None:
        status["pinnedUntil"] = format_instant(verdict.pinned_until)
    if verdict.pin_seen is not None:
        status["pinSeen"] = pin_seen_status(verdict.pin_seen, verdict.pin_in_force)
    if generation is not None:
        status["observedGeneration"] = generation
    # What the node's agent needs of the policy when it releases for disk pressure (it reads no policy).
    if ctx.policy.dry_run:
        status["dryRun"] = True
    if ctx.policy.release_priority is not c.ReleasePriority.NORMAL:
        status["releasePriority"] = ctx.policy.release_priority.value
    warn_wake = warn_at if warn_at is not None and warn_at > now else None
    wakes = [t for t in (None if verdict.expired else verdict.deadline, None if node_lost else lost_at, warn_wake) if t]
    return Decision(
        verdict=verdict,
        phase=phase,
        status=status,
        delete=eligible and not ctx.policy.dry_run,
        wake_at=min(wakes) if wakes else None,
        node_lost=node_lost,
    )


def _warn_at(verdict: Verdict, policy: Policy) -> datetime | None:
    """When the policy's warnBefore says to warn of this sandbox's deadline; None: never (no warning, no deadline,
    or already expired)."""
    if policy.warn_before is None or verdict.deadline is None or verdict.expired:
        return None
    return verdict.deadline - policy.warn_before


def _expired_condition(verdict: Verdict, in_use: bool, source: str, cond: Callable[..., Obj]) -> Obj:
    if not verdict.expired:
        reason = Reason.PINNED if verdict.pinned else Reason.RETAINED
        return cond(c.Condition.EXPIRED, False, reason, f"kept until {instant_words(verdict.deadline)} ({source})")
    held = "; held: something still uses it" if in_use else ""
    detail = " ".join(verdict.messages) or f"deadline {instant_words(verdict.deadline)} ({source}) has passed"
    return cond(c.Condition.EXPIRED, True, expiry_cause(verdict), detail + held)


def _pinned_condition(verdict: Verdict, cond: Callable[..., Obj]) -> Obj:
    if verdict.pinned and not verdict.expired:
        capped = Reason.PIN_CAPPED in verdict.reasons
        words = f"pinned until {instant_words(verdict.pinned_until)}"
        if capped:
            words += " (capped: " + "; ".join(m for m in verdict.messages if "capped" in m) + ")"
        return cond(c.Condition.PINNED, True, Reason.PIN_CAPPED if capped else Reason.PINNED, words)
    if verdict.pinned:
        lapsed = f"the pin lapsed at {instant_words(verdict.pinned_until)}"
        return cond(c.Condition.PINNED, False, Reason.PIN_EXPIRED, lapsed)
    if Reason.PIN_NO_EFFECT in verdict.reasons:
        why = next(m for m in verdict.messages if "no effect" in m)
        words = f"{c.ANN_PIN_UNTIL}: {why}; a pin only keeps a sandbox longer, so write a later time to pin it"
        return cond(c.Condition.PINNED, False, Reason.PIN_NO_EFFECT, words)
    return cond(c.Condition.PINNED, False, Reason.UNPINNED, "no pin")


def _pin_problems(obj: Obj, verdict: Verdict) -> list[str]:
    """Words for each pin annotation the controller ignored, naming it and what to write instead."""
    ann = annotations_of(obj)
    problems = []
    if Reason.INVALID_PIN in verdict.reasons:
        problems.append(
            f"{c.ANN_PIN_UNTIL} ignored (not pinned): "
            + "; ".join(m.removeprefix("pin ignored: ") for m in verdict.messages if m.startswith("pin ignored"))
        )
    if c.ANN_PIN_FOR in ann:
        parsed = parse_duration(ann[c.ANN_PIN_FOR])
        if isinstance(parsed, Invalid):
            problems.append(f"{c.ANN_PIN_FOR} ignored (not pinned): {parsed}")
    return problems


def status_changed(obj: Obj, desired: Obj) -> bool:
    """True when any controller-owned status field or condition differs from what the object shows."""
    current = obj.get("status") or {}
    if any(current.get(f) != desired.get(f) for f in OWNED_FIELDS):
        return True
    have = {cd.get("type"): cd for cd in current.get("conditions") or []}
    want = {cd["type"]: cd for cd in desired.get("conditions", [])}
    return any(not same_condition(have.get(t), want.get(t)) for t in OWNED_CONDITIONS)


def transition_events(obj: Obj, desired: Obj) -> list[tuple[Reason, str, str]]:
    """The Events one status change deserves, as (reason, message, type): one per decision, never repeated.

    Derived from the difference between the status shown and the status wanted, so a standby that takes
    over an up-to-date object posts nothing, and a re-applied status posts nothing either.
    """
    name = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
    old = obj.get("status") or {}
    have = {cd.get("type"): cd for cd in old.get("conditions") or []}
    want = {cd["type"]: cd for cd in desired.get("conditions", [])}
    events: list[tuple[Reason, str, str]] = []
    phase, old_phase = desired.get("phase"), old.get("phase")
    pinned, old_pinned = desired.get("pinnedUntil"), old.get("pinnedUntil")
    if pinned != old_pinned and pinned is not None:
        events.append((Reason.PINNED, f"{name} pinned until {pinned}", "Normal"))
    elif pinned is None and old_pinned is not None:
        events.append((Reason.UNPINNED, f"{name} unpinned; deadline now {desired.get('deadline')}", "Normal"))
    for type_, reason, kind in (
        (c.Condition.PINNED, Reason.PIN_CAPPED, "Warning"),
        (c.Condition.PINNED, Reason.PIN_NO_EFFECT, "Warning"),
        (c.Condition.PIN_VALID, Reason.INVALID_PIN, "Warning"),
        (c.Condition.POLICY_CEILING, Reason.POLICY_CEILING, "Warning"),
        (c.Condition.POLICY_CEILING, Reason.INVALID_POLICY, "Warning"),
        (c.Condition.DRY_RUN, Reason.WOULD_DELETE, "Normal"),
        (c.Condition.LOST, Reason.NODE_GONE, "Warning"),
        (c.Condition.EXPIRING_SOON, Reason.EXPIRING_SOON, "Normal"),
    ):
        cd = want.get(type_)
        if cd is not None and cd["reason"] == reason and not same_condition(have.get(type_), cd):
            events.append((Reason.LOST if reason is Reason.NODE_GONE else reason, f"{name}: {cd['message']}", kind))
    if phase != old_phase:
        if phase == Phase.RETAINED and old_phase is None:
            source = desired.get("deadlineSource")
            events.append((Reason.RETAINED, f"{name} retained until {desired.get('deadline')} ({source})", "Normal"))
        elif phase == Phase.EXPIRED:
            events.append((Reason.EXPIRED, f"{name} expired: {want['Expired']['message']}", "Normal"))
        elif phase == Phase.HELD:
            events.append((Reason.HELD, f"{name} expired but in use: held, not deleted", "Warning"))
    return events
