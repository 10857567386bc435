"""The one expiry rule, and the policy it reads. Pure: no I/O, no clock, no Kubernetes client.

The controller (for every object) and the standalone `sweep`, `ls` and `pin` (for manifests) call
`deadline()`; none of them re-implements any part of it. The agent and `doctor` never decide expiry:
the agent acts only on an object already being deleted, and `doctor` reads the phase and deadline the
controller wrote. `now` is always a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TypeVar

from controller.rules.contracts import DeadlineSource, Outcome, Phase, Reason, ReleasePriority
from controller.rules.durations import Invalid, format_duration, format_instant, parse_instant, shift


@dataclass(frozen=True)
class Quota:
    """What one namespace may keep retained, summed over every node; None is no limit."""

    max_bytes: int | None = None
    max_count: int | None = None

    @property
    def limited(self) -> bool:
        return self.max_bytes is not None or self.max_count is not None

    def within(self, ceiling: Quota) -> Quota:
        """This quota held under `ceiling` (no limit is above any ceiling)."""
        return Quota(_lower(self.max_bytes, ceiling.max_bytes), _lower(self.max_count, ceiling.max_count))


_T = TypeVar("_T", int, timedelta)


def _lower(a: _T | None, b: _T | None) -> _T | None:
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class Windows:
    """Retention by how the job ended (`spec.origin.outcome`, issue 28); each None takes the policy's `retention`."""

    failed: timedelta | None = None
    succeeded: timedelta | None = None
    unknown: timedelta | None = None

    def of(self, outcome: Outcome | None) -> timedelta | None:
        """The window this sets for `outcome`; None when it sets none (or the sandbox has no outcome)."""
        if outcome is None:
            return None
        return {Outcome.FAILED: self.failed, Outcome.SUCCEEDED: self.succeeded, Outcome.UNKNOWN: self.unknown}[outcome]

    def over(self, fallback: Windows) -> Windows:
        """These windows, each one not set taken from `fallback` (a namespace's policy over the cluster default)."""
        pairs = zip(self._all(), fallback._all(), strict=True)
        return Windows(*(theirs if mine is None else mine for mine, theirs in pairs))

    def within(self, ceiling: timedelta) -> Windows:
        """These windows held under `ceiling` (the cluster's maxRetention)."""
        return Windows(*(None if w is None else min(w, ceiling) for w in self._all()))

    def _all(self) -> tuple[timedelta | None, ...]:
        return (self.failed, self.succeeded, self.unknown)


@dataclass(frozen=True)
class History:
    """History limits per group (issue 28): keep at most so many sandboxes per outcome in each group (`group_by`:
    a pipeline label of ORIGIN_LABELS, or the owner), and the newest `keep_last_failed` failures past their window.

    Each limit None: no limit for that outcome. A pin in force and a holder still keep a sandbox beyond a limit.
    """

    group_by: str
    failed: int | None = None
    succeeded: int | None = None
    unknown: int | None = None
    keep_last_failed: int = 0

    def limit(self, outcome: Outcome | None) -> int | None:
        if outcome is None:
            return None
        return {Outcome.FAILED: self.failed, Outcome.SUCCEEDED: self.succeeded, Outcome.UNKNOWN: self.unknown}[outcome]


