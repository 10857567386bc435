"""The agent's settings and its few fixed numbers."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from pydantic import Field

from controller.flags import HumanDuration
from controller.models import Settings

HEARTBEAT_EVERY = 15.0  # seconds between heartbeat renewals (the Lease says 60 s)
PARALLEL = 8  # API requests (and reaps) in flight at once during a pass

# Test seams: make the agent SIGKILL itself right after the rename, or N seconds into a tombstone delete.
SEAM_KILL_AFTER_RENAME = "SANDKEEP_TEST_KILL_AFTER_RENAME"
SEAM_KILL_DURING_DELETE = "SANDKEEP_TEST_KILL_DURING_DELETE"


class AgentSettings(Settings):
    """The agent's settings: `SANDKEEP_*` env vars, overridden by flags."""

    node: str = ""
    root: Path = Path("/var/lib/sandkeep")
    kubeconfig: str | None = None
    namespace: str = "sandkeep-system"  # where the heartbeat Lease lives
    metrics_port: int = 9102
    metrics_host: str = "127.0.0.1"
    scan_interval: HumanDuration = timedelta(seconds=30)
    stuck_after: HumanDuration = timedelta(minutes=10)
    relog_every: HumanDuration = timedelta(hours=24)
    orphan_timeout: HumanDuration = timedelta(seconds=10)
    lock_wait: HumanDuration = timedelta(0)  # 0: wait for the root lock forever
    ignore_pids: list[int] = Field(
        default_factory=list
    )  # processes vouched for that the agent cannot inspect (e.g. a runtime's init)
