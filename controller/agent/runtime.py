"""The agent's runtime: the watch feeding the cache, the work queue, the passes, the heartbeat.

One asyncio loop, one worker: every object is processed level-triggered (`process(key)` may run any
number of times and always moves the object one safe step closer to what its state asks, as
`decide.next_step` says). Blocking work runs in threads: API calls and disk reads in the default
executor, the deletion pipeline (`controller/node/reaper.py`) in the agent's own reap threads. A pass:
captured volumes whose Pod ended and leftover tombstones first, then the disk scan, in-use, adoption,
every object, relief, quarantine, metrics, the heartbeat. Between passes, queued keys (watch events,
size changes, retries with per-key backoff) are processed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from controller.agent import sessions, watch
from controller.agent.adoption import Adopter
from controller.agent.capture import Capture
from controller.agent.decide import Key, Step, claim_of, discount_orphans, fate, next_step, observe
from controller.agent.quarantine import Quarantine
from controller.agent.relief import Relief
from controller.agent.report import After, Reporter, orphan_report
from controller.agent.settings import (
    BATCH,
    DELETING_AFTER,
    HEARTBEAT_EVERY,
    PARALLEL,
    SEAM_KILL_AFTER_RENAME,
    SEAM_KILL_DURING_DELETE,
    AgentSettings,
)
from controller.agent.sizer import Sizer
from controller.agent.state import AgentState, Shared
from controller.api import kube, leases
from controller.api.kube import AGENT_MANAGER, Kube, KubeError, now_utc
from controller.api.workqueue import WorkQueue
from controller.node import orphans
from controller.node.capture import Volumes
from controller.node.inuse import Usage, scan_usage
from controller.node.reaper import Held, Hooks, Outcome, Reaper, Refused, Renamed, Target
from controller.node.store import Root, Tombstone
from controller.observe import logs, metrics
from controller.rules import contracts as c
from controller.rules import objects
from controller.rules.contracts import FINALIZER, MountCheck, Phase, Reason
from controller.rules.objects import Obj, finalizers

log = logging.getLogger("sandkeep.agent")
T = TypeVar("T")
K = TypeVar("K")


class Agent:
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
        self.loop: asyncio.AbstractEventLoop | None = None
        # A delete's Deleting report, waiting (a timer) or under way (its apply), until its outcome is said.
        self.deleting: dict[Key, asyncio.TimerHandle | asyncio.Future[Any]] = {}
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

    def healthy(self) -> bool:
        """Live while passes keep completing: a wedged loop (or a pass stuck on a hung mount) fails /healthz."""
        budget = max(3 * self.s.scan_interval.total_seconds(), 300.0)
        last = self.last_pass if self.last_pass is not None else self.started
        watching_ok = self.watching is None or not self.watching.done()  # a dead watch leaves the cache stale
        return watching_ok and time.monotonic() - last < budget

    # --- the watch and the queue -----------------------------------------------------------------------

    def _size_changed(self, key: Key) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.queue.add, key)

    def _listed(self, seen: set[Key]) -> None:
        """A listing of this node's objects is complete, so a pass may adopt: what the cache holds beyond
        it was deleted while the watch was down (a relist after 410 Gone) and is forgotten."""
        for key, obj in list(self.state.objects.items()):
            if key not in seen:
                self.state.forget(obj)
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

    def _later(self, key: Key) -> float:
        """Process `key` again after its backoff (doubling while it stays held or failing; every pass
        processes it too); one pending retry per object, however often it is asked for."""
        return self.queue.add_rate_limited(key)

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
        listed = await asyncio.to_thread(self._pods)
        pods = self._pod_paths(listed) or []  # a deletion asks again, and holds without them
        held, unknown = await asyncio.to_thread(self.volumes.reopened)
        usage = await asyncio.to_thread(scan_usage, keys, pods, Path("/proc"), self.ignore, held, unknown)
        self.m.inuse_scans.labels(self.s.node).inc()
        self.state.usage = await asyncio.to_thread(discount_orphans, usage, keys, orphans.orphan_pids)
        refused = await self.adopter.adopt(scan.sandboxes)
        self.sizer.request(keys)
        self._prune(set(keys))
        await self.process_many(list(self.state.objects))
        await self.verify_sessions(listed)
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

    async def _each(self, keys: list[Key], fn: Callable[[Key], Awaitable[None]], limit: int = PARALLEL) -> None:
        """Run `fn` for every key, at most `limit` at a time: API latency, not CPU, bounds a pass over
        thousands of objects. Keys are distinct, so no object is ever worked on twice at once. A stop
        request ends the pass early: every step is idempotent, so the next agent picks up the rest."""
        gate = asyncio.Semaphore(limit)

        async def one(key: Key) -> None:
            async with gate:
                if not self.stopping.is_set():
                    await fn(key)

        await asyncio.gather(*(one(k) for k in keys))

    def _pods(self) -> list[Obj] | None:
        """The Pods on this node. None: unlisted."""
        try:
            pods = self.kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={self.s.node}"})
        except KubeError as err:
            # Without the Pod list a mount cannot be ruled out: holds come from /proc alone this pass.
            self.report.say_limited("pods", "pods_unlisted", reason=Reason.IN_USE_UNKNOWN, error=str(err)[:200])
            return None
        items: list[Obj] = pods.get("items", [])
        return items

    @staticmethod
    def _pod_paths(pods: list[Obj] | None) -> list[tuple[str, Path]] | None:
        """hostPath volumes of these Pods (this node's): a Pod that mounts a sandbox uses it. None: unlisted."""
        if pods is None:
            return None
        out = []
        for pod in pods:
            meta = pod.get("metadata", {})
            for vol in (pod.get("spec") or {}).get("volumes") or []:
                hp = (vol.get("hostPath") or {}).get("path")
                if hp:
                    out.append((f"{meta.get('namespace')}/{meta.get('name')}", Path(hp)))
        return out

    async def verify_sessions(self, pods: list[Obj] | None, keys: Iterable[Key] | None = None) -> None:
        """Write `status.sessions` of these sandboxes (all: None) from the session Pods on this node."""
        if pods is None or not self.s.sessions_namespace:
            return
        by_uid = sessions.session_pods(pods, self.s.sessions_namespace)
        if by_uid and sessions.own_cgroup(Path("/proc")) is None:  # every answer stays Unknown: say why
            self.report.say_limited(
                "cgroups",
                "session_cgroups_unknown",
                reason=Reason.CGROUPS_UNKNOWN,
                action="the agent's own /proc/self/cgroup names no v1 memory or v2 path: run it as the chart does",
            )
        for key in list(self.state.objects) if keys is None else keys:
            obj = self.state.objects.get(key)
            if obj is None or objects.is_deleting(obj):
                continue
            current = (obj.get("status") or {}).get("sessions") or []
            mine = by_uid.get(obj["metadata"]["uid"], [])
            if not mine and not current:
                continue
            known = {e.get("podUID"): e for e in current}
            proc, root = Path("/proc"), Path(self.root.path)
            found = await asyncio.to_thread(sessions.entries, obj, mine, root, proc, now_utc(), known)
            if found == current:
                continue
            manager = AGENT_MANAGER + sessions.SESSIONS_MANAGER_SUFFIX
            updated = await asyncio.to_thread(self.kube.apply_status, obj, {"sessions": found}, manager)
            self.state.remember(updated)
            for entry in found:
                if known.get(entry["podUID"], {}).get("mount") != entry["mount"]:
                    level, reason = sessions.MOUNT_LOG[MountCheck(entry["mount"])]
                    logs.say(
                        log,
                        "session_mount_checked",
                        level=level,
                        reason=reason,
                        object="/".join(key),
                        pod=entry["pod"],
                        mount=entry["mount"],
                    )

    def _unverified(self, keys: list[Key]) -> list[Key]:
        """The keys whose sandbox the controller asked to verify a session Pod of, not yet settled."""
        out = []
        for key in keys:
            obj = self.state.objects.get(key)
            asked = objects.annotations_of(obj or {}).get(c.ANN_VERIFY_SESSION)
            if obj is None or not asked:
                continue
            settled = {
                e.get("podUID")
                for e in (obj.get("status") or {}).get("sessions") or []
                if e.get("mount") != MountCheck.UNKNOWN
            }
            if asked not in settled:
                out.append(key)
        return out

    # --- one object ------------------------------------------------------------------------------------

    async def process(self, key: Key) -> None:
        """Do what `decide.next_step` says this object needs next."""
        await self.process_many([key], raising=True)

    async def process_many(self, keys: list[Key], *, raising: bool = False) -> None:
        """Process `keys` (distinct), at most PARALLEL at a time; those whose next step is to reap go through
        the pipeline's looks together, so a wave of deletions shares one /proc pass instead of one each.
        A failed key is retried with backoff and said (`raising`: the error is raised instead)."""
        steps: dict[Key, tuple[Obj, Tombstone | None, Step]] = {}
        if asked := self._unverified(keys):
            await self.verify_sessions(await asyncio.to_thread(self._pods), asked)

        async def look(key: Key) -> None:
            obj = self.state.objects.get(key)
            if obj is None:
                return
            uid = obj["metadata"]["uid"]
            tomb = await asyncio.to_thread(self._tombstone_of, uid) if objects.is_deleting(obj) else None
            steps[key] = (obj, tomb, next_step(observe(obj, self.s.node, tomb is not None)))

        async def act(key: Key) -> None:
            await self._act(key, *steps[key])

        guarded = functools.partial(self._guarded, raising)
        await self._each(keys, functools.partial(guarded, look))
        reaps = [k for k, (_obj, _tomb, step) in steps.items() if step is Step.REAP]
        await self._each([k for k in steps if k not in reaps], functools.partial(guarded, act))
        if reaps:
            await self._reap({k: steps[k][0] for k in reaps}, raising)

    async def _guarded(self, raising: bool, fn: Callable[[Any], Awaitable[None]], arg: Any) -> None:
        try:
            await fn(arg)
        except Exception as err:  # retried with backoff: a warning per attempt, further apart each time
            if raising:
                raise
            for key in arg if isinstance(arg, list) else [arg]:
                delay = self._later(key)
                logs.say(
                    log,
                    "process_failed",
                    level=logging.WARNING,
                    reason=Reason.AGENT_ERROR,
                    object="/".join(key),
                    error=repr(err)[:500],
                    retry_in=f"{delay:.1f}s",
                )

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

    async def _reap(self, objs: dict[Key, Obj], raising: bool) -> None:
        """Take these objects' sandboxes through the pipeline: the looks and renames of all of them in one
        reap thread (one /proc pass, asked again once its answer is older than `fresh_for`), then each
        tombstone's read-back and delete in the reap threads, PARALLEL at a time."""
        keys = list(objs)
        uids = {k: o["metadata"]["uid"] for k, o in objs.items()}
        targets = [Target(*k, uids[k], claim_of(objs[k]), self.relief.cause_of(uids[k])) for k in keys]
        prepared: dict[Key, Held | Refused | Renamed] = {}

        async def prepare(_keys: list[Key]) -> None:
            prepared.update(zip(keys, await self._pipeline(self.reaper.prepare, targets), strict=True))

        async def finish(key: Key) -> None:
            step = prepared[key]
            outcome = await self._pipeline(self.reaper.finish, step) if isinstance(step, Renamed) else step
            await self._after(objs[key], key, None, outcome)

        await self._guarded(raising, prepare, keys)  # failed: every key retried with backoff
        await self._each(list(prepared), functools.partial(self._guarded, raising, finish))

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

    # --- deletion: the shared pipeline, run in the reap threads ------------------------------------------

    def _tombstone_of(self, uid: str) -> Tombstone | None:
        return next((t for t in self.root.tombstones() if t.id == uid), None)

    async def _pipeline(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a pipeline step in the reap threads: the loop keeps serving the watch and the heartbeat."""
        return await asyncio.get_running_loop().run_in_executor(self.reap_pool, functools.partial(fn, *args))

    async def clear_tombstones(self) -> None:
        """Every tombstone in the root, before anything else in a pass: finished, put back or cleared as
        `decide.fate` says (a young one of another live process is left to it)."""
        by_uid = {o["metadata"]["uid"]: o for o in self.state.objects.values()}
        for tomb in await asyncio.to_thread(self.root.tombstones):
            obj = by_uid.get(tomb.id)
            outcome = await self._pipeline(self.reaper.leftover, tomb, lambda _read, o=obj: fate(o))
            await self._after(obj, objects.key_of(obj) if obj is not None else None, tomb.name, outcome)

    async def _after(self, obj: Obj | None, key: Key | None, tombstone: str | None, outcome: Outcome) -> None:
        report = self.deleting.pop(key, None) if key is not None else None
        if isinstance(report, asyncio.TimerHandle):
            report.cancel()  # done before it was worth saying
        elif report is not None:
            with contextlib.suppress(Exception):  # said (or not) in `_say_deleting`: the outcome goes on
                await report  # the finalizer's removal is then guarded by the version the report wrote
            obj = self.state.objects.get(key, obj) if key is not None else obj
        after = await self.report.outcome(obj, tombstone, outcome)
        if after is After.FINISH and obj is not None:
            await self._finish(self.state.newest(obj), tombstone)
        elif after is After.RETRY and key is not None:
            self._later(key)

    def _in_use_indexed(self, paths: Mapping[int, Path]) -> dict[int, Usage]:
        """The pipeline's in-use check for many at once (`Reaper.prepare`, `reap_unadoptable`): one
        `_usage_of`, each answer by index (a quarantined entry's path need not be a sandbox's); a sandbox's
        answer is also kept for its status."""
        found = self._usage_of(paths)
        for i, p in paths.items():
            if p.parent.parent == self.root.path:
                self.state.usage[(p.parent.name, p.name)] = found[i]
        return found

    def _in_use_batch(self, paths: dict[Key, Path]) -> dict[Key, Usage]:
        """`_usage_of` for sandboxes, each answer kept for its status."""
        found = self._usage_of(paths)
        self.state.usage.update(found)
        return found

    def _usage_of(self, paths: Mapping[K, Path]) -> dict[K, Usage]:
        """Whether anything uses each of `paths`, from one Pod list and one /proc pass for all of them.

        No Pod list, no way to rule out a Pod that mounts one: unknown, which holds.
        """
        pods = self._pod_paths(self._pods())
        held, unknown = self.volumes.reopened()  # a Pod's reopen volume holds its sandbox (capture.py)
        found = scan_usage(paths, pods or [], Path("/proc"), self.ignore, held, unknown)
        self.m.inuse_scans.labels(self.s.node).inc()
        for key, usage in found.items():
            if pods is None and not usage.in_use:
                found[key] = Usage(None, ("the Pods on this node could not be listed",), Reason.IN_USE_UNKNOWN)
        return found

    def _after_rename(self, key: Key, tomb: Tombstone | None) -> None:
        if os.environ.get(SEAM_KILL_AFTER_RENAME):
            os.kill(os.getpid(), signal.SIGKILL)

    def _before_delete(self, key: Key, tomb: Tombstone | None) -> None:
        """From the reap thread, right before a tombstone's delete: report Deleting (and the tombstone's name)
        if the delete is still running DELETING_AFTER later. Most deletes are over by then, and a status
        nobody could read before the object goes is one request per deletion saved (a node's mass expiry
        at the agent's 20 QPS went from two requests per deletion to one). A stuck tombstone keeps its
        Stuck status meanwhile, so the phase does not flap."""
        seam = os.environ.get(SEAM_KILL_DURING_DELETE)
        if seam:
            threading.Timer(float(seam), os.kill, (os.getpid(), signal.SIGKILL)).start()
        obj = self.state.objects.get(key)
        if obj is None or tomb is None or self.loop is None or not objects.is_deleting(obj):
            return
        status = obj.get("status") or {}
        if tomb.name in self.reaper.stuck or (
            status.get("phase") == str(Phase.STUCK) and status.get("tombstone") == tomb.name
        ):
            return
        self.loop.call_soon_threadsafe(self._deleting_later, key, tomb.name)

    def _deleting_later(self, key: Key, tombstone: str) -> None:
        assert self.loop is not None
        self.deleting[key] = self.loop.call_later(DELETING_AFTER, self._say_deleting, key, tombstone)

    def _say_deleting(self, key: Key, tombstone: str) -> None:
        """The delete is still running: its Deleting status, applied while it goes on."""
        obj = self.state.objects.get(key)
        if obj is None or not objects.is_deleting(obj):
            self.deleting.pop(key, None)
            return
        deleting = self.report.deleting_status(obj, Phase.DELETING, tombstone=tombstone)

        async def say() -> None:
            try:
                await self.report.apply(obj, deleting, deleting=True)
            except Exception as err:  # a report that failed never stops a deletion
                self.report.say_limited(
                    f"report:{key}", "status_failed", reason=Reason.AGENT_ERROR, error=repr(err)[:300]
                )

        self.deleting[key] = asyncio.ensure_future(say())

    async def _finish(self, obj: Obj, tombstone: str | None) -> None:
        """Remove the finalizer, guarded by resourceVersion; on a conflict read fresh and try again."""
        key = objects.key_of(obj)
        for _ in range(5):
            if FINALIZER not in finalizers(obj):
                return
            try:
                released = await asyncio.to_thread(self.kube.remove_finalizer, obj)
            except KubeError as err:
                if err.not_found:
                    return
                if not err.conflict:
                    raise
                fresh = await asyncio.to_thread(self.kube.get_sandbox, *key)
                if fresh is None or fresh["metadata"]["uid"] != obj["metadata"]["uid"]:
                    return
                obj = fresh
                continue
            logs.say(log, "finalizer_removed", reason=Reason.DELETED, object=f"{key[0]}/{key[1]}", tombstone=tombstone)
            if not finalizers(released):
                # Deleted by this patch. Forgotten now, before the watch's DELETED arrives: a ghost in the
                # cache would stop a new run retained under the same name from being adopted meanwhile.
                self.state.forget(released)
            self.queue.forget(key)
            return
        self._later(key)

    # --- the heartbeat ---------------------------------------------------------------------------------

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        """Renew the heartbeat Lease every HEARTBEAT_EVERY while passes keep completing (`healthy`).

        Apart from the passes, so a long first pass (adopting a full root) does not look like a dead
        agent; tied to `healthy`, so a wedged agent does stop reporting.
        """
        while not stop.is_set():
            if self.healthy():
                await self._heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=HEARTBEAT_EVERY)

    async def _heartbeat(self) -> None:
        """Renew this node's Lease; publish, for `doctor`, the stuck tombstones no object owns, the disk
        pressure nothing can relieve and the quarantined entries, when they change."""
        try:
            await asyncio.to_thread(leases.renew_heartbeat, self.kube, self.s.namespace, self.s.node, self.identity)
            said = {
                c.ANN_ORPHAN_TOMBSTONES: json.dumps(orphan_report(self.reaper), sort_keys=True),
                c.ANN_PRESSURE: self.relief.published,
                c.ANN_QUARANTINE: self.quarantine.published,
            }
            report = json.dumps(said, sort_keys=True)
            if report != self.last_published:
                patch = {"metadata": {"annotations": said}}
                await asyncio.to_thread(
                    self.kube.request,
                    "PATCH",
                    leases.lease_path(self.s.namespace, leases.heartbeat_name(self.s.node)),
                    body=patch,
                    content_type="application/merge-patch+json",
                )
                self.last_published = report
            self.m.heartbeat.labels(self.s.node).set(time.time())
        except KubeError as err:
            self.report.say_limited("heartbeat", "heartbeat_failed", reason=Reason.AGENT_STALE, error=str(err)[:300])


async def _first(*events: asyncio.Event) -> None:
    """Wait until one of `events` is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
