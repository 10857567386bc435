"""The agent's settings and its few fixed numbers."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, model_validator

from controller.rules.flags import RENAMED_ENV, HumanDuration, KubeQps
from controller.rules.models import Settings
from controller.rules.pressure import Watermarks

HEARTBEAT_EVERY = 15.0  # seconds between heartbeat renewals (the Lease says 60 s)
PARALLEL = 8  # API requests (and reaps) in flight at once during a pass
BATCH = 1000  # queued objects taken together between passes (their deletions share one /proc pass)
DELETING_AFTER = 2.0  # seconds a delete runs before its Deleting status is worth a request

# Test seams: make the agent SIGKILL itself right after the rename, or N seconds into a tombstone delete.
SEAM_KILL_AFTER_RENAME = "SANDKEEP_TEST_KILL_AFTER_RENAME"
SEAM_KILL_DURING_DELETE = "SANDKEEP_TEST_KILL_DURING_DELETE"


class AgentSettings(Settings):
    """The agent's settings: `SANDKEEP_*` env vars, overridden by flags."""

    node: str = ""
    root: Path = Path("/var/lib/sandkeep")
    kubeconfig: str | None = None
    # Where the heartbeat Lease lives (env SANDKEEP_LEASE_NAMESPACE; SANDKEEP_NAMESPACE, its old name, is
    # still read for one release).
    lease_namespace: str = Field(
        "sandkeep-system", validation_alias=AliasChoices("lease_namespace", "SANDKEEP_LEASE_NAMESPACE", *RENAMED_ENV)
    )
    metrics_port: int = 9102
    metrics_host: str = "127.0.0.1"
    scan_interval: HumanDuration = timedelta(seconds=30)
    stuck_after: HumanDuration = timedelta(minutes=10)
    relog_every: HumanDuration = timedelta(hours=24)
    orphan_timeout: HumanDuration = timedelta(seconds=10)
    lock_wait: HumanDuration = timedelta(0)  # 0: wait for the root lock forever
    # An entry no object can own (no or a bad manifest, a missing namespace, a link, a bad name) is deleted
    # once the agent has watched it so for this long in all (controller/agent/quarantine.py). 0: never.
    quarantine_grace: HumanDuration = timedelta(hours=24)
    ignore_pids: list[int] = Field(
        default_factory=list
    )  # processes vouched for that the agent cannot inspect (e.g. a runtime's init)
    # Disk pressure: above `pressure_high` percent used, release oldest first until under `pressure_low`.
    # Below the kubelet's image GC (85/80 used) and eviction (nodefs.available<10%, i.e. 90% used) defaults,
    # so workspaces go before images and long before Pods. 100: never (the filesystem cannot be over 100%).
    pressure_high: float = 85.0
    pressure_low: float = 80.0
    pressure_min_free_bytes: int = 0  # optional floor: fewer bytes available also counts as over high
    # Client-side rate limit of every API request but the watch: one node adopting 10,000 directories at
    # once, or every agent of a large cluster restarting together, stays a steady trickle per node.
    kube_qps: KubeQps = 20.0
    kube_burst: Annotated[int, Field(ge=1)] = 40
    # How long one sandbox's size may take to measure (one thread measures them all, one after another):
    # past it the bytes counted so far are reported, with condition SizePartial (SizeTooSlow). 0: no limit.
    size_budget: HumanDuration = timedelta(minutes=2)

    @model_validator(mode="after")
    def _watermarks(self) -> AgentSettings:
        problem = self.watermarks().problem()
        if problem is not None:
            raise ValueError(f"--pressure-high/--pressure-low/--pressure-min-free-bytes: {problem}")
        return self

    def watermarks(self) -> Watermarks:
        return Watermarks(self.pressure_high, self.pressure_low, self.pressure_min_free_bytes)