@dataclass(frozen=True)
class Policy:
    """How long sandboxes are kept. `retention == 0` is retention off: every unpinned sandbox expires.

    `by_outcome` sets a window per outcome of the job (a sandbox without one, or an outcome it does not set,
    takes `retention`). `max_age` is the hard end (None: none): past `createdAt + max_age` nothing but a live
    user of the directory keeps a sandbox, no pin and no session. `quota` bounds the namespace's sandboxes;
    `release_priority` orders them against other namespaces' when a node releases for disk pressure (First go
    before Normal, Last after). Neither exempts a sandbox from anything: only a pin or a holder does.
    """

    retention: timedelta
    max_pin: timedelta
    dry_run: bool = False
    quota: Quota = Quota()
    release_priority: ReleasePriority = ReleasePriority.NORMAL
    by_outcome: Windows = Windows()
    max_age: timedelta | None = None
    history: History | None = None
    warn_before: timedelta | None = None  # ExpiringSoon this long before a deadline; None: no warning
    warn_webhook: str | None = None  # an http(s) URL told of each ExpiringSoon (a notice, not an input of the rule)

    def window(self, outcome: Outcome | None) -> timedelta:
        """How long a sandbox whose job ended `outcome` is kept from its createdAt (before pins and retainUntil)."""
        own = self.by_outcome.of(outcome)
        return self.retention if own is None else own


@dataclass(frozen=True)
class PinSeen:
    """When sandkeep first saw a pin: the controller's record in `status.pinSeen`, which no tenant can write.

    `pin_until` is the pin this record is for (as parsed, in whole seconds as sandkeep writes times, so two
    spellings of one instant are one pin): a pin changed to another instant is a new pin, first seen then.
    """

    pin_until: datetime
    at: datetime

    def is_for(self, pin: datetime) -> bool:
        """Whether this record is for `pin` (compared in whole seconds, as the record is written)."""
        return self.pin_until == pin.replace(microsecond=0)


@dataclass(frozen=True)
class Facts:
    """What the rule reads about one sandbox. Pins arrive as raw text: their parsing is part of the rule."""

    created_at: datetime | None
    retain_until: datetime | None = None
    pin_until: str | None = None  # `sandkeep.io/pin-until` or a manifest's `keepUntil`
    pinned_at: str | None = None  # `sandkeep.io/pinned-at` or a manifest's `pinnedAt`: a hint, never trusted
    pin_seen: PinSeen | None = None  # sandkeep's own record of when it first saw the pin (objects only)
    outcome: Outcome | None = None  # how its job ended (`spec.origin.outcome`); None: not recorded
    # How many sandboxes of its history group with the same outcome are newer (the controller's view counts them);
    # None: in no group (the policy sets no history limits, or the sandbox has no group value or outcome).
    newer: int | None = None


@dataclass(frozen=True)
class Verdict:
    deadline: datetime | None  # None only when there is no usable createdAt (and no pin)
    source: DeadlineSource
    expired: bool
    reasons: tuple[Reason, ...] = ()  # why: the expiry cause, and InvalidPin / PinCapped when they apply
    pinned_until: datetime | None = None  # the effective (capped) pin, when a valid one is set
    pin_seen: PinSeen | None = None  # the record the cap counted from, to keep: set for every parseable pin
    # The valid pin as it stands after the cap, whether or not it extends the deadline: until then it keeps the
    # sandbox from being released for space (disk pressure, a quota). None without a parseable pin.
    pin_in_force: datetime | None = None
    messages: tuple[str, ...] = field(default=(), compare=False)  # words for conditions and Events
    hard_end: datetime | None = None  # createdAt + maxAge, when the policy sets a maxAge
    past_max_age: bool = False  # the hard end has come: only a live user of the directory still holds it

    def holds(self, now: datetime) -> bool:
        """Whether a pin keeps the sandbox from being released for space at `now` (`pin_in_force`)."""
        return self.pin_in_force is not None and self.pin_in_force > now

    def time_left(self, now: datetime) -> timedelta | None:
        """How long until the deadline (negative once past); None when there is no deadline."""
        return None if self.deadline is None else self.deadline - now

    @property
    def pinned(self) -> bool:
        """A pin keeps it: the pin decided the deadline, or did until the hard end cut it there."""
        return self.source is DeadlineSource.PIN or (self.source is DeadlineSource.MAX_AGE and bool(self.pinned_until))


