"""Measure what a fleet's control plane pays for sandkeep, on the real local one (issue 15, items 4 and 5).

    python hack/bench/fleet_model.py                           # 1k, 5k, 20k objects; 100, 500, 1000 watches
    python hack/bench/fleet_model.py --sizes 20,50 --watches 2,4 --updates 20 --expire 20 --nodes 4

Four sections, each line with the machine's load average beside it (nothing is asserted):

- objects: N RetainedSandboxes as a real node writes them (the agent's create with its finalizer and
  labels, the agent's status apply, the controller's status apply from its own `decide()`); past
  `--api-objects`, copies of a real one's stored bytes written straight into etcd; and at each N:
  etcd's db size (`etcd_mvcc_db_total_size_in_bytes`) as it is and after a compaction and defrag through
  etcd's HTTP gateway, the bytes of one object as kube-apiserver returns it and as etcd stores it, and
  kube-apiserver's RSS and Go heap.
- watches: W concurrent watches with `fieldSelector=spec.nodeName=<node>`, one per node, as every agent
  holds one (raw HTTP/1.1 over TLS, asyncio); then M status applies to objects of watched nodes: the API
  server's CPU time per update (utime+stime from /proc, idle rate subtracted), its RSS per watch and the
  delivery latency (write sent -> event read on its node's watch).
- expiry: K expiries made of exactly sandkeep's requests for one (the controller's DELETE with uid +
  resourceVersion preconditions on its view's version, no GET, and its DeleteRequested Event: the first
  `events.AGGREGATE_AFTER` of a namespace in a window one by one, the rest as one aggregated Event; the agent's
  guarded finalizer removal, its Deleting status only for a delete still running after 2 s; one Pod list
  per node for the wave), counted from `apiserver_request_total`, with the QPS the local API server
  sustained and its and etcd's CPU per request.
- events: the bytes etcd stores per Event (the expiry's own).

What the control plane's processes cost (CPU time, RSS, their metrics, etcd's gateway) is read by
hack/bench/plane.py.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import random
import resource
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.api.kube import AGENT_MANAGER, CONTROLLER_MANAGER, Kube, load_config, now_utc, sandbox_path  # noqa: E402
from controller.cluster.decide import Context, decide  # noqa: E402
from controller.cluster.events import AGGREGATE_AFTER, AGGREGATE_WINDOW  # noqa: E402
from controller.rules import contracts as c  # noqa: E402
from controller.rules.contracts import Condition, Reason  # noqa: E402
from controller.rules.durations import format_instant  # noqa: E402
from controller.rules.models import label_value  # noqa: E402
from controller.rules.objects import Obj, condition  # noqa: E402
from controller.rules.policy import Policy  # noqa: E402
from controller.rules.sizes import human_size  # noqa: E402
from hack.apimetrics import requests_by  # noqa: E402
from hack.bench.plane import Plane, b64, cpu_seconds, percentile, rss_mib  # noqa: E402
from hack.localcluster import LocalCluster  # noqa: E402

ROOT = "/var/lib/sandkeep"
SIZE_BASE = 10_000_000_000  # sizeBytes of a watched update: SIZE_BASE + its sequence number
RESULTS: dict[str, Any] = {"objects": [], "watches": [], "expiry": [], "events": {}}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def say(text: str) -> None:
    print(f"{text}  [load {load()}]", flush=True)


def node_name(k: int) -> str:
    """A node name of a real cloud's length (e.g. ip-10-0-3-17.eu-west-1.compute.internal)."""
    return f"ip-10-{k // 250}-{k % 250}-{k % 7}.eu-west-1.compute.internal"


