"""The one expiry rule, and the policy it reads. Pure: no I/O, no clock, no Kubernetes client.

The controller, the agent, the standalone sweep, the CLI and `doctor` all call `deadline()`; none of
them re-implements any part of it. `now` is always a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from controller.contracts import DeadlineSource, Phase, Reason
from controller.durations import Invalid, format_duration, parse_instant


@dataclass(frozen=True)
class Policy:
    """How long sandboxes are kept. `retention == 0` is retention off: every unpinned sandbox expires."""

    retention: timedelta
    max_pin: timedelta
    dry_run: bool = False


@dataclass(frozen=True)
class Facts:
    """What the rule reads about one sandbox. Pins arrive as raw text: their parsing is part of the rule."""

    created_at: datetime | None
    retain_until: datetime | None = None
    pin_until: str | None = None  # `sandkeep.io/pin-until` or a manifest's `keepUntil`
    pinned_at: str | None = None  # `sandkeep.io/pinned-at` or a manifest's `pinnedAt`


@dataclass(frozen=True)
class Verdict:
    deadline: datetime | None  # None only when there is no usable createdAt (and no pin)
    source: DeadlineSource
    expired: bool
    reasons: tuple[Reason, ...] = ()  # why: the expiry cause, and InvalidPin / PinCapped when they apply
    pinned_until: datetime | None = None  # the effective (capped) pin, when a valid one is set
    messages: tuple[str, ...] = field(default=(), compare=False)  # words for conditions and Events

    def time_left(self, now: datetime) -> timedelta | None:
        """How long until the deadline (negative once past); None when there is no deadline."""
        return None if self.deadline is None else self.deadline - now

    @property
    def pinned(self) -> bool:
        return self.source is DeadlineSource.PIN


def deadline(sandbox: Facts, policy: Policy, now: datetime) -> Verdict:
    """The one expiry rule.

    A valid pin wins whatever else is set, capped at `maxPin` from when it was set (never from a future
    instant, so a forged `pinned-at` cannot stretch it). Otherwise the deadline is the EARLIER of the
    recorded `retainUntil` and `createdAt + retention`, so a shortened window applies to existing
    sandboxes. No usable `createdAt` is expired. An unparseable pin is no pin: the bounded direction.
    """
    reasons: list[Reason] = []
    messages: list[str] = []
    if sandbox.pin_until is not None:
        pin = parse_instant(sandbox.pin_until)
        if isinstance(pin, Invalid):
            reasons.append(Reason.INVALID_PIN)
            messages.append(f"pin ignored: {pin}")
        else:
            pinned_at = parse_instant(sandbox.pinned_at) if sandbox.pinned_at is not None else now
            reference = now if isinstance(pinned_at, Invalid) else min(pinned_at, now)
            cap = reference + policy.max_pin
            if pin > cap:
                reasons.append(Reason.PIN_CAPPED)
                messages.append(f"pin capped at maxPin ({format_duration(policy.max_pin)}) from when it was set")
                pin = cap
            expired = pin <= now
            if expired:
                reasons.append(Reason.PIN_EXPIRED)
            return Verdict(pin, DeadlineSource.PIN, expired, tuple(reasons), pin, tuple(messages))
    if sandbox.created_at is None:
        reasons.append(Reason.NO_CREATED_AT)
        messages.append("no usable createdAt: nothing says how old it is")
        return Verdict(None, DeadlineSource.NONE, True, tuple(reasons), None, tuple(messages))
    window_until = sandbox.created_at + policy.retention
    if sandbox.retain_until is not None and sandbox.retain_until < window_until:
        until, source, cause = sandbox.retain_until, DeadlineSource.RETAIN, Reason.RETAIN_UNTIL
    else:
        until, source, cause = window_until, DeadlineSource.WINDOW, Reason.WINDOW
    expired = until <= now
    if expired:
        reasons.append(cause)
    return Verdict(until, source, expired, tuple(reasons), None, tuple(messages))


@dataclass(frozen=True)
class Ceiling:
    """The cluster-wide limits a namespace's SandboxPolicy cannot exceed."""

    retention: timedelta
    max_pin: timedelta


def effective_policy(
    default: Policy, ceiling: Ceiling, namespace: Policy | None = None
) -> tuple[Policy, tuple[Reason, ...]]:
    """The policy for one namespace: its SandboxPolicy (or the cluster default), held under the ceiling.

    Dry-run is sticky: a cluster-wide dry-run cannot be turned off by a namespace.
    """
    chosen = namespace or default
    reasons: tuple[Reason, ...] = ()
    retention, max_pin = chosen.retention, chosen.max_pin
    if retention > ceiling.retention or max_pin > ceiling.max_pin:
        reasons = (Reason.POLICY_CEILING,)
        retention, max_pin = min(retention, ceiling.retention), min(max_pin, ceiling.max_pin)
    return Policy(retention, max_pin, default.dry_run or chosen.dry_run), reasons


# --- The phase of a sandbox (issue 4: the controller and the agent both call this) -----------------------
def phase_of(
    verdict: Verdict,
    *,
    in_use: bool = False,
    disk_present: bool | None = None,
    deleting: bool = False,
    node_gone: bool = False,
) -> Phase:
    """`status.phase` from the verdict and what the agent observed. Pure, like `deadline()`.

    A deleting object is `Deleting` (only the agent can refine it to Held or Stuck, since only it sees
    the disk's progress). A sandbox whose node is gone, or whose directory the agent reports absent, is
    `Lost` whatever its deadline. An expired sandbox something still uses is `Held`, never deleted.
    """
    if deleting:
        return Phase.DELETING
    if node_gone or disk_present is False:
        return Phase.LOST
    if verdict.expired:
        return Phase.HELD if in_use else Phase.EXPIRED
    return Phase.PINNED if verdict.pinned else Phase.RETAINED