EXPIRY_CAUSES = (
    Reason.MAX_AGE,
    Reason.HISTORY_LIMIT,
    Reason.PIN_EXPIRED,
    Reason.RETAIN_UNTIL,
    Reason.WINDOW,
    Reason.NO_CREATED_AT,
)


def deadline(sandbox: Facts, policy: Policy, now: datetime) -> Verdict:
    """The one expiry rule: how long the pins, the windows and retainUntil keep a sandbox (`_kept`), unless its
    group's history limit releases it sooner (`_beyond_history`), and never past its hard end (`_held_to_max_age`).
    docs/architecture.md's order of precedence is this, row by row (tests/unit/test_precedence.py)."""
    return _held_to_max_age(_beyond_history(_kept(sandbox, policy, now), sandbox, policy, now), sandbox, policy, now)


def _beyond_history(verdict: Verdict, sandbox: Facts, policy: Policy, now: datetime) -> Verdict:
    """`verdict`, expired now (cause HistoryLimit) when the sandbox is older than its group's newest N of its
    outcome, unless a pin is in force: a pin still wins, and a holder (judged in `decide`) still holds it."""
    limit = policy.history.limit(sandbox.outcome) if policy.history is not None else None
    if limit is None or sandbox.newer is None or sandbox.newer < limit or verdict.holds(now):
        return verdict
    notes = tuple(r for r in verdict.reasons if r not in EXPIRY_CAUSES)
    assert policy.history is not None
    words = (
        f"beyond the history limit: {sandbox.newer} newer {sandbox.outcome} sandboxes of its group "
        f"({policy.history.group_by}) and the limit is {limit}"
    )
    return replace(verdict, expired=True, reasons=(*notes, Reason.HISTORY_LIMIT), messages=(words, *verdict.messages))


def _held_to_max_age(verdict: Verdict, sandbox: Facts, policy: Policy, now: datetime) -> Verdict:
    """`verdict` held to the hard end, `createdAt + maxAge`: no pin and no window keeps a sandbox past it.

    A pin that would keep it longer keeps it until then (and no longer holds it against a release for space
    after that); once the hard end has come the cause is `MaxAge` whatever expired it first, and
    `past_max_age` tells the phase that a session no longer holds it: only a live user of the directory does.
    """
    if policy.max_age is None or sandbox.created_at is None:
        return verdict
    end = shift(sandbox.created_at, policy.max_age)
    in_force = None if verdict.pin_in_force is None else min(verdict.pin_in_force, end)
    verdict = replace(verdict, hard_end=end, pin_in_force=in_force)
    words = f"its hard end {format_instant(end)} (createdAt + maxAge {format_duration(policy.max_age)})"
    notes = tuple(r for r in verdict.reasons if r not in EXPIRY_CAUSES)
    if verdict.deadline is None or verdict.deadline > end:
        # Whether it is expired, and why, stands: only a history limit expires it before such a deadline.
        verdict = replace(
            verdict,
            deadline=end,
            source=DeadlineSource.MAX_AGE,
            pinned_until=end if verdict.pinned else None,
            messages=(*verdict.messages, f"kept no later than {words}"),
        )
    if end > now:
        return verdict
    past = f"past {words}: no pin or session keeps it, only a live user of its directory holds it"
    messages = (past, *verdict.messages)
    return replace(verdict, expired=True, reasons=(*notes, Reason.MAX_AGE), past_max_age=True, messages=messages)