# --- the objects, as a node's agent and the controller write them ------------------------------------------------
class Fleet:
    def __init__(self, args: argparse.Namespace, kube: Kube) -> None:
        self.args = args
        self.kube = kube
        self.namespaces = [f"fleet-team-{j:03d}" for j in range(args.namespaces)]
        self.nodes = [node_name(k) for k in range(args.nodes)]
        self.created = 0
        self.policy = Policy(retention=timedelta(days=7), max_pin=timedelta(days=30))
        self.rng = random.Random(15)

    def key(self, i: int) -> tuple[str, str, str]:
        """Object i: its namespace, name and node (round-robin, so every node holds N / nodes)."""
        return self.namespaces[i % len(self.namespaces)], f"ci-run-{i:07d}", self.nodes[i % len(self.nodes)]

    def agent_status(self, ns: str, name: str, node: str, size: int, files: int) -> dict[str, Any]:
        """What the agent's `Reporter.observed_status` writes for a present, unused, measured sandbox."""
        return {
            "inUse": False,
            "conditions": [
                condition(Condition.DISK_PRESENT, True, Reason.RETAINED, f"{ROOT}/{ns}/{name} on node {node}"),
                condition(Condition.IN_USE, False, Reason.RETAINED, "nothing on the node uses it"),
            ],
            "sizeBytes": size,
            "fileCount": files,
            "size": human_size(size),
        }

    def make(self, i: int) -> None:
        """The three writes a sandbox gets from a real node and controller: the agent's adoption (create with
        finalizer and labels), its first status report, and the controller's decision."""
        ns, name, node = self.key(i)
        created_at = now_utc() - timedelta(seconds=self.rng.randint(0, 86400))
        body = {
            "metadata": {
                "name": name,
                "namespace": ns,
                "finalizers": [c.FINALIZER],
                "labels": {c.LABEL_NODE: label_value(node), c.LABEL_MANAGED_BY: c.MANAGED_BY},
            },
            "spec": {
                "nodeName": node,
                "createdAt": format_instant(created_at),
                "workspace": {"path": f"{ROOT}/{ns}/{name}/workspace"},
                "retainUntil": format_instant(created_at + timedelta(days=7)),
                "jobId": f"{ns}/pipeline-{i % 997}/job-{self.rng.getrandbits(64):016x}",
            },
        }
        obj = self.kube.create_sandbox(ns, body)
        size, files = self.rng.randint(10**6, 5 * 10**9), self.rng.randint(10, 200_000)
        obj = self.kube.apply_status(obj, self.agent_status(ns, name, node, size, files), AGENT_MANAGER)
        now = now_utc()
        self.kube.apply_status(obj, decide(obj, Context(self.policy), now).status, CONTROLLER_MANAGER)

    def grow(self, to: int, plane: Plane) -> tuple[float, float]:
        """Objects up to `to`: through the API (three writes each) up to `--api-objects`, cloned in etcd
        beyond; returns the seconds each way took."""
        began = time.monotonic()
        through_api = range(self.created, min(to, self.args.api_objects))
        with ThreadPoolExecutor(self.args.threads) as pool:
            list(pool.map(self.make, through_api))
        api = time.monotonic() - began
        self.created = max(self.created, through_api.stop)
        began = time.monotonic()
        if to > self.created:
            self.clone(plane, range(self.created, to))
            self.created = to
        return api, time.monotonic() - began

    def clone(self, plane: Plane, indexes: range) -> None:
        """Objects written straight into etcd as copies of object 0's stored bytes (renamed, new uid), 128 to a
        transaction: kube-apiserver's watch cache takes them in like any write, at a rate three API writes
        per object cannot reach on this machine. The stored size stays the measured one within a few bytes."""
        ns0, name0, node0 = self.key(0)
        found = plane.gateway("/v3/kv/range", {"key": b64(stored_key(ns0, name0))})["kvs"][0]
        template = base64.b64decode(found["value"]).decode()
        uid0 = json.loads(template)["metadata"]["uid"]

        def value(i: int) -> tuple[str, str]:
            ns, name, node = self.key(i)
            text = template.replace(uid0, str(uuid.uuid4())).replace(node0, node)
            return stored_key(ns, name), text.replace(f"{ns0}/", f"{ns}/").replace(ns0, ns).replace(name0, name)

        def put(chunk: range) -> None:
            ops = [{"requestPut": {"key": b64(k), "value": b64(v)}} for k, v in map(value, chunk)]
            plane.gateway("/v3/kv/txn", {"success": ops})

        chunks = [range(i, min(i + 128, indexes.stop)) for i in range(indexes.start, indexes.stop, 128)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(put, chunks))
        limit = time.monotonic() + self.args.timeout
        while time.monotonic() < limit:  # until the API server lists them all (a consistent read)
            listing = self.kube.request("GET", sandbox_path(), query={"limit": "1"})
            if int(listing["metadata"].get("remainingItemCount", 0)) + len(listing["items"]) >= indexes.stop:
                return
            time.sleep(1)


