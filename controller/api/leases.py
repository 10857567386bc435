"""coordination.k8s.io/v1 Leases: the controller's leader election and each node agent's heartbeat.

Every write is a resourceVersion-guarded update (or a create that fails if the Lease exists), so when
two replicas race for the same Lease exactly one wins and the other sees 409 and stays a standby.
Times are MicroTime, as client-go writes them, so `kubectl get lease -o yaml` reads the same for
sandkeep as for any Kubernetes component.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from controller.api.kube import Kube, KubeError, micro_time, now_utc
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules.durations import instant_or_none
from controller.rules.models import NAME_MAX, label_value

log = logging.getLogger(__name__)

LEASE_DURATION = 15  # seconds: a standby takes over within 15 s (+ one retry period) of a SIGKILLed leader
RETRY_PERIOD = 2.0  # seconds between attempts to acquire or renew


def lease_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"
    return path if name is None else f"{path}/{quote(name)}"


def default_identity() -> str:
    """`<hostname>_<pid>`: unique per process, readable in `kubectl get lease`."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}_{os.getpid()}"


@dataclass(frozen=True)
class LeaseState:
    """A Lease as read: who holds it, until when it counts, and the version to guard an update with."""

    holder: str | None
    renew_time: datetime | None
    acquire_time: datetime | None
    duration: timedelta
    transitions: int
    resource_version: str
    raw: dict[str, Any]

    def expired(self, now: datetime) -> bool:
        """Free to take: nobody holds it, or the holder has not renewed within its duration."""
        if not self.holder or self.renew_time is None:
            return True
        return self.renew_time + self.duration <= now

    def age(self, now: datetime) -> timedelta | None:
        """Time since the last renewal (None when never renewed)."""
        return None if self.renew_time is None else now - self.renew_time


def _state(raw: dict[str, Any]) -> LeaseState:
    spec = raw.get("spec") or {}
    return LeaseState(
        holder=spec.get("holderIdentity"),
        renew_time=instant_or_none(spec.get("renewTime")),
        acquire_time=instant_or_none(spec.get("acquireTime")),
        duration=timedelta(seconds=int(spec.get("leaseDurationSeconds") or LEASE_DURATION)),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=raw["metadata"]["resourceVersion"],
        raw=raw,
    )


def read_lease(kube: Kube, namespace: str, name: str) -> LeaseState | None:
    """The Lease, or None when it does not exist."""
    try:
        return _state(kube.request("GET", lease_path(namespace, name)))
    except KubeError as err:
        if err.not_found:
            return None
        raise


def _held_by(identity: str, duration_s: int, now: datetime) -> dict[str, Any]:
    """The spec fields every write of a Lease renews: who holds it, for how long, as of when."""
    return {"holderIdentity": identity, "leaseDurationSeconds": duration_s, "renewTime": micro_time(now)}


def _new_lease(metadata: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}


@dataclass
class Observed:
    """What this replica last saw of a Lease, and when by its OWN monotonic clock: client-go's observedTime.

    Another replica's `renewTime` is only ever compared with itself (has it changed?), never with our
    wall clock: with clocks minutes apart, judging expiry by `renewTime + duration <= now` made one
    replica steal a live Lease (two acting leaders) or never take over a dead one.
    """

    record: tuple[Any, ...] | None = None
    at: float = 0.0

    def see(self, lease: LeaseState, now: float) -> None:
        spec = lease.raw.get("spec") or {}
        keys = ("holderIdentity", "renewTime", "acquireTime", "leaseTransitions")
        record = (*(spec.get(k) for k in keys), lease.duration)
        if record != self.record:
            self.record, self.at = record, now

    def expired(self, lease: LeaseState, now: float) -> bool:
        """Free to take: nobody holds it, or it has not changed for a whole duration as we count time."""
        return not lease.holder or self.at + lease.duration.total_seconds() <= now