def _kept(sandbox: Facts, policy: Policy, now: datetime) -> Verdict:
    """How long the pins, the windows and retainUntil keep a sandbox.

    Without a pin the deadline is the EARLIER of the recorded `retainUntil` and `createdAt + window` (the
    window for its outcome, else retention), so a shortened window applies to existing sandboxes; no usable
    `createdAt` is expired. A valid pin, capped at `maxPin` from when sandkeep first saw it (`pin_reference`:
    never a time a user wrote, so no annotation can make the cap slide with `now`), only ever extends: a pin
    not later than the unpinned deadline (or than `now` when there is none) has no effect and says so, since
    `pin-for=0` or a mistyped year must mean "nothing", never "delete now". An unparseable pin is no pin:
    the bounded direction.
    Total: every sum saturates.
    """
    unpinned = _unpinned(sandbox, policy, now)
    if sandbox.pin_until is None:
        return unpinned
    pin = parse_instant(sandbox.pin_until)
    if isinstance(pin, Invalid):
        return _with(unpinned, Reason.INVALID_PIN, f"pin ignored: {pin}")
    reasons: list[Reason] = []
    messages: list[str] = []
    seen = PinSeen(pin.replace(microsecond=0), pin_reference(sandbox, pin, now).replace(microsecond=0))
    cap = shift(seen.at, policy.max_pin)
    if pin > cap:
        reasons.append(Reason.PIN_CAPPED)
        first = format_instant(seen.at)
        messages.append(
            f"pin capped at maxPin ({format_duration(policy.max_pin)}) from when it was first seen ({first})"
        )
        pin = cap
    unpinned = replace(unpinned, pin_seen=seen, pin_in_force=pin)
    if unpinned.source is DeadlineSource.HISTORY:  # kept with no deadline: a pin cannot keep it longer
        return _with(unpinned, *reasons, *messages)
    floor = unpinned.deadline if unpinned.deadline is not None else now
    if pin <= floor:
        without = "now" if unpinned.deadline is None else format_instant(floor)
        words = f"pin until {format_instant(pin)} has no effect: not later than the deadline without it ({without})"
        return _with(_with(unpinned, *reasons, *messages), Reason.PIN_NO_EFFECT, words)
    expired = pin <= now
    if expired:
        reasons.append(Reason.PIN_EXPIRED)
    return Verdict(pin, DeadlineSource.PIN, expired, tuple(reasons), pin, seen, pin, tuple(messages))


def pin_reference(sandbox: Facts, pin: datetime, now: datetime) -> datetime:
    """When the pin `pin` was first seen: the time the maxPin cap counts from.

    sandkeep's own record when it is for this very pin; otherwise (a pin not yet recorded) the `pinned-at`
    stamp, but never later than `now`, and `now` for one that does not parse. The controller records the
    answer at once, so a forged, future or garbage `pinned-at` can only ever move the cap earlier, and
    removing or rewriting it later changes nothing: the record, not the annotation, is read from then on.
    """
    seen = sandbox.pin_seen
    if seen is not None and seen.is_for(pin):
        return min(seen.at, now)
    stamp = parse_instant(sandbox.pinned_at) if sandbox.pinned_at is not None else now
    return now if isinstance(stamp, Invalid) else min(stamp, now)


def _unpinned(sandbox: Facts, policy: Policy, now: datetime) -> Verdict:
    """The deadline without any pin: the earlier of `retainUntil` and the window for the sandbox's outcome;
    none without createdAt."""
    if sandbox.created_at is None:
        return Verdict(
            None,
            DeadlineSource.NONE,
            True,
            (Reason.NO_CREATED_AT,),
            messages=("no usable createdAt: nothing says how old it is",),
        )
    if _kept_last_failed(sandbox, policy):
        last = "one of the newest failures of its group, kept past its window (historyLimits.keepLastFailed)"
        return Verdict(None, DeadlineSource.HISTORY, False, (Reason.KEPT_LAST_FAILED,), messages=(last,))
    window_until = shift(sandbox.created_at, policy.window(sandbox.outcome))
    if sandbox.retain_until is not None and sandbox.retain_until < window_until:
        until, source, cause = sandbox.retain_until, DeadlineSource.RETAIN, Reason.RETAIN_UNTIL
    else:
        until, source, cause = window_until, DeadlineSource.WINDOW, Reason.WINDOW
    expired = until <= now
    return Verdict(until, source, expired, (cause,) if expired else ())