def stored_key(namespace: str, name: str) -> str:
    return f"/registry/{c.GROUP}/{c.SANDBOX_PLURAL}/{namespace}/{name}"


def measure_objects(args: argparse.Namespace, plane: Plane, fleet: Fleet) -> None:
    say("== objects: etcd and kube-apiserver per RetainedSandbox ==")
    plane.compact_and_defrag()
    db0, _ = plane.db_bytes()
    rss0, heap0 = rss_mib(plane.apiserver), plane.heap_mib()
    say(
        f"empty: etcd db {db0 / 2**20:.2f} MiB after compaction+defrag; kube-apiserver RSS {rss0:.0f} MiB, "
        f"Go heap in use {heap0:.0f} MiB"
    )
    rate = math.nan
    began = time.monotonic()
    for n in args.sizes:
        left = args.budget - (time.monotonic() - began)
        api_left = max(0, min(n, args.api_objects) - fleet.created)
        projected = api_left / rate if rate == rate else 0.0
        if projected > left:
            say(f"objects {n}: skipped (projected {projected:.0f}s of creation, {left:.0f}s of --budget left)")
            continue
        start = fleet.created
        api, cloned = fleet.grow(n, plane)
        through_api = max(0, min(n, args.api_objects) - start)
        took = api + cloned
        rate = through_api / api if through_api and api else rate
        how = (
            f"{through_api} through the API in {api:.1f}s ({through_api / api:.0f} objects/s, 3 writes each)"
            if through_api
            else "none through the API"
        )
        how += f", {n - start - through_api} cloned in etcd in {cloned:.1f}s" if n - start - through_api else ""
        db_raw, in_use = plane.db_bytes()
        defrag = plane.compact_and_defrag()
        db, _ = plane.db_bytes()
        time.sleep(2)  # let a Go GC cycle pass before reading memory
        rss, heap = rss_mib(plane.apiserver), plane.heap_mib()
        etcd_rss = rss_mib(plane.etcd)
        count, key_b, value_b = plane.stored(f"/registry/{c.GROUP}/{c.SANDBOX_PLURAL}/", 200)
        ns, name, _node = fleet.key(n - 1)
        raw = json.dumps(fleet.kube.request("GET", sandbox_path(ns, name)), separators=(",", ":"))
        obj = json.loads(raw)
        managed = len(json.dumps(obj["metadata"].pop("managedFields", []), separators=(",", ":")))
        point = {
            "objects": n,
            "create_seconds": took,
            "api_objects": through_api,
            "api_seconds": api,
            "cloned_seconds": cloned,
            "etcd_db_bytes": db_raw,
            "etcd_db_in_use_bytes": in_use,
            "etcd_db_defrag_bytes": db,
            "etcd_db_per_object": (db - db0) / n,
            "etcd_keys": count,
            "etcd_key_bytes": key_b,
            "etcd_value_bytes": value_b,
            "json_bytes": len(raw),
            "json_managed_fields_bytes": managed,
            "apiserver_rss_mib": rss,
            "apiserver_rss_per_object_kib": (rss - rss0) * 1024 / n,
            "apiserver_heap_mib": heap,
            "apiserver_heap_per_object_kib": (heap - heap0) * 1024 / n,
            "etcd_rss_mib": etcd_rss,
            "load": load(),
        }
        RESULTS["objects"].append(point)
        say(
            f"objects {n}: {how}; etcd db "
            f"{db_raw / 2**20:.1f} MiB ({in_use / 2**20:.1f} MiB in use), {db / 2**20:.1f} MiB after "
            f"compaction+defrag ({defrag:.1f}s): {point['etcd_db_per_object']:.0f} B/object"
        )
        say(
            f"  stored in etcd: {count} keys, value {value_b:.0f} B, key {key_b:.0f} B per object; as returned: "
            f"{len(raw)} B of JSON, {managed} B of it managedFields"
        )
        say(
            f"  kube-apiserver RSS {rss:.0f} MiB ({point['apiserver_rss_per_object_kib']:.2f} KiB/object), Go heap "
            f"in use {heap:.0f} MiB ({point['apiserver_heap_per_object_kib']:.2f} KiB/object); etcd RSS "
            f"{etcd_rss:.0f} MiB"
        )


