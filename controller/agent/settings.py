"""The agent's settings and its few fixed numbers."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, model_validator

from controller.rules.flags import RENAMED_ENV, Flag, HumanDuration, KubeQps
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
    """The agent's settings: `SANDKEEP_*` env vars, overridden by flags, each declared once: its type, default,
    env var, flag (`Flag`, from which command.py's parser is built) and chart value. The policy settings it
    shares with the controller (`Settings`: retention, ...) are env only here."""

    node: Annotated[str, Flag("this node's name (env SANDKEEP_NODE)")] = ""
    root: Annotated[Path, Flag("the node's sandbox root (env SANDKEEP_ROOT)", value="agent.root")] = Path(
        "/var/lib/sandkeep"
    )
    kubeconfig: Annotated[str | None, Flag("kubeconfig file", shown="in-cluster, then $KUBECONFIG")] = None
    # Where the heartbeat Lease lives (env SANDKEEP_LEASE_NAMESPACE; SANDKEEP_NAMESPACE, its old name, is
    # still read for one release).
    lease_namespace: Annotated[
        str, Flag("namespace of the heartbeat Lease (env SANDKEEP_LEASE_NAMESPACE)", old="--namespace")
    ] = Field(
        "sandkeep-system", validation_alias=AliasChoices("lease_namespace", "SANDKEEP_LEASE_NAMESPACE", *RENAMED_ENV)
    )
    # (the chart serves it on agent.metricsPort, whose default is its own: 8081)
    metrics_port: Annotated[int, Flag("port for /metrics /healthz /readyz (0: any free port)")] = 9102
    metrics_host: Annotated[str, Flag("address to serve metrics on")] = "127.0.0.1"
    scan_interval: Annotated[HumanDuration, Flag("time between full passes", value="agent.scanInterval")] = timedelta(
        seconds=30
    )
    stuck_after: Annotated[
        HumanDuration, Flag("age at which a tombstone counts as stuck", value="agent.stuckAfter")
    ] = timedelta(minutes=10)
    relog_every: Annotated[HumanDuration, Flag("how often a stuck tombstone is logged again")] = timedelta(hours=24)
    orphan_timeout: Annotated[HumanDuration, Flag("how long a killed orphan command may take to end")] = timedelta(
        seconds=10
    )
    lock_wait: Annotated[
        HumanDuration, Flag("give up after waiting this long for the root lock", shown="0: forever")
    ] = timedelta(0)
    # An entry no object can own (no or a bad manifest, a missing namespace, a link, a bad name) is deleted
    # once the agent has watched it so for this long in all (controller/agent/quarantine.py). 0: never.
    quarantine_grace: Annotated[
        HumanDuration,
        Flag(
            "how long the agent watches an entry no object can own (no or a bad manifest, a missing namespace, "
            "a link, a bad name) before deleting it (0: never delete, only report)",
            value="agent.quarantineGrace",
        ),
    ] = timedelta(hours=24)
    # processes vouched for that the agent cannot inspect (e.g. a runtime's init)
    ignore_pids: Annotated[list[int], Flag("a pid vouched for", name="--ignore-pid", repeat=True)] = Field(
        default_factory=list
    )
    # Disk pressure: above `pressure_high` percent used, release oldest first until under `pressure_low`.
    # Below the kubelet's image GC (85/80 used) and eviction (nodefs.available<10%, i.e. 90% used) defaults,
    # so workspaces go before images and long before Pods. 100: never (the filesystem cannot be over 100%).
    pressure_high: Annotated[
        float,
        Flag(
            "used percent of the root's filesystem above which sandboxes are released "
            "(below the kubelet's eviction at nodefs.available<10%%; 100: never)",
            value="pressure.high",
        ),
    ] = 85.0
    pressure_low: Annotated[float, Flag("used percent releasing stops under", value="pressure.low")] = 80.0
    # optional floor: fewer bytes available also counts as over high
    pressure_min_free_bytes: Annotated[
        int, Flag("also release while fewer bytes than this are available", value="pressure.minFreeBytes")
    ] = 0
    # Client-side rate limit of every API request but the watch: one node adopting 10,000 directories at
    # once, or every agent of a large cluster restarting together, stays a steady trickle per node.
    kube_qps: Annotated[KubeQps, Flag("API requests per second on average", value="agent.kubeApi.qps")] = 20.0
    kube_burst: Annotated[
        int, Field(ge=1), Flag("API requests at once above the average", value="agent.kubeApi.burst")
    ] = 40
    # How long one sandbox's size may take to measure (one thread measures them all, one after another):
    # past it the bytes counted so far are reported, with condition SizePartial (SizeTooSlow). 0: no limit.
    size_budget: Annotated[
        HumanDuration,
        Flag(
            "how long measuring one sandbox may take; past it the bytes counted so far are reported, with "
            "condition SizePartial (0: no limit)",
            value="agent.sizeBudget",
        ),
    ] = timedelta(minutes=2)

    @model_validator(mode="after")
    def _watermarks(self) -> AgentSettings:
        problem = self.watermarks().problem()
        if problem is not None:
            raise ValueError(f"--pressure-high/--pressure-low/--pressure-min-free-bytes: {problem}")
        return self

    def watermarks(self) -> Watermarks:
        return Watermarks(self.pressure_high, self.pressure_low, self.pressure_min_free_bytes)