def _kept_last_failed(sandbox: Facts, policy: Policy) -> bool:
    """One of its group's newest `keep_last_failed` failures: no window or retainUntil ends it."""
    history = policy.history
    return (
        history is not None
        and sandbox.outcome is Outcome.FAILED
        and sandbox.newer is not None
        and sandbox.newer < history.keep_last_failed
    )


def _with(verdict: Verdict, *notes: Reason | str) -> Verdict:
    """`verdict` with reasons (before its own, so the expiry cause stays last) and messages added."""
    reasons = tuple(n for n in notes if isinstance(n, Reason))
    messages = tuple(n for n in notes if not isinstance(n, Reason))
    return replace(verdict, reasons=reasons + verdict.reasons, messages=messages + verdict.messages)


@dataclass(frozen=True)
class Ceiling:
    """The cluster-wide limits a namespace's SandboxPolicy cannot exceed."""

    retention: timedelta
    max_pin: timedelta
    quota: Quota = Quota()
    max_age: timedelta | None = None  # the hard end no policy passes; None: none (a policy may still set one)


def effective_policy(
    default: Policy, ceiling: Ceiling, namespace: Policy | None = None
) -> tuple[Policy, tuple[Reason, ...]]:
    """The policy for one namespace: its SandboxPolicy (or the cluster default), held under the ceiling.

    Dry-run is sticky: a cluster-wide dry-run cannot be turned off by a namespace. The ceiling's maxAge holds
    every namespace, one whose policy sets none too (only a policy asking for more is told PolicyCeiling).
    """
    chosen = namespace or default
    reasons: tuple[Reason, ...] = ()
    retention, max_pin = chosen.retention, chosen.max_pin
    quota = chosen.quota.within(ceiling.quota)
    by_outcome = chosen.by_outcome.within(ceiling.retention)
    if (
        retention > ceiling.retention
        or max_pin > ceiling.max_pin
        or quota != chosen.quota
        or by_outcome != chosen.by_outcome
        or (chosen.max_age is not None and ceiling.max_age is not None and chosen.max_age > ceiling.max_age)
    ):
        reasons = (Reason.POLICY_CEILING,)
        retention, max_pin = min(retention, ceiling.retention), min(max_pin, ceiling.max_pin)
    dry_run = default.dry_run or chosen.dry_run
    max_age = _lower(chosen.max_age, ceiling.max_age)
    held = replace(chosen, retention=retention, max_pin=max_pin, dry_run=dry_run, quota=quota, by_outcome=by_outcome)
    return replace(held, max_age=max_age), reasons


# --- The phase of a sandbox (the controller's; the agent writes a phase only while deleting: Deleting, Held, Stuck)
def phase_of(
    verdict: Verdict,
    *,
    in_use: bool = False,
    in_session: bool = False,
    disk_present: bool | None = None,
    deleting: bool = False,
    node_gone: bool = False,
) -> Phase:
    """`status.phase` from the verdict and what the agent observed. Pure, like `deadline()`.

    A deleting object is `Deleting` (only the agent can refine it to Held or Stuck, since only it sees
    the disk's progress). A sandbox whose node is gone, or whose directory the agent reports absent, is
    `Lost` whatever its deadline. An expired sandbox something still uses is `Held`, never deleted. One a
    SandboxSession has open (its Pod's mount verified by the agent) is `Open` until its deadline, pinned or
    not: the session holds it like any Pod, and past the deadline it is `Held` by it, as by any other; past
    its hard end (`past_max_age`) only something the agent sees using it holds it.
    """
    if deleting:
        return Phase.DELETING
    if node_gone or disk_present is False:
        return Phase.LOST
    if verdict.expired:
        return Phase.HELD if in_use or (in_session and not verdict.past_max_age) else Phase.EXPIRED
    if in_session:
        return Phase.OPEN
    return Phase.PINNED if verdict.pinned else Phase.RETAINED