# --- watches: W field-selected watches, one per node, as the agents hold them ------------------------------------
class Watches:
    """W raw watch streams on one asyncio loop; records when each update's event arrives."""

    def __init__(self, cluster: LocalCluster, nodes: list[str], resource_version: str) -> None:
        url = cluster.server.removeprefix("https://")
        self.host, port = url.split(":")
        self.port = int(port)
        pki = Path(str(cluster.dir)) / "pki"
        self.ssl = ssl.create_default_context(cafile=str(cluster.ca_file))
        self.ssl.load_cert_chain(pki / "admin.crt", pki / "admin.key")
        self.nodes = nodes
        self.rv = resource_version
        self.delivered: dict[int, float] = {}
        self.open = 0
        self.errors: list[str] = []
        self.events = 0

    async def one(self, node: str, ready: asyncio.Event, gate: asyncio.Semaphore) -> None:
        query = (
            f"watch=true&allowWatchBookmarks=true&timeoutSeconds=3600&resourceVersion={self.rv}"
            f"&fieldSelector=spec.nodeName%3D{node}"
        )
        async with gate:  # bounded TLS handshakes at once
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
            writer.write(
                f"GET {sandbox_path()}?{query} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                "Accept: application/json\r\nUser-Agent: sandkeep-fleet-bench\r\n\r\n".encode()
            )
            await writer.drain()
            status = await reader.readline()
            if b" 200 " not in status:
                self.errors.append(status.decode(errors="replace").strip())
                writer.close()
                return
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
        self.open += 1
        if self.open == len(self.nodes):
            ready.set()
        buffer = b""
        try:
            while True:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    return
                buffer += (await reader.readexactly(size + 2))[:-2]
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self.received(line)
        finally:
            writer.close()

    def received(self, line: bytes) -> None:
        now = time.time()
        event = json.loads(line)
        self.events += 1
        size = ((event.get("object") or {}).get("status") or {}).get("sizeBytes", 0)
        if event.get("type") == "MODIFIED" and size >= SIZE_BASE:
            self.delivered.setdefault(size - SIZE_BASE, now)


def measure_watches(args: argparse.Namespace, plane: Plane, fleet: Fleet) -> None:
    say("== watches: field-selected watches (spec.nodeName=<node>) and the cost of their fan-out ==")
    seq = 0
    for w in [0, *args.watches]:
        if w > len(fleet.nodes):
            say(f"watches {w}: skipped (only {len(fleet.nodes)} nodes; raise --nodes)")
            continue
        seq = asyncio.run(watch_round(args, plane, fleet, w, seq))


