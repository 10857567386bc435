"""The Agent's deletions: the shared pipeline (`controller/node/reaper.py`) run in the agent's own reap threads,
its in-use looks (one Pod list and one /proc pass for many), what an outcome leads to, and the finalizer
removed once a sandbox is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from controller.agent.base import AgentBase
from controller.agent.decide import Key, claim_of, fate
from controller.agent.report import After
from controller.agent.settings import DELETING_AFTER, SEAM_KILL_AFTER_RENAME, SEAM_KILL_DURING_DELETE
from controller.api.kube import KubeError
from controller.node.inuse import Usage, scan_usage
from controller.node.reaper import Held, Outcome, Refused, Renamed, Target
from controller.node.store import Tombstone
from controller.observe import logs
from controller.rules import objects
from controller.rules.contracts import FINALIZER, Phase, Reason
from controller.rules.objects import Obj, finalizers

log = logging.getLogger("sandkeep.agent")
T = TypeVar("T")
K = TypeVar("K")


class Deletion(AgentBase):
    """Taking objects' sandboxes through the deletion pipeline, and what follows each outcome."""

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
