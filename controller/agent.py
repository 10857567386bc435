"""`sandkeep agent`: the node agent. Observes one node's root, adopts retained directories, and deletes
a sandbox's directory behind the `sandkeep.io/disk` finalizer when its object is deleted.

One asyncio loop, one worker: every object is processed level-triggered (`process(key)` may run any
number of times and always moves the object one safe step closer to what its state asks). Blocking
work (the API, /proc, the disk) runs in threads; the object cache is fed by a LIST+WATCH thread that
uses the server-side field selector `spec.nodeName=<node>`, so the agent never sees another node's
objects. Sizes are measured by a background thread and never block a pass.

Deletion is the shared pipeline of `controller/reaper.py` (the standalone sweep runs the same one), run in
the agent's reap threads; this module only says what a tombstone is for (`_fate`) and reports each outcome
(`_report`: status, Events, metrics, log lines), then removes the finalizer (a JSON patch guarded by
resourceVersion) when the directory is gone or is not this object's. Leftover tombstones are cleared at the
start of every pass, before anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno as E
import functools
import json
import logging
import os
import queue
import signal
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from controller import commands, kube, leases, logs, metrics
from controller import contracts as c
from controller.contracts import FINALIZER, Condition, Phase, Reason
from controller.inuse import Usage, scan_usage, uninspectable_pids
from controller.kube import AGENT_MANAGER, Kube, KubeError, Obj
from controller.models import Settings, _duration
from controller.reaper import (
    Claim,
    Clear,
    Deleted,
    Fate,
    Finish,
    Held,
    Hooks,
    Keep,
    Outcome,
    Reaper,
    Refused,
    Restored,
    Stuck,
    Target,
)
from controller.store import Mismatch, Present, Root, RootRefused, Tombstone, Transient
from controller.workqueue import WorkQueue

log = logging.getLogger("sandkeep.agent")

Key = tuple[str, str]
OWNED_CONDITIONS = (Condition.DISK_PRESENT, Condition.IN_USE, Condition.TOMBSTONE_STUCK, Condition.ORPHANS_SURVIVED)
OWNED_FIELDS = ("sizeBytes", "fileCount", "inUse", "heldBy", "tombstone")
ORPHANS_ANNOTATION = c.ANN_ORPHAN_TOMBSTONES
HEARTBEAT_EVERY = 15.0  # seconds between heartbeat renewals (the Lease says 60 s)
PARALLEL = 8  # API requests in flight at once during a pass

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
    scan_interval: timedelta = timedelta(seconds=30)
    stuck_after: timedelta = timedelta(minutes=10)
    relog_every: timedelta = timedelta(hours=24)
    orphan_timeout: timedelta = timedelta(seconds=10)
    lock_wait: timedelta = timedelta(0)  # 0: wait for the root lock forever
    ignore_pids: list[int] = Field(
        default_factory=list
    )  # processes vouched for that the agent cannot inspect (e.g. a runtime's init)

    @field_validator("scan_interval", "stuck_after", "relog_every", "orphan_timeout", "lock_wait", mode="before")
    @classmethod
    def _agent_durations(cls, v: Any) -> timedelta:
        return _duration(v)


# --- small pure helpers ----------------------------------------------------------------------------------


def _key(obj: Obj) -> Key:
    return kube.key_of(obj)


def _slim(obj: Obj) -> Obj:
    """Drop managedFields from a cached object: the agent never reads them, and with two status managers
    they are most of an object's size (10,000 cached objects is the memory budget's main item)."""
    obj.get("metadata", {}).pop("managedFields", None)
    return obj


def _finalizers(obj: Obj) -> list[str]:
    return list(obj.get("metadata", {}).get("finalizers") or [])


def _strip(cond: Obj) -> Obj:
    return {k: v for k, v in cond.items() if k != "lastTransitionTime"}


def owned_view(status: Obj) -> Obj:
    """The part of a status this agent owns, in a comparable shape (condition times left out)."""
    view: Obj = {k: status[k] for k in OWNED_FIELDS if k in status}
    if status.get("phase") is not None:
        view["phase"] = status["phase"]
    conds = {cd["type"]: _strip(cd) for cd in status.get("conditions") or [] if cd.get("type") in OWNED_CONDITIONS}
    view["conditions"] = conds
    return view


def status_changed(obj: Obj, desired: Obj, *, deleting: bool) -> bool:
    """Whether applying `desired` would change anything the agent owns (phase only counts while deleting)."""
    have = owned_view(obj.get("status") or {})
    want = owned_view(desired)
    if not deleting:
        have.pop("phase", None)
        want.pop("phase", None)
    return have != want


def _errno_name(code: int | None) -> str:
    return E.errorcode.get(code or 0, str(code))


def stuck_message(sandbox: str, node: str, tombstone: str, errno: int | None, path: str | None) -> str:
    """The TombstoneStuck condition's words (`doctor` reads the errno and path back from them)."""
    return (
        f"sandbox {sandbox} on node {node}: tombstone {tombstone} could not be deleted: "
        f"{_errno_name(errno)} at {path}. Retried every pass; fix the cause "
        "(e.g. `chattr -i`, a mount, a file owned by another account) and it goes."
    )


def claim_of(obj: Obj) -> Claim:
    """What deleting this object asks for: the run it describes (createdAt, jobId), never another one.

    A job retained again under the same name is another run, which deleting this object must not delete.
    """
    spec = obj.get("spec") or {}
    return Claim(created_at=kube.sandbox_facts(obj).created_at, job_id=spec.get("jobId") or None)


def discount_orphans(usage: Mapping[Key, Usage], paths: Mapping[Key, Path]) -> dict[Key, Usage]:
    """The pass's answers, with a sandbox used only by its own recorded orphans reported as not in use.

    Orphans (what a killed `sandkeep exec` left running) are debris: they are SIGKILLed on the way to
    deletion, before the in-use check right before the rename. Counting them as users would hold an
    expired sandbox forever, since only a deletion reaps them. Any other holder (a live command, a
    process nobody recorded, a Pod, a mount, a process that cannot be inspected) keeps it in use.
    Reads the records only for sandboxes held by processes alone; signals nothing.
    """
    out = dict(usage)
    for key, answer in usage.items():
        if answer.in_use is True and answer.only_pids and answer.held_only_by(commands.orphan_pids(paths[key])):
            out[key] = orphans_pending(answer.pids)
    return out