async def watch_round(args: argparse.Namespace, plane: Plane, fleet: Fleet, w: int, seq: int) -> int:
    listing = fleet.kube.request("GET", sandbox_path(), query={"limit": "1"})
    watches = Watches(plane.cluster, fleet.nodes[:w], listing["metadata"]["resourceVersion"])
    ready = asyncio.Event()
    if w == 0:
        ready.set()
    rss0, heap0 = rss_mib(plane.apiserver), plane.heap_mib()
    began = time.monotonic()
    gate = asyncio.Semaphore(32)
    tasks = [asyncio.create_task(watches.one(node, ready, gate)) for node in watches.nodes]
    try:
        await asyncio.wait_for(ready.wait(), timeout=args.timeout)
    except TimeoutError:
        say(f"watches {w}: only {watches.open} opened in {args.timeout:.0f}s; errors {watches.errors[:3]}")
    opened = time.monotonic() - began
    await asyncio.sleep(3)
    rss, heap = rss_mib(plane.apiserver), plane.heap_mib()
    # the updates: status applies to objects of watched nodes (every node when none is watched), paced
    targets = [i for i in range(fleet.created) if w == 0 or i % len(fleet.nodes) < w]
    idle_from, idle_cpu = time.monotonic(), cpu_seconds(plane.apiserver)
    await asyncio.sleep(args.idle)
    idle_rate = (cpu_seconds(plane.apiserver) - idle_cpu) / (time.monotonic() - idle_from)
    sent: dict[int, float] = {}
    first = seq

    def update(j: int) -> None:
        i = targets[(j - first) % len(targets)]
        ns, name, node = fleet.key(i)
        status = fleet.agent_status(ns, name, node, SIZE_BASE + j, 1000)
        sent[j] = time.time()
        obj = {"metadata": {"name": name, "namespace": ns}}
        fleet.kube.apply_status(obj, status, AGENT_MANAGER)

    cpu0, etcd0, t0 = cpu_seconds(plane.apiserver), cpu_seconds(plane.etcd), time.monotonic()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(8) as pool:
        pending = []
        for k in range(args.updates):
            due = t0 + k / args.update_rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            pending.append(loop.run_in_executor(pool, update, first + k))
        await asyncio.gather(*pending)
    limit = time.monotonic() + 30
    while w and len(watches.delivered) < args.updates and time.monotonic() < limit:
        await asyncio.sleep(0.05)
    elapsed = time.monotonic() - t0
    cpu = cpu_seconds(plane.apiserver) - cpu0 - idle_rate * elapsed
    etcd_cpu = cpu_seconds(plane.etcd) - etcd0
    lags = [watches.delivered[j] - sent[j] for j in watches.delivered if j in sent]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    point = {
        "watches": w,
        "open_seconds": opened,
        "apiserver_rss_mib": rss,
        "rss_per_watch_kib": (rss - rss0) * 1024 / w if w else math.nan,
        "heap_per_watch_kib": (heap - heap0) * 1024 / w if w else math.nan,
        "updates": args.updates,
        "update_seconds": elapsed,
        "apiserver_cpu_ms_per_update": cpu * 1000 / args.updates,
        "apiserver_idle_cpu_rate": idle_rate,
        "etcd_cpu_ms_per_update": etcd_cpu * 1000 / args.updates,
        "delivered": len(lags),
        "latency_p50_ms": percentile(lags, 0.5) * 1000,
        "latency_p99_ms": percentile(lags, 0.99) * 1000,
        "latency_max_ms": max(lags, default=math.nan) * 1000,
        "load": load(),
    }
    RESULTS["watches"].append(point)
    if w:
        say(
            f"watches {w}: {watches.open} open in {opened:.1f}s; kube-apiserver RSS {rss:.0f} MiB "
            f"(+{point['rss_per_watch_kib']:.1f} KiB/watch RSS, +{point['heap_per_watch_kib']:.1f} KiB/watch heap)"
        )
    say(
        f"watches {w}: {args.updates} updates at {args.update_rate:.0f}/s: kube-apiserver CPU "
        f"{point['apiserver_cpu_ms_per_update']:.2f} ms/update (idle {idle_rate * 1000:.0f} ms/s subtracted), "
        f"etcd {point['etcd_cpu_ms_per_update']:.2f} ms/update; delivered {len(lags)}/{args.updates if w else 0}, "
        f"latency p50 {point['latency_p50_ms']:.1f} ms p99 {point['latency_p99_ms']:.1f} ms "
        f"max {point['latency_max_ms']:.1f} ms"
    )
    return first + args.updates