def try_acquire_or_renew(
    kube: Kube,
    namespace: str,
    name: str,
    identity: str,
    duration_s: int = LEASE_DURATION,
    *,
    observed: Observed | None = None,
    wall: Callable[[], datetime] = now_utc,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """One round of leader election: True when `identity` holds the Lease afterwards.

    Acquire when the Lease is absent, free, or unchanged for a whole duration since this replica first
    saw it so (`observed`, kept across rounds; a fresh one never takes a held Lease); renew when we hold
    it. `wall` only stamps what we write, for people reading the Lease. Any write races with the other
    replicas: a 409 means someone else won this round, which is an answer (False), not an error.
    """
    now = wall()
    observed = observed if observed is not None else Observed()
    current = read_lease(kube, namespace, name)
    spec = _held_by(identity, duration_s, now)
    try:
        if current is None:
            spec |= {"acquireTime": micro_time(now), "leaseTransitions": 0}
            kube.request("POST", lease_path(namespace), body=_new_lease({"name": name}, spec))
            return True
        observed.see(current, clock())
        if current.holder != identity and not observed.expired(current, clock()):
            return False
        if current.holder == identity:
            spec |= {
                "acquireTime": micro_time(current.acquire_time or now),
                "leaseTransitions": current.transitions,
            }
        else:
            spec |= {"acquireTime": micro_time(now), "leaseTransitions": current.transitions + 1}
        body = dict(current.raw)
        body["metadata"] = dict(current.raw["metadata"])  # carries resourceVersion: the update's guard
        body["spec"] = spec
        kube.request("PUT", lease_path(namespace, name), body=body)
        return True
    except KubeError as err:
        if err.conflict:  # 409 on create (exists) or on update (stale version): another replica won
            return False
        raise


def release(kube: Kube, namespace: str, name: str, identity: str) -> None:
    """Give the Lease up on a clean shutdown, so the standby takes over at once instead of after expiry."""
    try:
        current = read_lease(kube, namespace, name)
        if current is None or current.holder != identity:
            return
        body = dict(current.raw)
        body["spec"] = dict(current.raw.get("spec") or {}) | {"holderIdentity": None, "leaseDurationSeconds": 1}
        kube.request("PUT", lease_path(namespace, name), body=body)
    except KubeError as err:
        logs.say(log, "lease_release_failed", level=logging.WARNING, lease=name, error=str(err)[:300])


class LeaderElector:
    """Holds the controller's Lease: `is_leader` is True only while the last renewal is recent enough.

    A renewal that fails (API down, lost the race) steps down at once rather than acting on a Lease
    that may already belong to the other replica; the deadline-based check also steps down if renewals
    stall, before the Lease could expire for the others.
    """

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str = c.CONTROLLER_LEASE,
        identity: str | None = None,
        duration_s: int = LEASE_DURATION,
        retry_period: float = RETRY_PERIOD,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
        wall: Callable[[], datetime] = now_utc,
    ) -> None:
        self.kube = kube
        self.wall = wall  # stamps renewTime only; expiry is judged by `self.observed` on our monotonic clock
        self.observed = Observed()
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.duration_s = duration_s
        self.retry_period = retry_period
        self.on_change = on_change
        self._renewed_at: float | None = None
        self._leading = False

    @property
    def is_leader(self) -> bool:
        loop_now = asyncio.get_running_loop().time() if self._renewed_at is not None else 0.0
        # Act only while well inside the Lease: stop at 2/3 of its duration without a renewal.
        return self._leading and self._renewed_at is not None and loop_now - self._renewed_at < self.duration_s * 2 / 3

    async def run(self) -> None:
        """Acquire-or-renew every retry period until cancelled; releases the Lease when cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    won = await asyncio.to_thread(
                        try_acquire_or_renew,
                        self.kube,
                        self.namespace,
                        self.name,
                        self.identity,
                        self.duration_s,
                        observed=self.observed,
                        wall=self.wall,
                    )
                except KubeError as err:
                    logs.say(log, "lease_renew_failed", level=logging.WARNING, lease=self.name, error=str(err)[:300])
                    won = False
                if won:
                    self._renewed_at = loop.time()
                await self._set(won)
                await asyncio.sleep(self.retry_period)
        finally:
            if self._leading:
                self._leading = False
                await asyncio.to_thread(release, self.kube, self.namespace, self.name, self.identity)

    async def _set(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        logs.say(log, "leader_elected" if leading else "leader_lost", lease=self.name, identity=self.identity)
        if self.on_change is not None:
            await self.on_change(leading)


# --- the agent's per-node heartbeat ----------------------------------------------------------------------
def heartbeat_name(node: str) -> str:
    """`sandkeep-agent-<node>`; for a node name over 238 characters, which the prefix would take past the
    253 of an object name, the node name itself. Not a hash: the chart's node-scope admission policy must
    compute the very name in CEL, which has none, to let each agent write only its own node's Lease."""
    prefixed = c.AGENT_LEASE_PREFIX + node
    return prefixed if len(prefixed) <= NAME_MAX else node