def orphans_pending(pids: frozenset[int]) -> Usage:
    """Not in use; heldBy and the InUse condition say which orphans a deletion will reap first."""
    listed = ",".join(str(p) for p in sorted(pids))
    why = (
        f"only orphans of a killed `sandkeep exec` use it: pids {listed}, "
        "which are killed (SIGKILL) before the sandbox is deleted"
    )
    return Usage(False, (why,), Reason.ORPHANS_PENDING, pids)


def measure(root: Root, namespace: str, name: str) -> tuple[int, int]:
    """(allocated bytes, files) under a sandbox, walked fd-relative without following links or mounts."""
    total = files = 0
    try:
        top = root.sandbox_path(namespace, name)
        st = os.lstat(top)
    except (OSError, ValueError):
        return 0, 0
    if not stat.S_ISDIR(st.st_mode):
        return 0, 0
    for _dirpath, dirnames, filenames, dirfd in os.fwalk(top, follow_symlinks=False):
        keep = []
        for d in dirnames:
            with contextlib.suppress(OSError):
                dst = os.stat(d, dir_fd=dirfd, follow_symlinks=False)
                total += dst.st_blocks * 512
                if dst.st_dev == st.st_dev:
                    keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            with contextlib.suppress(OSError):
                total += os.stat(f, dir_fd=dirfd, follow_symlinks=False).st_blocks * 512
                files += 1
    return total + st.st_blocks * 512, files


# --- the watch -------------------------------------------------------------------------------------------


class Watcher(threading.Thread):
    """LIST then WATCH this node's RetainedSandboxes, resuming from the last resourceVersion; a 410 re-lists.

    Every event lands on the loop as ("reset", items) or (type, object); the agent's cache is the
    result. The field selector is applied by the API server, so other nodes' objects never arrive.
    """

    def __init__(
        self, client: Kube, node: str, deliver: Callable[[str, Any], None], resource_version: str | None = None
    ) -> None:
        super().__init__(name="watch", daemon=True)
        self.client = client
        self.node = node
        self.deliver = deliver
        self.resource_version = resource_version  # where to resume; None lists first
        self.stopping = threading.Event()

    def run(self) -> None:
        from kubernetes import client as k8s
        from kubernetes import watch

        api = k8s.CustomObjectsApi(self.client.api)
        selector = f"spec.nodeName={self.node}"
        rv = self.resource_version
        failures = 0
        while not self.stopping.is_set():
            try:
                if rv is None:
                    listed = self.client.request(
                        "GET", kube.sandbox_path(), query={"fieldSelector": selector}, timeout=60
                    )
                    rv = listed["metadata"]["resourceVersion"]
                    self.deliver("reset", listed.get("items", []))
                w = watch.Watch()  # type: ignore[no-untyped-call]
                for event in w.stream(  # type: ignore[no-untyped-call]
                    api.list_cluster_custom_object,
                    c.GROUP,
                    c.VERSION,
                    c.SANDBOX_PLURAL,
                    field_selector=selector,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=60,
                ):
                    if self.stopping.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
                        break
                    obj = event["object"]
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.deliver(event["type"], obj)
                failures = 0
            except Exception as err:
                status = getattr(err, "status", None)
                if status == 410:
                    logs.say(log, "watch_expired", reason=Reason.AGENT_STALE, resource_version=rv, action="re-listing")
                    rv = None  # too old (etcd compacted it): list again
                    continue
                # A watch the server or a proxy closed is routine: resume quietly; say it when it keeps failing.
                failures += 1
                level = logging.WARNING if failures > 1 else logging.DEBUG
                logs.say(log, "watch_failed", level=level, reason=Reason.AGENT_STALE, error=str(err)[:300])
                if status in (401, 403):
                    rv = None
                self.stopping.wait(min(2.0 * failures, 30.0) if failures > 1 else 0.2)


# --- sizes -----------------------------------------------------------------------------------------------


class Sizer(threading.Thread):
    """Measures sandbox sizes off the loop; tells the loop when a size changed."""

    def __init__(self, root: Root, changed: Callable[[Key], None]) -> None:
        super().__init__(name="sizes", daemon=True)
        self.root = root
        self.changed = changed
        self.sizes: dict[Key, tuple[int, int]] = {}
        self.todo: queue.Queue[Key | None] = queue.Queue()  # None: stop
        self.pending: set[Key] = set()
        self.lock = threading.Lock()

    def request(self, keys: Iterable[Key]) -> None:
        with self.lock:
            for k in keys:
                if k not in self.pending:
                    self.pending.add(k)
                    self.todo.put(k)

    def stop(self) -> None:
        self.todo.put(None)

    def run(self) -> None:
        while True:
            key = self.todo.get()
            if key is None:
                return
            with self.lock:
                self.pending.discard(key)
            size = measure(self.root, *key)
            if self.sizes.get(key) != size:
                self.sizes[key] = size
                self.changed(key)


# --- the agent -------------------------------------------------------------------------------------------