# --- a mass expiry: sandkeep's requests for each, counted by the API server ------------------------------------
class Wave:
    """The controller's Event aggregation (`controller/cluster/events.py`): in each namespace's window of
    AGGREGATE_WINDOW seconds the first AGGREGATE_AFTER DeleteRequested Events one by one, the rest folded
    into one, posted when the window ends (here: by the next expiry after it, or after the wave)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.lock = threading.Lock()
        self.windows: dict[str, tuple[float, int, list[Obj]]] = {}  # namespace: (start, singles, folded)

    def single(self, ns: str, obj: Obj) -> bool:
        now = time.monotonic()
        with self.lock:
            start, singles, folded = self.windows.get(ns, (now, 0, []))
            if now - start >= AGGREGATE_WINDOW:
                self.post(ns, folded)
                start, singles, folded = now, 0, []
            self.windows[ns] = (start, singles + 1, folded) if singles < AGGREGATE_AFTER else (start, singles, folded)
            if singles < AGGREGATE_AFTER:
                return True
            folded.append(obj)
            return False

    def post(self, ns: str, objs: list[Obj]) -> None:
        if objs:
            names = ", ".join(o["metadata"]["name"] for o in objs)[:900]
            words = "expired (RetainUntil); delete requested"
            message = f"(combined from similar events): {len(objs)} more in {ns}, {words}: {names}"
            self.kube.post_event(objs[0], Reason.DELETE_REQUESTED, message, "Normal", "sandkeep-controller")

    def end(self) -> None:
        for ns, (_start, _singles, folded) in self.windows.items():
            self.post(ns, folded)


def expire_one(fleet: Fleet, wave: Wave, i: int, fresh: Obj | None) -> None:
    """One expiry's requests, in sandkeep's order: the controller's `_delete_guarded` and `_expire` (on the
    version its view holds, `fresh`: no GET; its DeleteRequested Event unless the wave's aggregation folds
    it), then the agent's finalizer removal (`_finish`). The agent's Deleting status is applied only to a
    delete still running after 2 s (`DELETING_AFTER`), which a sandbox of this size never is."""
    ns, name, _node = fleet.key(i)
    kube = fleet.kube
    if fresh is None:
        return
    deleting = kube.delete_sandbox(fresh) or fresh
    if wave.single(ns, fresh):
        ref = "/".join((ns, name))
        message = f"{ref} expired: deadline has passed (RetainUntil); delete requested"
        kube.post_event(fresh, Reason.DELETE_REQUESTED, message, "Normal", "sandkeep-controller")
    kube.remove_finalizer(deleting)


def pod_lists(fleet: Fleet, nodes: Iterable[str]) -> None:
    """The agent's one Pod list per batch (its in-use check), one per node for the wave."""
    for node in nodes:
        fleet.kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"})


def measure_expiry(args: argparse.Namespace, plane: Plane, fleet: Fleet) -> None:
    say("== expiry: sandkeep's requests for a mass expiry, and the QPS the local API server sustains ==")
    todo = list(range(fleet.created))
    random.Random(4).shuffle(todo)
    todo = todo[: args.expire]
    rounds = [todo[k :: len(args.expiry_threads)] for k in range(len(args.expiry_threads))]
    for threads, chunk in zip(args.expiry_threads, rounds, strict=True):
        if not chunk:
            continue
        with ThreadPoolExecutor(threads) as pool:  # the controller's view, read before the wave (not counted)
            view = dict(zip(chunk, pool.map(lambda i: fleet.kube.get_sandbox(*fleet.key(i)[:2]), chunk), strict=True))
        before = requests_by(plane.cluster.metrics_text())
        cpu0, etcd0 = cpu_seconds(plane.apiserver), cpu_seconds(plane.etcd)
        me0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        nodes = sorted({fleet.key(i)[2] for i in chunk})
        wave = Wave(fleet.kube)
        with ThreadPoolExecutor(threads) as pool:
            waiting = [pool.submit(pod_lists, fleet, nodes[k::threads]) for k in range(threads)]
            list(pool.map(expire_one, [fleet] * len(chunk), [wave] * len(chunk), chunk, [view[i] for i in chunk]))
            for done in waiting:
                done.result()
        wave.end()
        wall = time.monotonic() - t0
        me1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu, etcd_cpu = cpu_seconds(plane.apiserver) - cpu0, cpu_seconds(plane.etcd) - etcd0
        after = requests_by(plane.cluster.metrics_text())
        delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}
        ours = {k: v for k, v in delta.items() if k.partition(" ")[2] in (c.SANDBOX_PLURAL, "events", "pods")}
        total = sum(ours.values())
        client = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
        point = {
            "expired": len(chunk),
            "threads": threads,
            "nodes": len(nodes),
            "requests": ours,
            "requests_total": total,
            "requests_per_expiry": total / len(chunk),
            "wall_seconds": wall,
            "qps": total / wall,
            "expiries_per_second": len(chunk) / wall,
            "apiserver_cpu_ms_per_request": cpu * 1000 / total,
            "etcd_cpu_ms_per_request": etcd_cpu * 1000 / total,
            "client_cpu_ms_per_request": client * 1000 / total,
            "load": load(),
        }
        RESULTS["expiry"].append(point)
        mix = ", ".join(f"{k} {v:.0f}" for k, v in sorted(ours.items()))
        say(f"expired {len(chunk)} on {len(nodes)} nodes with {threads} threads: requests {mix}")
        say(
            f"  {point['requests_per_expiry']:.2f} requests/expiry; {total:.0f} requests in {wall:.1f}s: "
            f"{point['qps']:.0f} QPS sustained ({point['expiries_per_second']:.0f} expiries/s); CPU per request: "
            f"kube-apiserver {point['apiserver_cpu_ms_per_request']:.2f} ms, etcd "
            f"{point['etcd_cpu_ms_per_request']:.2f} ms, this client {point['client_cpu_ms_per_request']:.2f} ms"
        )
    count, key_b, value_b = plane.stored("/registry/events/", 200)
    RESULTS["events"] = {"keys": count, "key_bytes": key_b, "value_bytes": value_b, "load": load()}
    say(f"events: {count} Events in etcd, value {value_b:.0f} B, key {key_b:.0f} B per Event")


