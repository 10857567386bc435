"""Quotas: a namespace over its SandboxPolicy's quota releases its oldest releasable sandboxes.

`rules/quota.py`'s `choose` (pure) plans the release from the view; each release is the expiry's own
guarded DELETE (`Reconciler.delete_guarded`), judged again on the view's newest version, so a pin or a
holder that landed meanwhile keeps the sandbox. A namespace is checked once per burst of events
(`QUOTA_SETTLE`), on its own work queue.
"""

from __future__ import annotations

import logging
from datetime import datetime

from controller.api.kube import now_utc
from controller.api.workqueue import WorkQueue
from controller.cluster.decide import Decision
from controller.cluster.reconciler import Reconciler
from controller.cluster.view import Key
from controller.observe import logs
from controller.rules.contracts import Reason
from controller.rules.objects import Obj, is_deleting, key_of, observed_of, pin_pending, sandbox_facts
from controller.rules.policy import Policy, deadline
from controller.rules.pressure import Candidate
from controller.rules.quota import choose as quota_plan

log = logging.getLogger("sandkeep.controller")
QUOTA_SETTLE = 1.0  # seconds a namespace's quota check waits, so a burst of events costs one check


class QuotaEnforcer:
    def __init__(self, reconciler: Reconciler) -> None:
        self.view = reconciler.view
        self.events = reconciler.events
        self.metrics = reconciler.metrics
        self.policy_for = reconciler.policy_for
        self.delete_guarded = reconciler.delete_guarded
        self.is_leader = reconciler.is_leader
        self.queue: WorkQueue[str] = WorkQueue()  # namespaces whose quota to check
        self._would_release: set[str] = set()  # uids a dry-run quota release was already reported for
        self._flagged: dict[str, str] = {}  # namespace -> what was said while over quota with nothing left

    def check(self, namespace: str) -> None:
        """Look at the namespace's quota soon: one check for a burst of events (the earliest request wins)."""
        if self.policy_for(namespace)[0].quota.limited or namespace in self._flagged:
            self.queue.add_after(namespace, QUOTA_SETTLE)

    def check_all(self) -> None:
        for namespace in list(self.view.names):
            self.check(namespace)

    def forget(self, obj: Obj) -> None:
        """A sandbox is gone: a dry-run release of it was reported for the last time."""
        self._would_release.discard(obj["metadata"].get("uid", ""))

    def candidate(self, obj: Obj, policy: Policy, now: datetime) -> Candidate:
        """One sandbox as the quota sees it: a pin in force after its cap (even one that does not extend the
        deadline: the person asked to keep it until then), a pin-for about to be, and a holder keep it."""
        verdict = deadline(sandbox_facts(obj), policy, now)
        size = (obj.get("status") or {}).get("sizeBytes")
        return Candidate(
            key=key_of(obj),
            size=size if isinstance(size, int) else None,
            deadline=verdict.deadline,
            pinned=verdict.holds(now) or pin_pending(obj),
            held=observed_of(obj).held,
            deleting=is_deleting(obj),
        )

    async def enforce(self, namespace: str) -> None:
        """As leader: release the namespace's oldest releasable sandboxes while it is over its quota.

        Each release is the expiry's guarded DELETE (`delete_guarded`), judged again on a fresh read: a pin
        or a holder that landed meanwhile keeps the sandbox. The first refusal ends the round; the watch
        events of what changed bring the namespace back, and the next plan counts deletions under way.
        """
        if not self.is_leader():
            return
        policy = self.policy_for(namespace)[0]
        now = now_utc()
        members = [self.view.sandboxes[k] for k in self.view.in_namespace(namespace) if k in self.view.sandboxes]
        plan = quota_plan(policy.quota, [self.candidate(o, policy, now) for o in members])
        words = plan.before.words(policy.quota)
        for key in plan.release:
            cached = self.view.sandboxes.get(key)
            if policy.dry_run and cached is not None and cached["metadata"].get("uid") in self._would_release:
                continue  # dry-run: reported once; it stays, and asking again would only cost API calls
            if not await self._release(key, policy, words):
                break
        self.metrics.quota_unrelieved.labels(namespace=namespace).set(0 if plan.within else 1)
        if plan.within:
            self._flagged.pop(namespace, None)
            return
        blocked = " ".join(f"{'/'.join(b.key)}({'pinned' if b.pinned else 'held'})" for b in plan.blocked)
        usage = plan.after.words(policy.quota)
        if self._flagged.get(namespace) != f"{usage} {blocked}":  # said once per change, not per check
            self._flagged[namespace] = f"{usage} {blocked}"
            logs.say(
                log,
                "quota_unrelieved",
                level=logging.WARNING,
                reason=Reason.QUOTA_UNRELIEVED,
                namespace=namespace,
                usage=usage,
                blocked=blocked,
                action="unpin or stop what holds them, or raise the SandboxPolicy's quota",
            )

    async def _release(self, key: Key, policy: Policy, words: str) -> bool:
        """Release one sandbox for its namespace's quota; True when asked (or, in dry-run, reported)."""

        def releasable(fresh: Obj, _decision: Decision) -> bool:
            candidate = self.candidate(fresh, policy, now_utc())
            return not (candidate.pinned or candidate.held)

        deleted = await self.delete_guarded(key, releasable, dry_run=policy.dry_run)
        if deleted is None:
            return False
        fresh = deleted[0]
        name = f"{key[0]}/{key[1]}"
        if policy.dry_run:
            if fresh["metadata"]["uid"] not in self._would_release:
                self._would_release.add(fresh["metadata"]["uid"])
                message = (
                    f"{name} would be released: namespace {key[0]} keeps {words}; dry-run is on, nothing is deleted"
                )
                self.events.post(fresh, Reason.WOULD_DELETE, message, "Normal")
            return True
        self.metrics.deletions_requested.labels(reason=Reason.QUOTA_EXCEEDED.value).inc()
        message = (
            f"{name} released: namespace {key[0]} keeps {words}; its oldest unpinned, unheld sandboxes go first "
            f"until it is within the quota; delete requested (resourceVersion {fresh['metadata']['resourceVersion']})"
        )
        self.events.post(fresh, Reason.QUOTA_EXCEEDED, message, "Warning")
        logs.say(log, "delete_requested", reason=Reason.QUOTA_EXCEEDED, object=name, usage=words)
        return True