@dataclass
class AgentState:
    objects: dict[Key, Obj] = field(default_factory=dict)
    usage: dict[Key, Usage] = field(default_factory=dict)
    present: set[Key] = field(default_factory=set)
    said: dict[str, tuple[float, str]] = field(default_factory=dict)  # rate-limited lines: subject -> (when, what)
    events: dict[tuple[str, str], str] = field(default_factory=dict)  # (uid, reason) -> message posted
    synced: bool = False


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        client: Kube,
        root: Root,
        agent_metrics: metrics.AgentMetrics,
        *,
        kill: commands.Kill = os.kill,
    ) -> None:
        self.s = settings
        self.kube = client
        self.root = root
        self.m = agent_metrics
        self.kill = kill
        self.state = AgentState()
        self.queue: WorkQueue[Key] = WorkQueue()  # a held or failed key comes back with per-key backoff
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sizer = Sizer(root, self._size_changed)
        self.identity = leases.default_identity()
        self.ignore = {os.getpid(), *settings.ignore_pids}
        self.last_orphans_published: str | None = None
        self.stopping = asyncio.Event()
        self.started = time.monotonic()
        self.last_pass: float | None = None
        self.reaper = Reaper(
            root,
            self._in_use_now,
            stuck_after=settings.stuck_after,
            orphan_timeout=settings.orphan_timeout,
            kill=kill,
            hooks=Hooks(after_rename=self._after_rename, before_delete=self._before_delete),
        )
        # The pipeline's own threads: a reap may wait on the loop (before_delete reports Deleting), whose
        # API calls use the default executor, so the two never wait on each other.
        self.reap_pool = ThreadPoolExecutor(PARALLEL, "reap")

    def healthy(self) -> bool:
        """Live while passes keep completing: a wedged loop (or a pass stuck on a hung mount) fails /healthz."""
        budget = max(3 * self.s.scan_interval.total_seconds(), 300.0)
        last = self.last_pass if self.last_pass is not None else self.started
        return time.monotonic() - last < budget

    # --- plumbing --------------------------------------------------------------------------------------

    def _size_changed(self, key: Key) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.queue.add, key)

    def _deliver(self, kind: str, payload: Any) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._on_event, kind, payload)

    def _on_event(self, kind: str, payload: Any) -> None:
        if kind == "reset":
            self.state.objects = {_key(o): _slim(o) for o in payload if self._mine(o)}
            self.state.synced = True
            for key in self.state.objects:
                self.queue.add(key)
            return
        obj: Obj = payload
        if not self._mine(obj):
            return
        key = _key(obj)
        if kind == "DELETED":
            self.state.objects.pop(key, None)
            self.queue.drop(key)
            return
        self._remember(obj)
        self.queue.add(key)

    def _remember(self, obj: Obj) -> None:
        """Keep the newest version of an object (a watch event can arrive after our own write's answer)."""
        _slim(obj)
        key = _key(obj)
        old = self.state.objects.get(key)
        new_rv = int(obj["metadata"].get("resourceVersion") or 0)
        same_object = old is not None and old["metadata"].get("uid") == obj["metadata"].get("uid")
        if same_object and old is not None and int(old["metadata"].get("resourceVersion") or 0) > new_rv:
            return
        self.state.objects[key] = obj

    def _mine(self, obj: Obj) -> bool:
        return (obj.get("spec") or {}).get("nodeName") == self.s.node

    def _later(self, key: Key) -> float:
        """Process `key` again after its backoff (doubling while it stays held or failing; every pass
        processes it too); one pending retry per object, however often it is asked for."""
        return self.queue.add_rate_limited(key)

    def _say_limited(self, subject: str, event: str, level: int = logging.WARNING, **kv: Any) -> None:
        """Log `event` about `subject` when first seen and then at most once per relog period; a subject
        whose event or reason changes (adoption failed, then its namespace went missing) is news at once."""
        now, what = time.monotonic(), f"{event} {kv.get('reason')}"
        last = self.state.said.get(subject)
        if last is not None and last[1] == what and now - last[0] < self.s.relog_every.total_seconds():
            return
        self.state.said[subject] = (now, what)
        logs.say(log, event, level=level, **kv)

    async def _api(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _event(self, obj: Obj, reason: Reason, message: str, type_: str = "Normal") -> None:
        """Post an Event once per (object, reason, message): a retry is not news."""
        uid = obj["metadata"].get("uid", "")
        if self.state.events.get((uid, str(reason))) == message:
            return
        self.state.events[(uid, str(reason))] = message
        await self._api(self.kube.post_event, obj, reason, message, type_, "sandkeep-agent")

    # --- run -------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = stop
        self.sizer.start()
        watcher = Watcher(self.kube, self.s.node, self._deliver)
        watcher.start()
        interval = self.s.scan_interval.total_seconds()
        beat = asyncio.create_task(self._heartbeat_loop(stop))
        try:
            while not self.state.synced and not stop.is_set():
                await asyncio.sleep(0.05)
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self.full_pass()
                except Exception as err:
                    logs.say(log, "pass_failed", level=logging.ERROR, reason=Reason.AGENT_ERROR, error=repr(err)[:500])
                await self._drain(stop, started + interval)
        finally:
            watcher.stopping.set()
            self.sizer.stop()
            beat.cancel()
            self.reap_pool.shutdown(wait=False)

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

    async def _drain(self, stop: asyncio.Event, until: float) -> None:
        """Process queued objects until the next pass is due."""
        while not stop.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                key = await asyncio.wait_for(self.queue.get(), timeout=min(left, 0.5))
            except TimeoutError:
                continue
            try:
                await self._process_logged(key)
            finally:
                self.queue.done(key)

    # --- one pass --------------------------------------------------------------------------------------

    async def full_pass(self) -> None:
        """Leftover tombstones first; then the disk scan, in-use, adoption, every object, metrics, heartbeat."""
        self.reaper.begin_pass()
        await self.clear_tombstones()
        t0 = time.monotonic()
        scan = await asyncio.to_thread(self.root.scan)
        self.m.scan_duration.labels(self.s.node).observe(time.monotonic() - t0)
        keys = {(e.namespace, e.name): e.path for e in scan.sandboxes}
        self.state.present = set(keys)
        pods = await self._pod_paths() or []  # for reporting; a deletion asks again and holds without an answer
        usage = await asyncio.to_thread(scan_usage, keys, pods, Path("/proc"), self.ignore)
        self.state.usage = await asyncio.to_thread(discount_orphans, usage, keys)
        refused = await self.adopt(scan.sandboxes)
        self.sizer.request(keys)
        self._prune(set(keys))
        await self._each(list(self.state.objects), self._process_logged)
        self._report_strays(scan.strays, refused)
        self._update_metrics(scan.tombstones)
        await self._heartbeat()
        self.last_pass = time.monotonic()

    def _prune(self, present: set[Key]) -> None:
        """Forget what belongs to sandboxes and objects that are gone, so a churning node's agent stays small."""
        for key in list(self.sizer.sizes):  # list(): one C-level copy, safe beside the sizer thread
            if key not in present:
                self.sizer.sizes.pop(key, None)
        uids = {o["metadata"].get("uid") for o in self.state.objects.values()}
        for event_key in [k for k in self.state.events if k[0] not in uids]:
            self.state.events.pop(event_key, None)
        horizon = time.monotonic() - self.s.relog_every.total_seconds()
        for subject in [k for k, (t, _) in self.state.said.items() if t < horizon]:
            self.state.said.pop(subject, None)

    async def _process_logged(self, key: Key) -> None:
        try:
            await self.process(key)
        except Exception as err:  # retried with backoff: a warning per attempt, further apart each time
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

    async def _each(self, keys: list[Key], fn: Callable[[Key], Any], limit: int = PARALLEL) -> None:
        """Run `fn` for every key, at most `limit` at a time: API latency, not CPU, bounds a pass over
        thousands of objects. Keys are distinct, so no object is ever worked on twice at once. A stop
        request ends the pass early: every step is idempotent, so the next agent picks up the rest."""
        gate = asyncio.Semaphore(limit)

        async def one(key: Key) -> None:
            async with gate:
                if not self.stopping.is_set():
                    await fn(key)

        await asyncio.gather(*(one(k) for k in keys))

    async def _pod_paths(self) -> list[tuple[str, Path]] | None:
        return await asyncio.to_thread(self._pod_paths_now)

    def _pod_paths_now(self) -> list[tuple[str, Path]] | None:
        """hostPath volumes of the Pods on this node: a Pod that mounts a sandbox uses it. None: unlisted."""
        try:
            pods = self.kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={self.s.node}"})
        except KubeError as err:
            # Without the Pod list a mount cannot be ruled out: holds come from /proc alone this pass.
            self._say_limited("pods", "pods_unlisted", reason=Reason.IN_USE_UNKNOWN, error=str(err)[:200])
            return None
        out = []
        for pod in pods.get("items", []):
            meta = pod.get("metadata", {})
            for vol in (pod.get("spec") or {}).get("volumes") or []:
                hp = (vol.get("hostPath") or {}).get("path")
                if hp:
                    out.append((f"{meta.get('namespace')}/{meta.get('name')}", Path(hp)))
        return out

    # --- adoption --------------------------------------------------------------------------------------

    async def adopt(self, entries: Iterable[Any]) -> dict[str, int]:
        """A retained directory with a valid manifest and no object gets one, finalizer included.

        Returns the refused entries by reason (a bad, foreign or unreadable manifest, a missing
        namespace) for the invalid-entries metric; each is logged with its reason code.
        """
        refused: Counter[str] = Counter()
        namespaces: dict[str, bool] = {}
        todo: dict[Key, Present] = {}

        def refuse(key: Key, reason: Reason, path: Path, **kv: Any) -> None:
            refused[reason] += 1
            self._say_limited(f"adopt:{key}", "adoption_refused", reason=reason, path=path, **kv)

        for entry in entries:
            key = (entry.namespace, entry.name)
            if key in self.state.objects:
                continue
            read = await asyncio.to_thread(self.root.read, *key)
            if isinstance(read, Transient):
                continue
            if isinstance(read, Mismatch):
                refuse(
                    key,
                    Reason.MANIFEST_MISMATCH,
                    entry.path,
                    claims=f"{read.manifest.namespace}/{read.manifest.name}",
                    action="the manifest names another sandbox than its path; fix or remove the directory",
                )
                continue
            if not isinstance(read, Present):
                refuse(key, read.reason, entry.path)
                continue
            if entry.namespace not in namespaces:
                namespaces[entry.namespace] = await self._api(self._get_namespace, entry.namespace)
            if not namespaces[entry.namespace]:
                refuse(
                    key,
                    Reason.NAMESPACE_MISSING,
                    entry.path,
                    action=f"namespace {entry.namespace} does not exist; create it, or remove the directory",
                )
                continue
            todo[key] = read
        await self._each(list(todo), lambda key: self._create(key, todo[key]))
        return refused

    def _get_namespace(self, name: str) -> bool:
        try:
            self.kube.request("GET", f"/api/v1/namespaces/{name}")
        except KubeError as err:
            if err.not_found:
                return False
            raise
        return True

    async def _create(self, key: Key, read: Present) -> None:
        m = read.manifest
        spec: Obj = {
            "nodeName": self.s.node,
            "createdAt": m.created_at,
            "workspace": {"path": str(self.root.sandbox_path(*key) / m.workspace)},
        }
        if m.retain_until:
            spec["retainUntil"] = m.retain_until
        if m.job_id:
            spec["jobId"] = m.job_id
        body: Obj = {
            "metadata": {
                "name": key[1],
                "namespace": key[0],
                "finalizers": [FINALIZER],
                "labels": {c.LABEL_NODE: self.s.node, c.LABEL_MANAGED_BY: c.MANAGED_BY},
            },
            "spec": spec,
        }
        if m.keep_until:
            body["metadata"]["annotations"] = {c.ANN_PIN_UNTIL: m.keep_until}
            if m.pinned_at:
                body["metadata"]["annotations"][c.ANN_PINNED_AT] = m.pinned_at
        try:
            created = await self._api(self.kube.create_sandbox, key[0], body)
        except KubeError as err:
            terminating = err.status == 403 and "being terminated" in err.message
            self._say_limited(
                f"adopt:{key}",
                "adoption_failed",
                reason=Reason.CONFLICT if err.conflict else Reason.ADOPTION_FAILED,
                object=f"{key[0]}/{key[1]}",
                error=err.message[:300],
                action=(
                    f"namespace {key[0]} is being deleted: the directory is kept and retried every pass; "
                    "remove it if it is not needed"
                    if terminating
                    else "retried every pass"
                ),
            )
            return
        self._remember(created)
        logs.say(log, "adopted", reason=Reason.ADOPTED, object=f"{key[0]}/{key[1]}", uid=created["metadata"]["uid"])
        await self._event(created, Reason.ADOPTED, f"adopted {self.root.sandbox_path(*key)} on node {self.s.node}")

    # --- one object ------------------------------------------------------------------------------------

    async def process(self, key: Key) -> None:
        obj = self.state.objects.get(key)
        if obj is None or not self._mine(obj):
            return
        if kube.is_deleting(obj):
            if FINALIZER in _finalizers(obj):
                await self.delete(obj)
            return
        if FINALIZER not in _finalizers(obj):
            obj = await self._add_finalizer(obj)
            if obj is None:
                return
        self._check_spec_path(obj)
        await self._apply(obj, self.observed_status(obj))
        self.queue.forget(key)

    def _check_spec_path(self, obj: Obj) -> None:
        """spec.workspace.path is never used for disk work; one pointing elsewhere is reported, not followed."""
        key = _key(obj)
        given = ((obj.get("spec") or {}).get("workspace") or {}).get("path")
        mine = self.root.sandbox_path(*key)
        if given and not (given == str(mine) or given.startswith(f"{mine}/")):
            self._say_limited(
                f"path:{key}",
                "spec_path_refused",
                reason=Reason.PATH_OUTSIDE_ROOT,
                object=f"{key[0]}/{key[1]}",
                path=given,
                action=f"the agent only ever works on {mine}; fix spec.workspace.path",
            )

    async def _add_finalizer(self, obj: Obj) -> Obj | None:
        meta = obj["metadata"]
        ops: list[Obj] = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]}]
        if meta.get("finalizers"):
            ops.append({"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER})
        else:
            ops.append({"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]})
        try:
            updated: Obj = await self._api(
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
        self._remember(updated)
        return updated

    def _disk_condition(self, obj: Obj) -> Obj:
        path = self.root.sandbox_path(*_key(obj))
        where = f"{path} on node {self.s.node}"
        status: bool | str
        try:
            present = stat.S_ISDIR(os.lstat(path).st_mode)
            status, reason, message = (
                (True, Reason.RETAINED, where)
                if present
                else (False, Reason.LOST, f"{where}: it is not a directory (never followed)")
            )
        except FileNotFoundError:
            status, reason, message = False, Reason.LOST, f"{where}: it does not exist"
        except OSError as err:
            status, reason, message = "Unknown", Reason.MANIFEST_UNREAD, f"{path}: {os.strerror(err.errno or 0)}"
        return kube.condition(Condition.DISK_PRESENT, status, reason, message, previous=self._conditions(obj))

    @staticmethod
    def _conditions(obj: Obj) -> list[Obj]:
        return list((obj.get("status") or {}).get("conditions") or [])

    def _in_use_condition(self, obj: Obj, usage: Usage | None) -> Obj:
        prev = self._conditions(obj)
        if usage is not None and usage.in_use is False and usage.reason is not None:  # e.g. OrphansPending
            return kube.condition(Condition.IN_USE, False, usage.reason, "; ".join(usage.holders), previous=prev)
        if usage is None or usage.in_use is False:
            return kube.condition(
                Condition.IN_USE, False, Reason.RETAINED, "nothing on the node uses it", previous=prev
            )
        status: bool | str = True if usage.in_use else "Unknown"
        assert usage.reason is not None
        return kube.condition(Condition.IN_USE, status, usage.reason, "; ".join(usage.holders), previous=prev)

    def observed_status(self, obj: Obj) -> Obj:
        """What the agent reports about a live object: presence, size, use."""
        key = _key(obj)
        usage = self.state.usage.get(key)
        status: Obj = {
            "inUse": bool(usage is not None and usage.holds),
            "conditions": [self._disk_condition(obj), self._in_use_condition(obj, usage)],
        }
        if usage is not None and usage.holders:
            status["heldBy"] = list(usage.holders)
        size = self.sizer.sizes.get(key)
        if size is not None and key in self.state.present:
            status["sizeBytes"], status["fileCount"] = size
        return status

    async def _apply(self, obj: Obj, status: Obj, *, deleting: bool = False) -> Obj:
        if not status_changed(obj, status, deleting=deleting):
            return obj
        try:
            updated: Obj = await self._api(self.kube.apply_status, obj, status, AGENT_MANAGER)
        except KubeError as err:
            if err.not_found:
                return obj
            raise
        self._remember(updated)
        return updated

    # --- deletion: the shared pipeline (controller/reaper.py), reported here ------------------------------

    def _tombstone_of(self, uid: str) -> Tombstone | None:
        return next((t for t in self.root.tombstones() if t.id == uid), None)

    async def _pipeline(self, fn: Callable[..., Outcome], *args: Any) -> Outcome:
        """Run a pipeline step in the reap threads: the loop keeps serving the watch and the heartbeat."""
        return await asyncio.get_running_loop().run_in_executor(self.reap_pool, functools.partial(fn, *args))

    async def delete(self, obj: Obj) -> None:
        """One step of deleting a sandbox whose object is being deleted (idempotent, see the module doc):
        a tombstone of this object is finished; otherwise the directory goes through the whole pipeline."""
        key, uid = _key(obj), obj["metadata"]["uid"]
        tomb = await asyncio.to_thread(self._tombstone_of, uid)
        if tomb is not None:
            outcome = await self._pipeline(self.reaper.leftover, tomb, lambda _read: self._fate(obj))
        else:
            outcome = await self._pipeline(self.reaper.reap, Target(*key, uid, claim_of(obj), Reason.DELETED))
        await self._report(obj, tomb.name if tomb else None, outcome)

    async def clear_tombstones(self) -> None:
        """Every tombstone in the root, before anything else in a pass: finish, restore or clear it.

        A tombstone is named after its object's uid. Its object deleting: finish that deletion. Its
        object alive and not deleting (nothing this agent does leaves that; a hand-made rename would):
        put it back when the name is free, else hold it; never delete a sandbox still wanted. No object:
        an orphan, cleared, unless another live process made it moments ago (a retain's staging dir).
        """
        by_uid = {o["metadata"]["uid"]: o for o in self.state.objects.values()}
        for tomb in await asyncio.to_thread(self.root.tombstones):
            obj = by_uid.get(tomb.id)
            outcome = await self._pipeline(self.reaper.leftover, tomb, lambda _read, o=obj: self._fate(o))
            await self._report(obj, tomb.name, outcome)

    @staticmethod
    def _fate(obj: Obj | None) -> Fate:
        """What a tombstone of `obj` (None: of no object) is for: finish its deletion, put it back, or clear it."""
        if obj is not None and kube.is_deleting(obj) and FINALIZER in _finalizers(obj):
            return Finish(_key(obj), claim_of(obj), Reason.DELETED)
        if obj is not None and not kube.is_deleting(obj):
            return Keep(_key(obj), Reason.TOMBSTONE_PINNED)
        return Clear()

    async def _report(self, obj: Obj | None, tombstone: str | None, outcome: Outcome) -> None:
        """Turn one pipeline outcome into status, Events, metrics and log lines; finish what is finished."""
        ref = "/".join(_key(obj)) if obj is not None else None
        ours = obj is not None and kube.is_deleting(obj) and FINALIZER in _finalizers(obj)
        if isinstance(outcome, Deleted):
            self.m.deletion_duration.labels(self.s.node).observe(outcome.seconds)
            self.m.deletions.labels(self.s.node, str(outcome.reason)).inc()
            self.state.said.pop(f"stuck:{outcome.tombstone}", None)
            logs.say(
                log,
                "deleted",
                reason=outcome.reason,
                object=ref if ours else None,
                tombstone=outcome.tombstone,
                files=outcome.files,
            )
        elif isinstance(outcome, Stuck):
            if outcome.tried:
                await self._stuck(obj if ours else None, outcome)
            return
        elif isinstance(outcome, Restored):
            self._say_limited(
                f"restore:{outcome.tombstone}",
                "tombstone_restored",
                reason=outcome.reason,
                object="/".join(outcome.key),
                tombstone=outcome.tombstone,
            )
        elif isinstance(outcome, Refused) and outcome.reason != Reason.LOST and obj is not None:
            # Another run retained under this name since the object was made: not this object's to delete.
            self._say_limited(
                f"other-run:{obj['metadata']['uid']}",
                "deletion_skipped",
                reason=outcome.reason,
                object=ref,
                action="the directory holds another run; it stays on disk and is adopted as its own object",
            )
        elif isinstance(outcome, Held):
            await self._held(obj if ours else None, tombstone or outcome.tombstone, outcome)
            return
        if (
            ours
            and obj is not None
            and not (isinstance(outcome, Restored) and outcome.reason != Reason.MANIFEST_CHANGED)
        ):
            await self._finish(self._newest(obj), tombstone)

    async def _held(self, obj: Obj | None, tombstone: str | None, held: Held) -> None:
        """A deletion (or a tombstone) that waits: say why where a person looks, and try again soon."""
        if held.reason == Reason.TOMBSTONE_FOREIGN:
            self._say_limited(
                f"foreign:{tombstone}",
                "tombstone_skipped",
                level=logging.INFO,
                reason=held.reason,
                tombstone=tombstone,
                pid=held.pid,
            )
            return
        if held.tombstone is not None and held.reason != Reason.MANIFEST_UNREAD:
            self._say_limited(
                f"restore:{held.tombstone}",
                "tombstone_held",
                reason=held.reason,
                object="/".join(held.key) if held.key else None,
                tombstone=held.tombstone,
            )
            return
        if obj is None:
            return
        key = _key(obj)
        if held.survivors:
            await self._held_by_survivors(obj, held.survivors)
        elif held.usage is not None or held.reason in (Reason.IN_USE, Reason.IN_USE_UNKNOWN, Reason.POD_MOUNT):
            usage = held.usage or Usage(None, (held.error or "the in-use check failed",), Reason.IN_USE_UNKNOWN)
            await self._held_in_use(obj, usage)
        elif held.reason != Reason.MANIFEST_UNREAD:  # the rename failed: counted, said, retried
            self.m.deletion_failures.labels(self.s.node, str(held.reason)).inc()
            self._say_limited(
                f"rename:{obj['metadata']['uid']}",
                "rename_failed",
                reason=held.reason,
                object="/".join(key),
                error=held.error,
            )
            await self._apply(obj, self._deleting_status(obj, Phase.DELETING), deleting=True)
        self._later(key)  # a manifest that could not be read just now: decided again on a read that works

    async def _held_by_survivors(self, obj: Obj, survivors: tuple[commands.Survivor, ...]) -> None:
        key = _key(obj)
        where = f"sandbox {key[0]}/{key[1]} on node {self.s.node}: deletion held"
        message = commands.survivors_message(where, survivors, self.s.orphan_timeout.total_seconds())
        cond = kube.condition(
            Condition.ORPHANS_SURVIVED, True, Reason.ORPHAN_SURVIVOR, message, previous=self._conditions(obj)
        )
        status = self._deleting_status(obj, Phase.HELD, extra=[cond], held_by=[str(s) for s in survivors])
        await self._apply(obj, status, deleting=True)
        await self._event(obj, Reason.ORPHAN_SURVIVOR, message, "Warning")
        self._say_limited(
            f"survivors:{obj['metadata']['uid']}",
            "deletion_held",
            reason=Reason.ORPHAN_SURVIVOR,
            object="/".join(key),
            survivors=" ".join(str(s.pid) for s in survivors),
        )

    async def _held_in_use(self, obj: Obj, usage: Usage) -> None:
        key = _key(obj)
        message = (
            f"sandbox {key[0]}/{key[1]} on node {self.s.node}: deletion held, "
            f"{'in use' if usage.in_use else 'use cannot be ruled out'} by {'; '.join(usage.holders)}. "
            "It is deleted once nothing uses it (checked again at least every pass)."
        )
        status = self._deleting_status(obj, Phase.HELD, held_by=list(usage.holders), usage=usage)
        await self._apply(obj, status, deleting=True)
        await self._event(obj, usage.reason or Reason.IN_USE, message, "Warning")
        self._say_limited(
            f"held:{obj['metadata']['uid']}",
            "deletion_held",
            reason=usage.reason,
            object="/".join(key),
            holders=len(usage.holders),
        )

    def _in_use_now(self, path: Path) -> Usage:
        """The pipeline's in-use check (in a reap thread): /proc and this node's Pods, asked fresh.

        No Pod list, no way to rule out a Pod that mounts it: unknown, which holds.
        """
        key = (path.parent.name, path.name)
        pods = self._pod_paths_now()
        usage = scan_usage({key: path}, pods or [], Path("/proc"), self.ignore)[key]
        if pods is None and not usage.in_use:
            usage = Usage(None, ("the Pods on this node could not be listed",), Reason.IN_USE_UNKNOWN)
        self.state.usage[key] = usage
        return usage

    def _after_rename(self, key: Key, tomb: Tombstone | None) -> None:
        if os.environ.get(SEAM_KILL_AFTER_RENAME):
            os.kill(os.getpid(), signal.SIGKILL)

    def _before_delete(self, key: Key, tomb: Tombstone | None) -> None:
        """Report Deleting (and the tombstone's name) before a delete that may take a while, from the reap
        thread. A stuck tombstone keeps its Stuck status meanwhile, so the phase does not flap."""
        seam = os.environ.get(SEAM_KILL_DURING_DELETE)
        if seam:
            threading.Timer(float(seam), os.kill, (os.getpid(), signal.SIGKILL)).start()
        obj = self.state.objects.get(key)
        if obj is None or tomb is None or self.loop is None or not kube.is_deleting(obj):
            return
        status = obj.get("status") or {}
        if tomb.name in self.reaper.stuck or (
            status.get("phase") == str(Phase.STUCK) and status.get("tombstone") == tomb.name
        ):
            return
        deleting = self._deleting_status(obj, Phase.DELETING, tombstone=tomb.name)
        done = asyncio.run_coroutine_threadsafe(self._apply(obj, deleting, deleting=True), self.loop)
        try:
            done.result(timeout=60)
        except Exception as err:  # a report that failed never stops a deletion
            self._say_limited(f"report:{key}", "status_failed", reason=Reason.AGENT_ERROR, error=repr(err)[:300])

    def _deleting_status(
        self,
        obj: Obj,
        phase: Phase,
        *,
        extra: list[Obj] | None = None,
        held_by: list[str] | None = None,
        usage: Usage | None = None,
        tombstone: str | None = None,
    ) -> Obj:
        status: Obj = {
            "phase": str(phase),
            "inUse": bool(usage is not None and usage.holds) or bool(held_by),
            "conditions": [self._disk_condition(obj), self._in_use_condition(obj, usage), *(extra or [])],
        }
        if held_by:
            status["heldBy"] = held_by[:32]
        if tombstone:
            status["tombstone"] = tombstone
        return status

    async def _stuck(self, obj: Obj | None, stuck: Stuck) -> None:
        """A tombstone that would not go: metrics, a rate-limited line, and for an object Stuck + an Event.

        Retried by the next pass's tombstone sweep; the metric and the condition are always current.
        """
        self.m.deletion_failures.labels(self.s.node, str(stuck.cause)).inc()
        errno = _errno_name(stuck.errno)
        if obj is None:
            self._say_limited(
                f"stuck:{stuck.tombstone}",
                "tombstone_stuck",
                reason=stuck.reason,
                tombstone=stuck.tombstone,
                errno=errno,
                path=stuck.path,
                orphan=True,
            )
            return
        key = _key(obj)
        message = stuck_message(f"{key[0]}/{key[1]}", self.s.node, stuck.tombstone, stuck.errno, stuck.path)
        cond = kube.condition(Condition.TOMBSTONE_STUCK, True, stuck.cause, message, previous=self._conditions(obj))
        status = self._deleting_status(obj, Phase.STUCK, extra=[cond], tombstone=stuck.tombstone)
        await self._apply(obj, status, deleting=True)
        await self._event(obj, Reason.TOMBSTONE_STUCK, message, "Warning")
        self._say_limited(
            f"stuck:{stuck.tombstone}",
            "tombstone_stuck",
            reason=stuck.reason,
            object=f"{key[0]}/{key[1]}",
            tombstone=stuck.tombstone,
            errno=errno,
            path=stuck.path,
        )

    def _newest(self, obj: Obj) -> Obj:
        """The cache's copy when it is the same object (our own status writes land there first)."""
        cached = self.state.objects.get(_key(obj))
        return cached if cached is not None and cached["metadata"].get("uid") == obj["metadata"]["uid"] else obj

    async def _finish(self, obj: Obj, tombstone: str | None) -> None:
        """Remove the finalizer, guarded by resourceVersion; on a conflict read fresh and try again."""
        key = _key(obj)
        for _ in range(5):
            if FINALIZER not in _finalizers(obj):
                return
            try:
                await self._api(self.kube.remove_finalizer, obj)
            except KubeError as err:
                if err.not_found:
                    return
                if not err.conflict:
                    raise
                fresh = await self._api(self.kube.get_sandbox, *key)
                if fresh is None or fresh["metadata"]["uid"] != obj["metadata"]["uid"]:
                    return
                obj = fresh
                continue
            logs.say(log, "finalizer_removed", reason=Reason.DELETED, object=f"{key[0]}/{key[1]}", tombstone=tombstone)
            self.queue.forget(key)
            return
        self._later(key)

    # --- reporting -------------------------------------------------------------------------------------

    def _report_strays(self, strays: Iterable[Any], refused: dict[str, int]) -> None:
        counts: dict[str, int] = dict(refused)
        for stray in strays:
            counts[str(stray.reason)] = counts.get(str(stray.reason), 0) + 1
            self._say_limited(
                f"stray:{stray.rel}",
                "invalid_entry",
                reason=stray.reason,
                path=stray.path,
                action="not a sandbox: never followed; remove it by hand if it is not needed",
            )
        self.m.invalid_entries.clear()
        for reason, n in counts.items():
            self.m.invalid_entries.labels(self.s.node, reason).set(n)

    def _update_metrics(self, tombstones: list[Tombstone]) -> None:
        node = self.s.node
        now = datetime.now(UTC)
        live = {t.name for t in self.root.tombstones()}
        self.reaper.forget(live)
        remaining = [t for t in tombstones if t.name in live]
        ages = [t.age(now).total_seconds() for t in remaining if t.age(now) >= self.s.stuck_after]
        self.m.tombstones.labels(node).set(len(remaining))
        self.m.tombstones_stuck.labels(node).set(len(ages))
        self.m.tombstone_stuck_oldest.labels(node).set(max(ages, default=0))
        phases: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for key, obj in self.state.objects.items():
            phase = (obj.get("status") or {}).get("phase") or "Unknown"
            phases[phase] = phases.get(phase, 0) + 1
            sizes[phase] = sizes.get(phase, 0) + self.sizer.sizes.get(key, (0, 0))[0]
        self.m.sandboxes.clear()
        self.m.retained_bytes.clear()
        for phase, n in phases.items():
            self.m.sandboxes.labels(node, phase).set(n)
            self.m.retained_bytes.labels(node, phase).set(sizes[phase])
        self.m.in_use_holds.labels(node).set(sum(1 for u in self.state.usage.values() if u.holds))
        with contextlib.suppress(OSError):
            vfs = os.statvfs(self.root.path)
            self.m.root_size.labels(node).set(vfs.f_blocks * vfs.f_frsize)
            self.m.root_avail.labels(node).set(vfs.f_bavail * vfs.f_frsize)

    def orphan_report(self) -> list[Obj]:
        """Stuck tombstones with no object, for `doctor` (published on the heartbeat Lease)."""
        now = time.monotonic()
        out = []
        for name, info in sorted(self.reaper.stuck.items()):
            if info.key is None:
                failing = int(now - info.first_failed)
                out.append({"name": name, "errno": _errno_name(info.errno), "path": info.path, "failingFor": failing})
        return out

    async def _heartbeat(self) -> None:
        try:
            await self._api(leases.renew_heartbeat, self.kube, self.s.namespace, self.s.node, self.identity)
            report = json.dumps(self.orphan_report(), sort_keys=True)
            if report != self.last_orphans_published:
                patch = {"metadata": {"annotations": {ORPHANS_ANNOTATION: report}}}
                await self._api(
                    self.kube.request,
                    "PATCH",
                    leases.lease_path(self.s.namespace, leases.heartbeat_name(self.s.node)),
                    body=patch,
                    content_type="application/merge-patch+json",
                )
                self.last_orphans_published = report
            self.m.heartbeat.labels(self.s.node).set(time.time())
        except KubeError as err:
            self._say_limited("heartbeat", "heartbeat_failed", reason=Reason.AGENT_STALE, error=str(err)[:300])


# --- the command -----------------------------------------------------------------------------------------


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", help="this node's name (env SANDKEEP_NODE)")
    parser.add_argument("--root", help="the node's sandbox root (env SANDKEEP_ROOT)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    parser.add_argument("--namespace", help="namespace of the heartbeat Lease (env SANDKEEP_NAMESPACE)")
    parser.add_argument("--metrics-port", type=int, help="port for /metrics /healthz /readyz (0: any free port)")
    parser.add_argument("--metrics-host", help="address to serve metrics on (default 127.0.0.1)")
    parser.add_argument("--scan-interval", help="time between full passes (default 30s)")
    parser.add_argument("--stuck-after", help="age at which a tombstone counts as stuck (default 10m)")
    parser.add_argument("--relog-every", help="how often a stuck tombstone is logged again (default 24h)")
    parser.add_argument("--orphan-timeout", help="how long a killed orphan command may take to end (default 10s)")
    parser.add_argument("--lock-wait", help="give up after waiting this long for the root lock (default: forever)")
    parser.add_argument("--ignore-pid", type=int, action="append", dest="ignore_pids", help="a pid vouched for")


def settings_from(args: argparse.Namespace) -> AgentSettings:
    overrides = {
        k: v
        for k, v in vars(args).items()
        if v is not None and k in AgentSettings.model_fields and k not in ("command", "log_level")
    }
    return AgentSettings(**overrides)


def _hold_lock(root: Root, settings: AgentSettings, stack: contextlib.ExitStack) -> bool:
    """Take the root lock, waiting (and saying so) while another agent holds it."""
    limit = settings.lock_wait.total_seconds()
    started = time.monotonic()
    said = False
    while True:
        try:
            stack.enter_context(root.lock(wait=0 if not said else 5.0))
            if said:
                logs.say(log, "root_lock_acquired", reason=Reason.ROOT_LOCKED, root=root.path)
            return True
        except RootRefused as err:
            if not said:
                logs.say(log, "root_locked_waiting", level=logging.WARNING, reason=err.reason, message=str(err))
                said = True
            if limit and time.monotonic() - started >= limit:
                logs.say(log, "root_lock_gave_up", level=logging.ERROR, reason=err.reason, message=str(err))
                return False


def run(command: str, args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValueError as err:
        print(f"sandkeep agent: invalid settings: {err}", file=sys.stderr)
        return 2
    if not settings.node:
        print("sandkeep agent: --node (or SANDKEEP_NODE) is required: the node this agent runs on", file=sys.stderr)
        return 2
    try:
        root = Root(settings.root)
    except RootRefused as err:
        logs.say(log, "root_refused", level=logging.ERROR, reason=err.reason, message=str(err))
        return 1
    with contextlib.ExitStack() as stack:
        if not _hold_lock(root, settings, stack):
            return 1
        client = Kube(kube.load_config(settings.kubeconfig), component="sandkeep-agent")
        agent_metrics = metrics.AgentMetrics(settings.node)
        agent = Agent(settings, client, root, agent_metrics)
        server = metrics.serve(
            agent_metrics.registry,
            settings.metrics_port,
            settings.metrics_host,
            healthy=agent.healthy,
            ready=lambda: agent.state.synced,
        )
        stack.callback(server.shutdown)
        logs.say(
            log, "agent_started", node=settings.node, root=root.path, metrics_port=server.server_port, pid=os.getpid()
        )
        _warn_uninspectable(agent.ignore)
        asyncio.run(_main(agent))
    return 0


def _warn_uninspectable(ignored: Collection[int]) -> None:
    """Say at start, once, which processes make every in-use answer unknown (and so hold every deletion)."""
    hidden = sorted(set(uninspectable_pids()) - set(ignored))
    if hidden:
        logs.say(
            log,
            "processes_uninspectable",
            level=logging.WARNING,
            reason=Reason.IN_USE_UNKNOWN,
            pids=",".join(map(str, hidden[:20])),
            message="these processes cannot be inspected, so no sandbox can be shown unused and every deletion is "
            "held; run the agent with hostPID and CAP_SYS_PTRACE, or vouch for them with --ignore-pid",
        )


async def _main(agent: Agent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await agent.run(stop)
    logs.say(log, "agent_stopped", node=agent.s.node)
