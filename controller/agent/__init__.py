"""`sandkeep agent`: the node agent. Observes one node's root, adopts retained directories, and deletes
a sandbox's directory behind the `sandkeep.io/disk` finalizer when its object is deleted.

Its parts, each named for its job (the data flow is drawn in docs/architecture.md):

    command.py    flags and settings, the root lock, start and stop
    runtime.py    the watch feeding the cache, the work queue, the passes, the heartbeat Lease
    watch.py      this node's objects: listed in pages, then watched (ListWatch, server-side field selector)
    decide.py     pure: what an object needs next (`next_step`), what a tombstone is for (`fate`)
    adoption.py   a retained directory without an object gets one
    quarantine.py what no object can own: timed by the agent's own clock, reported, deleted after the grace
    report.py     status, conditions, Events, metrics, log lines; one pipeline outcome at a time
    relief.py     releasing for space: above the high watermark, the oldest releasable sandboxes' guarded DELETE
    sizer.py      sandbox sizes, measured off the loop
    state.py      the cache and what was last seen
    settings.py   AgentSettings and the few fixed numbers

The deletion itself (reap orphans, in-use check, rename, read back, delete, stuck bookkeeping, leftover
tombstones) is `controller/node/reaper.py`, shared with the standalone sweep.
"""

from controller.agent.command import add_arguments, run, settings_from
from controller.agent.decide import claim_of, owned_view, status_changed
from controller.agent.report import stuck_message
from controller.agent.runtime import Agent
from controller.agent.settings import SEAM_KILL_AFTER_RENAME, SEAM_KILL_DURING_DELETE, AgentSettings
from controller.agent.sizer import measure

__all__ = [
    "SEAM_KILL_AFTER_RENAME",
    "SEAM_KILL_DURING_DELETE",
    "Agent",
    "AgentSettings",
    "add_arguments",
    "claim_of",
    "measure",
    "owned_view",
    "run",
    "settings_from",
    "status_changed",
    "stuck_message",
]