# --- the run ------------------------------------------------------------------------------------------------------
def sizes(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=sizes, default=[1000, 5000, 20000, 50000, 100000], help="object counts")
    parser.add_argument("--api-objects", type=int, default=1000, help="objects made through the API; beyond: clones")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds of object creation through the API")
    parser.add_argument("--watches", type=sizes, default=[100, 500, 1000], help="watch counts, ascending")
    parser.add_argument("--nodes", type=int, default=1000, help="nodes the objects are spread over (>= watches)")
    parser.add_argument("--namespaces", type=int, default=50)
    parser.add_argument("--updates", type=int, default=2000, help="status updates per watch round")
    parser.add_argument("--update-rate", type=float, default=100.0, help="updates per second in a watch round")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle CPU measured before updates")
    parser.add_argument("--expire", type=int, default=4000, help="objects expired in the expiry section")
    parser.add_argument("--expiry-threads", type=sizes, default=[8, 32], help="concurrency of each expiry round")
    parser.add_argument("--threads", type=int, default=16, help="concurrent creates")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--workdir", type=Path, help="parent of the cluster's temporary directory")
    parser.add_argument("--json", type=Path, help="also write every measured point here")
    args = parser.parse_args(argv)
    git = os.popen(f"git -C {REPO} rev-parse --short HEAD 2>/dev/null").read().strip()
    say(
        f"fleet_model at {git or '?'}: sizes {args.sizes}, watches {args.watches}, {args.nodes} nodes, "
        f"{args.namespaces} namespaces, {os.cpu_count()} CPUs"
    )
    with LocalCluster(args.workdir) as cluster:
        say(f"local control plane ready in {cluster.startup_seconds:.1f}s (etcd --unsafe-no-fsync)")
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{c.SANDBOX_PLURAL}.{c.GROUP}")
        config = load_config(cluster.kubeconfig)
        config.connection_pool_maxsize = 64
        kube = Kube(config, "sandkeep-fleet-bench", timeout=120)
        fleet = Fleet(args, kube)
        for ns in fleet.namespaces:
            cluster.kubectl("create", "namespace", ns)
        plane = Plane(cluster)
        try:
            measure_objects(args, plane, fleet)
            measure_watches(args, plane, fleet)
            measure_expiry(args, plane, fleet)
        finally:
            kube.close()
    if args.json:
        RESULTS["args"] = {k: str(v) for k, v in vars(args).items()}
        RESULTS["commit"] = git
        args.json.write_text(json.dumps(RESULTS, indent=1, default=str))
    say("fleet_model: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
