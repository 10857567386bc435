"""One sandbox's reconcile: its status and fate brought in line with the rule, and when to look again.

`Reconciler.reconcile(key)` may run any number of times. It reads the view, never the API server, runs
`decide()` (pure, `decide.py`) and writes only a change: pin annotations settled once, the status
(server-side apply), or the guarded DELETE. It returns a `Result` naming the instant the decision can
next change, as controller-runtime's Reconcile returns `Result{RequeueAfter}`; the controller's workers
queue the key for then (`controller.py`), as the TTL-after-finished controller's `AddAfter` does.

Deleting is the only dangerous step, so it is guarded twice: the one rule is run again on the view's
newest version of the object, then the DELETE carries preconditions on that version's uid AND
resourceVersion, so a pin (or any change) that landed since makes it a 409 and the decision is taken
again on a fresh read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

from controller.api.kube import CONTROLLER_MANAGER, Kube, KubeError, now_utc
from controller.cluster.decide import (
    Context,
    Decision,
    decide,
    expiry_cause,
    instant_words,
    status_changed,
    transition_events,
)
from controller.cluster.events import Events
from controller.cluster.history import Groups
from controller.cluster.lost_nodes import LostNodes
from controller.cluster.notices import Notices, warn_notice
from controller.cluster.policyset import in_force
from controller.cluster.settings import SEAM_ENV, ControllerSettings
from controller.cluster.view import Key, View
from controller.observe import logs
from controller.observe.metrics import ControllerMetrics
from controller.rules import contracts as c
from controller.rules.contracts import Phase, Reason
from controller.rules.durations import Invalid, format_instant, parse_duration, parse_instant
from controller.rules.objects import Obj, annotations_of, is_deleting, key_of, namespace_policy, sandbox_facts
from controller.rules.policy import Policy, Verdict, deadline, effective_policy

log = logging.getLogger("sandkeep.controller")


@dataclass(frozen=True)
class Result:
    """What one reconcile asks of its queue: the key again at `requeue_at`; None, only when a watch event
    queues it (controller-runtime's `Result{RequeueAfter}`, as an instant)."""

    requeue_at: datetime | None = None


class Reconciler:
    """The decisions on each key, from the view, with the guarded DELETE that expiry and quota share.

    `before_delete` is a test seam: an async callable run between the decision and the DELETE, so a
    test can land a pin exactly there (the env var SEAM_ENV does the same for a controller subprocess).
    """

    def __init__(
        self,
        kube: Kube,
        settings: ControllerSettings,
        metrics_: ControllerMetrics,
        view: View,
        events: Events,
        notices: Notices,
        *,
        remember: Callable[[Obj], None],
        enqueue: Callable[[Key], None],
        is_leader: Callable[[], bool],
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.metrics = metrics_
        self.view = view
        self.events = events
        self.notices = notices  # the warnWebhook's, sent off this path (notices.py)
        self.remember = remember  # the view keeps the newest version (and the gauges follow)
        self.enqueue = enqueue
        self.is_leader = is_leader
        self.default_policy = settings.policy()
        self.ceiling = settings.ceiling()
        self.before_delete: Callable[[Obj], Awaitable[None]] | None = None
        self.lost = LostNodes(kube, view, events, self.context, enqueue)
        self.groups = Groups()  # the history limits' groups (issue 28), kept by the controller from its watches

    # --- the rule, as this controller applies it -----------------------------------------------------------
    def policy_for(self, namespace: str) -> tuple[Policy, tuple[Reason, ...], tuple[str, ...]]:
        """The namespace's effective policy (its SandboxPolicy or the default, under the ceiling), with the
        ceiling's reasons and the problems of the policy's fields in words."""
        chosen = None
        problems: list[str] = []
        policies = self.view.policies.get(namespace) or {}
        name = in_force(policies)  # several policies in one namespace: the oldest applies (policyset)
        if name is not None:
            chosen, problems = namespace_policy(policies[name], self.default_policy)
            problems = [f"SandboxPolicy {namespace}/{name}: {p}; the default applies" for p in problems]
        policy, reasons = effective_policy(self.default_policy, self.ceiling, chosen)
        return policy, reasons, tuple(problems)

    def context(self, obj: Obj, now: datetime) -> Context:
        """The namespace's effective policy (under the ceiling) and when the object's node went away."""
        policy, reasons, problems = self.policy_for(obj["metadata"]["namespace"])
        node = (obj.get("spec") or {}).get("nodeName") or ""
        gone = None
        if node not in self.view.nodes:
            gone = self.view.node_gone_since.setdefault(node, now)
        newer = self.groups.newer(key_of(obj))
        return Context(policy, reasons, problems, gone, self.settings.node_grace, newer)

    def max_pin(self, namespace: str) -> timedelta:
        """The namespace's maxPin (its policy under the ceiling)."""
        return self.policy_for(namespace)[0].max_pin

    def verdict(self, obj: Obj, now: datetime) -> Verdict:
        """The one rule's verdict on a sandbox, as this controller applies it (its namespace's policy)."""
        policy, _, _ = self.policy_for(obj["metadata"]["namespace"])  # no node bookkeeping: the rule alone
        return deadline(replace(sandbox_facts(obj), newer=self.groups.newer(key_of(obj))), policy, now)

    def expired(self, obj: Obj, now: datetime) -> bool:
        return self.verdict(obj, now).expired

    def past_max_age(self, obj: Obj, now: datetime) -> bool:
        """Past its hard end (createdAt + maxAge): no session may hold it any longer."""
        return self.verdict(obj, now).past_max_age

    # --- one reconcile pass --------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> Result:
        """Bring one sandbox's status and fate in line with the rule. Safe to run any number of times."""
        obj = self.view.sandboxes.get(key)
        if obj is None or not self.is_leader():
            return Result()
        now = now_utc()
        if is_deleting(obj):
            return Result(await self.lost.release(obj, now))
        converted = await self._settle_pins(obj, now)
        if converted is None:
            return Result()  # the annotations changed: the watch brings the new object, which is queued again
        obj = converted
        ctx = self.context(obj, now)
        decision = decide(obj, ctx, now)
        newly_lost = decision.node_lost and (obj.get("status") or {}).get("phase") != Phase.LOST
        if newly_lost and await self.lost.still_there(obj["spec"]["nodeName"]):  # a fresh read before Lost
            ctx = self.context(obj, now)
            decision = decide(obj, ctx, now)
        if decision.delete:
            # No status write first: the object is about to go, and if it stays (a 409, the agent's
            # finalizer) the next pass or the agent writes the phase it then has.
            await self._expire(key)
            return Result()
        if status_changed(obj, decision.status):
            events = transition_events(obj, decision.status)
            obj = await asyncio.to_thread(self.kube.apply_status, obj, decision.status, CONTROLLER_MANAGER)
            self.remember(obj)
            for reason, message, type_ in events:
                self.events.post(obj, reason, message, type_)
                if reason is Reason.EXPIRING_SOON and ctx.policy.warn_webhook is not None:
                    # The same moment as the Event: once per deadline, and not again after a restart (the
                    # condition is on the object by then, so there is no transition to notice).
                    self.notices.send(ctx.policy.warn_webhook, warn_notice(obj, decision.status))
            logs.say(
                log,
                "status",
                reason=decision.phase,
                object=f"{key[0]}/{key[1]}",
                deadline=decision.status.get("deadline"),
            )
        return Result(decision.wake_at)

    async def _settle_pins(self, obj: Obj, now: datetime) -> Obj | None:
        """Turn `pin-for` into an absolute `pin-until` once, and stamp `pinned-at` where it is missing.

        One metadata patch guarded by resourceVersion; None when it was written (or lost a race), since
        the watch then delivers the new object. `pinned-at` left behind by a removed pin is cleared, so
        an old pin's start can never cap (or stretch) a new one.
        """
        ann = annotations_of(obj)
        changes: dict[str, str | None] = {}
        stamp = format_instant(now)
        if c.ANN_PIN_FOR in ann:
            duration = parse_duration(ann[c.ANN_PIN_FOR])
            if not isinstance(duration, Invalid):
                changes = {c.ANN_PIN_UNTIL: format_instant(now + duration), c.ANN_PINNED_AT: stamp, c.ANN_PIN_FOR: None}
        elif c.ANN_PIN_UNTIL in ann and c.ANN_PINNED_AT not in ann:
            if not isinstance(parse_instant(ann[c.ANN_PIN_UNTIL]), Invalid):
                changes = {c.ANN_PINNED_AT: stamp}
        elif c.ANN_PIN_UNTIL not in ann and c.ANN_PINNED_AT in ann:
            changes = {c.ANN_PINNED_AT: None}
        if not changes:
            return obj
        try:
            patched = await asyncio.to_thread(self.kube.patch_annotations, obj, changes)
        except KubeError as err:
            if not (err.conflict or err.not_found):
                raise
            fresh = await asyncio.to_thread(self.kube.get_sandbox, *key_of(obj))
            if fresh is not None:
                self.remember(fresh)
                self.enqueue(key_of(fresh))
            return None
        self.remember(patched)
        self.enqueue(key_of(patched))
        logs.say(
            log,
            "pin_settled",
            reason=Reason.PINNED,
            object="/".join(key_of(obj)),
            pin_until=changes.get(c.ANN_PIN_UNTIL),
            pinned_at=changes.get(c.ANN_PINNED_AT),
        )
        return None

    # --- the guarded DELETE ----------------------------------------------------------------------------------
    async def delete_guarded(
        self, key: Key, allowed: Callable[[Obj, Decision], bool], *, dry_run: bool = False
    ) -> tuple[Obj, Decision] | None:
        """The controller's one way to delete: decide again on the view's newest version of the object, then
        DELETE with preconditions on its uid + resourceVersion.

        The precondition makes the view's version the read the decision stands on: any change since (a
        pin, a holder, a new status) is a 409, and the object is then read fresh and decided again, so no
        GET precedes a DELETE that goes through. `allowed` judges the object and its decision; a refusal or
        a deleting object queues the key to be decided again, and nothing is deleted. With `dry_run` the
        API server checks the DELETE (`dryRun=All`) and deletes nothing. Returns what was deleted (or would
        have been), None otherwise.
        """
        fresh = self.view.sandboxes.get(key)
        if fresh is None:
            return None
        now = now_utc()
        decision = decide(fresh, self.context(fresh, now), now)
        if is_deleting(fresh) or not allowed(fresh, decision):
            self.enqueue(key)  # something moved since the view said so: take the whole decision again
            return None
        if self.before_delete is not None:
            await self.before_delete(fresh)
        await _seam(fresh)
        if not self.is_leader():
            return None
        try:
            await asyncio.to_thread(self.kube.delete_sandbox, fresh, dry_run=dry_run)
        except KubeError as err:
            if err.not_found:
                return None
            if err.conflict:
                logs.say(log, "delete_conflict", reason=Reason.CONFLICT, object=f"{key[0]}/{key[1]}")
                again = await asyncio.to_thread(self.kube.get_sandbox, *key)
                if again is not None:
                    self.remember(again)
                    self.enqueue(key)
                return None
            raise
        return fresh, decision

    async def _expire(self, key: Key) -> None:
        """An expired sandbox: its guarded DELETE, counted, with one DeleteRequested Event that says why (the
        Expired condition's words) and on which version; at a mass expiry those past the first 10 of a
        namespace in 10 s are aggregated into one Event that names them (`events.py`), and the log line stays
        one per object."""
        deleted = await self.delete_guarded(key, lambda _fresh, decision: decision.delete)
        if deleted is None:
            return
        fresh, decision = deleted
        cause = expiry_cause(decision.verdict)
        self.metrics.deletions_requested.labels(reason=cause.value).inc()
        if decision.verdict.deadline is not None:
            self.metrics.expiry_lag.observe(max(0.0, (now_utc() - decision.verdict.deadline).total_seconds()))
        expired = next(cd for cd in decision.status["conditions"] if cd["type"] == c.Condition.EXPIRED)
        message = (
            f"{key[0]}/{key[1]} expired: {expired['message']} ({cause}); "
            f"delete requested (resourceVersion {fresh['metadata']['resourceVersion']})"
        )
        similar = f"expired ({cause}); delete requested"
        self.events.post(fresh, Reason.DELETE_REQUESTED, message, "Normal", similar=similar)
        logs.say(
            log,
            "delete_requested",
            reason=cause,
            object=f"{key[0]}/{key[1]}",
            deadline=instant_words(decision.verdict.deadline),
        )


async def _seam(obj: Obj) -> None:
    """The subprocess test seam: announce `<ns>.<name>.reached`, then wait for `<ns>.<name>.go`."""
    folder = os.environ.get(SEAM_ENV)
    if not folder:
        return
    stem = f"{obj['metadata']['namespace']}.{obj['metadata']['name']}"
    (Path(folder) / f"{stem}.reached").write_text(obj["metadata"]["resourceVersion"])
    limit = time.monotonic() + 30
    while not (Path(folder) / f"{stem}.go").exists() and time.monotonic() < limit:
        await asyncio.sleep(0.02)
