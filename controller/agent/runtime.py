"""The agent's runtime: the watch feeding the cache, the work queue, the passes, the heartbeat.

One asyncio loop, one worker: every object is processed level-triggered (`process(key)` may run any
number of times and always moves the object one safe step closer to what its state asks, as
`decide.next_step` says). Blocking work runs in threads: API calls and disk reads in the default
executor, the deletion pipeline (`controller/node/reaper.py`) in the agent's own reap threads. A pass:
captured volumes whose Pod ended and leftover tombstones first, then the disk scan, in-use, adoption,
every object, relief, quarantine, metrics, the heartbeat. Between passes, queued keys (watch events,
size changes, retries with per-key backoff) are processed.

The Agent is one object in parts (`base.AgentBase` declares what they share): this module is the watch, the
queue, the passes and one object; `deletion.py` the pipeline and in-use, `heartbeat.py` the Lease and health.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from controller.agent import watch
from controller.agent.adoption import Adopter
from controller.agent.capture import Capture
from controller.agent.decide import Key, Step, discount_orphans, fate, next_step, observe
from controller.agent.deletion import Deletion
from controller.agent.heartbeat import Heartbeat
from controller.agent.quarantine import Quarantine
from controller.agent.relief import Relief
from controller.agent.report import Reporter
from controller.agent.settings import (
    BATCH,
    PARALLEL,
    AgentSettings,
)
from controller.agent.sizer import Sizer
from controller.agent.state import AgentState, Shared
from controller.api import kube, leases
from controller.api.cache import vanished
from controller.api.kube import Kube, KubeError
from controller.api.workqueue import WorkQueue
from controller.node import orphans
from controller.node.capture import Volumes
from controller.node.inuse import scan_usage
from controller.node.reaper import Hooks, Reaper
from controller.node.store import Root, Tombstone
from controller.observe import logs, metrics
from controller.rules import objects
from controller.rules.contracts import FINALIZER, Queue, Reason
from controller.rules.objects import Obj

log = logging.getLogger("sandkeep.agent")


class Agent(Deletion, Heartbeat):
    """The node agent: its parts are `AgentBase`'s (base.py); this one is the watch, the queue, the passes and one
    object."""

    def __init__(
        self,
        settings: AgentSettings,
        client: Kube,
        root: Root,
        agent_metrics: metrics.AgentMetrics,
        *,
        kill: orphans.Kill = orphans.send,
    ) -> None:
        self.s = settings
        self.kube = client
        self.root = root
        self.m = agent_metrics
        self.state = AgentState()
        self.queue: WorkQueue[Key] = WorkQueue()  # a held or failed key comes back with per-key backoff
        self.queue.instrument(agent_metrics.queues, Queue.AGENT)
        self.loop: asyncio.AbstractEventLoop | None = None
        # A delete's Deleting report, waiting (a timer) or under way (its apply), until its outcome is said.
        self.deleting = {}
        self.sizer = Sizer(root, self._size_changed, settings.size_budget.total_seconds() or None)
        shared = Shared(
            settings, client, root, agent_metrics, self.state, lambda: self.sizer.sizes, lambda: self.sizer.owners
        )
        self.report = Reporter(shared)
        self.adopter = Adopter(shared, self.report, self._each)
        self.identity = leases.default_identity()
        self.ignore = {os.getpid(), *settings.ignore_pids}
        self.relief = Relief(shared, self.report, self._in_use_batch)
        # Captured volumes: `sandkeep csi-node` publishes them, the passes decide. Whether a target is still mounted
        # is read from the node's own mount table (pid 1's, with hostPID): the kubelet's directory, where the
        # targets are, is not mounted in the agent's container.
        self.volumes = Volumes(root, mountinfo=Path("/proc/1/mountinfo"))
        self.capture = Capture(shared, self.report, self.volumes, self._pods)
        self.last_published: str | None = None
        self.watch = watch.sandboxes(client, settings.node, self._on_watch, self._listed)
        self.watching: asyncio.Task[None] | None = None  # the watch's task, while the agent runs
        self.stopping = asyncio.Event()
        self.started = time.monotonic()
        self.last_pass: float | None = None
        self.reaper = Reaper(
            root,
            in_use_many=self._in_use_indexed,
            stuck_after=settings.stuck_after,
            orphan_timeout=settings.orphan_timeout,
            kill=kill,
            hooks=Hooks(after_rename=self._after_rename, before_delete=self._before_delete),
            guard=self.volumes,  # a reopen csi-node records up to the rename holds the sandbox
        )
        self.quarantine = Quarantine(
            shared,
            self.report,
            lambda entries: self._pipeline(self.reaper.reap_unadoptable, entries),
            self.adopter.namespace_exists,
        )
        # The pipeline's own threads, apart from the default executor the loop's API calls use, so a long
        # delete never delays a report or a watch.
        self.reap_pool = ThreadPoolExecutor(PARALLEL, "reap")

    # --- the watch and the queue -----------------------------------------------------------------------

    def _size_changed(self, key: Key) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.queue.add, key)

    def _listed(self, seen: set[Key]) -> None:
        """A listing of this node's objects is complete, so a pass may adopt: what the cache holds beyond
        it was deleted while the watch was down (a relist after 410 Gone) and is forgotten."""
        for key in vanished(list(self.state.objects), seen):
            self.state.forget(self.state.objects[key])
            self.queue.drop(key)
        self.state.synced = True

    def _on_watch(self, event_type: str | None, obj: Obj) -> None:
        """One watch event (None: an object of a listing): keep the newest version, queue the key."""
        if not self._mine(obj):
            return
        key = objects.key_of(obj)
        if event_type == "DELETED":
            self.state.forget(obj)
            self.queue.drop(key)
            return
        self.state.remember(obj)
        self.queue.add(key)

    def _mine(self, obj: Obj) -> bool:
        return (obj.get("spec") or {}).get("nodeName") == self.s.node

    # --- run -------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = stop
        self.sizer.start()
        interval = self.s.scan_interval.total_seconds()
        beat = asyncio.create_task(self._heartbeat_loop(stop))
        self.watching = asyncio.create_task(self.watch.run(), name="watch")
        try:
            await _first(self.watch.synced, stop)  # no pass before the listing is complete
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self.full_pass()
                except Exception as err:
                    logs.say(log, "pass_failed", level=logging.ERROR, reason=Reason.AGENT_ERROR, error=repr(err)[:500])
                await self._drain(stop, started + interval)
        finally:
            self.sizer.stop()
            beat.cancel()
            self.reap_pool.shutdown(wait=False)
            self.watching.cancel()
            await asyncio.gather(self.watching, return_exceptions=True)

    async def _drain(self, stop: asyncio.Event, until: float) -> None:
        """Process queued objects, what is ready at once as one batch, until the next pass is due."""
        while not stop.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                key = await asyncio.wait_for(self.queue.get(), timeout=min(left, 0.5))
            except TimeoutError:
                continue
            keys = [key, *self.queue.get_ready(BATCH - 1)]  # a wave of watch events is one batch
            try:
                await self.process_many(keys)
            finally:
                for done in keys:
                    self.queue.done(done)

    # --- one pass --------------------------------------------------------------------------------------

    async def full_pass(self) -> None:
        """Captured volumes whose Pod ended, and leftover tombstones, first; then the disk scan, in-use,
        adoption, every object, relief, quarantine, metrics, heartbeat."""
        self.reaper.begin_pass()
        await self.capture.tend()
        await self.clear_tombstones()
        t0 = time.monotonic()
        scan = await asyncio.to_thread(self.root.scan)
        self.m.scan_duration.labels(self.s.node).observe(time.monotonic() - t0)
        keys = {(e.namespace, e.name): e.path for e in scan.sandboxes}
        self.state.present = set(keys)
        # a deletion asks again, and holds without them
        pods = self._pod_paths(await asyncio.to_thread(self._pods)) or []
        held, unknown = await asyncio.to_thread(self.volumes.reopened)
        usage = await asyncio.to_thread(scan_usage, keys, pods, Path("/proc"), self.ignore, held, unknown)
        self.m.inuse_scans.labels(self.s.node).inc()
        self.state.usage = await asyncio.to_thread(discount_orphans, usage, keys, orphans.orphan_pids)
        refused = await self.adopter.adopt(scan.sandboxes)
        self.sizer.request(keys)
        self._prune(set(keys))
        await self.process_many(list(self.state.objects))
        await self.relief.relieve()
        await self.quarantine.tend(scan.strays, refused)
        self.report.node_metrics(scan.tombstones, self.reaper)
        await self._heartbeat()
        self.last_pass = time.monotonic()

    def _prune(self, present: set[Key]) -> None:
        """Forget what belongs to sandboxes and objects that are gone, so a churning node's agent stays small."""
        for key in list(self.sizer.sizes):  # list(): one C-level copy, safe beside the sizer thread
            if key not in present:
                self.sizer.sizes.pop(key, None)
                self.sizer.owners.pop(key, None)
        uids = {o["metadata"].get("uid") for o in self.state.objects.values()}
        self.relief.forget(uids)
        for event_key in [k for k in self.state.events if k[0] not in uids]:
            self.state.events.pop(event_key, None)
        horizon = time.monotonic() - self.s.relog_every.total_seconds()
        for subject in [k for k, (t, _) in self.state.said.items() if t < horizon]:
            self.state.said.pop(subject, None)

    # --- one object ------------------------------------------------------------------------------------

    async def process(self, key: Key) -> None:
        """Do what `decide.next_step` says this object needs next."""
        await self.process_many([key], raising=True)

    async def process_many(self, keys: list[Key], *, raising: bool = False) -> None:
        """Process `keys` (distinct), at most PARALLEL at a time; those whose next step is to reap go through
        the pipeline's looks together, so a wave of deletions shares one /proc pass instead of one each.
        A failed key is retried with backoff and said (`raising`: the error is raised instead).

        Each other key is acted on as soon as it is looked at, with the version its step was decided on: a
        pass over every object holds at most PARALLEL of them unpacked from the cache, and the reaps."""
        reaps: dict[Key, Obj] = {}

        async def one(key: Key) -> None:
            obj = self.state.objects.get(key)
            if obj is None:
                return
            uid = obj["metadata"]["uid"]
            tomb = await asyncio.to_thread(self._tombstone_of, uid) if objects.is_deleting(obj) else None
            step = next_step(observe(obj, self.s.node, tomb is not None))
            if step is Step.REAP:
                reaps[key] = obj
            else:
                await self._act(key, obj, tomb, step)

        await self._each(keys, functools.partial(self._guarded, raising, one))
        if reaps:
            await self._reap(reaps, raising)

    async def _act(self, key: Key, obj: Obj, tomb: Tombstone | None, step: Step) -> None:
        if step is Step.IGNORE:
            return
        if step is Step.FINISH and tomb is not None:
            outcome = await self._pipeline(self.reaper.leftover, tomb, lambda _read: fate(obj))
            await self._after(obj, key, tomb.name, outcome)
            return
        if step is Step.ADD_FINALIZER:
            added = await self._add_finalizer(obj)
            if added is None:
                return
            obj = added
        self.report.check_spec_path(obj)
        await self.report.apply(obj, self.report.observed_status(obj))
        self.queue.forget(key)

    async def _add_finalizer(self, obj: Obj) -> Obj | None:
        meta = obj["metadata"]
        ops: list[Obj] = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]}]
        if meta.get("finalizers"):
            ops.append({"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER})
        else:
            ops.append({"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]})
        try:
            updated: Obj = await asyncio.to_thread(
                self.kube.request,
                "PATCH",
                kube.sandbox_path(meta["namespace"], meta["name"]),
                body=ops,
                content_type="application/json-patch+json",
            )
        except KubeError as err:
            if err.status in (404, 409, 422):
                return None  # changed or gone meanwhile: the watch brings the fresh object
            raise
        self.state.remember(updated)
        return updated


async def _first(*events: asyncio.Event) -> None:
    """Wait until one of `events` is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