def heartbeat_meta(node: str) -> dict[str, Any]:
    """The heartbeat's metadata: the node's full name in an annotation, a bounded form in the label."""
    return {
        "name": heartbeat_name(node),
        "labels": {c.LABEL_NODE: label_value(node), c.LABEL_MANAGED_BY: c.MANAGED_BY},
        "annotations": {c.LABEL_NODE: node},
    }


def _with_meta(metadata: dict[str, Any], node: str) -> dict[str, Any]:
    """`metadata` with the heartbeat's labels and node annotation put back: a Lease written before the
    annotation existed gets it at its next renewal (the node-scope policy admits only one that names
    the agent's node)."""
    wanted = heartbeat_meta(node)
    return metadata | {key: (metadata.get(key) or {}) | wanted[key] for key in ("labels", "annotations")}


def renew_heartbeat(kube: Kube, namespace: str, node: str, identity: str, duration_s: int = 60) -> None:
    """The agent's "still here": create or renew `sandkeep-agent-<node>`, held by the agent's identity.

    The heartbeat is not an election (one agent per node), so a 409 is simply retried once on a fresh
    read; anything else propagates to the caller, which logs it and tries again next pass.
    """
    for _attempt in range(2):
        now = now_utc()
        current = read_lease(kube, namespace, heartbeat_name(node))
        spec = _held_by(identity, duration_s, now)
        try:
            if current is None:
                spec["acquireTime"] = micro_time(now)
                kube.request("POST", lease_path(namespace), body=_new_lease(heartbeat_meta(node), spec))
            else:
                spec["acquireTime"] = micro_time(current.acquire_time or now)
                body = dict(current.raw) | {"spec": spec, "metadata": _with_meta(current.raw["metadata"], node)}
                kube.request("PUT", lease_path(namespace, heartbeat_name(node)), body=body)
            return
        except KubeError as err:
            if not err.conflict:
                raise
    raise KubeError(409, f"heartbeat lease {heartbeat_name(node)} kept changing under us", "PUT")


def agent_heartbeats(kube: Kube, namespace: str) -> dict[str, LeaseState]:
    """node -> its agent's heartbeat Lease, for `doctor` and the controller to tell stale agents."""
    items = kube.request("GET", lease_path(namespace)).get("items", [])
    result: dict[str, LeaseState] = {}
    for raw in items:
        name = raw["metadata"]["name"]
        node = (raw["metadata"].get("annotations") or {}).get(c.LABEL_NODE)
        if node is None and name.startswith(c.AGENT_LEASE_PREFIX):
            node = name.removeprefix(c.AGENT_LEASE_PREFIX)  # written before the annotation was
        if node is not None and heartbeat_name(node) == name:  # a Lease maps back only through its own node
            result[node] = _state(raw)
    return result


def agent_stale(state: LeaseState | None, now: datetime) -> bool:
    """An agent is stale when its heartbeat is missing or older than its own declared duration."""
    return state is None or state.expired(now)
