"""Prometheus metrics of both components, and the small HTTP server that exposes them with health.

Each component gets its own registry (`ControllerMetrics`, `AgentMetrics`), so a test can run a
controller and two agents in one process and read each one's numbers apart. Names come from
`contracts`; the alert rules and the dashboard are checked against them. Both registries also carry
the client library's standard `process_*` (memory, CPU, file descriptors) and `python_info` series and
`sandkeep_build_info{version,python}`, as every well-kept exporter does, and controller-runtime's work queue
series (`QueueMetrics`), so the dashboards an SRE already has for Go operators read sandkeep's queues too.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller import __version__
from controller.rules import contracts as c

# Deletions of a real tree take from milliseconds to minutes; lag is seconds unless something is wrong.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LAG_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900)
# controller-runtime's own buckets: the work queue's (10 ns to 1,000 s, x10) and a reconcile's (5 ms to 60 s).
QUEUE_BUCKETS = tuple(1e-8 * 10**i for i in range(12))
RECONCILE_BUCKETS = (
    *(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    *(1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 60),
)
QUEUE_LABELS = ["name", "controller"]  # both the queue's name, as controller-runtime labels them


class QueueStats(Protocol):
    """What a work queue says when scraped (api/workqueue.py's `WorkQueue`)."""

    def depths(self) -> dict[int, int]: ...

    def running(self) -> list[float]: ...


@dataclass(frozen=True)
class QueueInstruments:
    """One queue's children of the pushed series (client-go's MetricsProvider, one queue's half)."""

    adds: Any
    latency: Any
    work: Any
    retries: Any


class _QueueCollector(Collector):
    """The series read from the queues when scraped: depth by priority, unfinished work, longest running."""

    def __init__(self, queues: dict[str, QueueStats]) -> None:
        self.queues = queues

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            c.M_WORKQUEUE_DEPTH,
            "Current depth of workqueue by workqueue and priority",
            labels=[*QUEUE_LABELS, "priority"],
        )
        unfinished = GaugeMetricFamily(
            c.M_WORKQUEUE_UNFINISHED,
            "How many seconds of work has been done that is in progress and hasn't been observed by work_duration.",
            labels=QUEUE_LABELS,
        )
        longest = GaugeMetricFamily(
            c.M_WORKQUEUE_LONGEST,
            "How many seconds has the longest running processor for workqueue been running.",
            labels=QUEUE_LABELS,
        )
        for name, queue in list(self.queues.items()):
            depths = queue.depths()
            for priority in sorted({0, 1, *depths}):
                depth.add_metric([name, name, str(priority)], depths.get(priority, 0))
            running = queue.running()
            unfinished.add_metric([name, name], sum(running))
            longest.add_metric([name, name], max(running, default=0.0))
        yield from (depth, unfinished, longest)


class QueueMetrics:
    """controller-runtime's `workqueue_*` series on one registry, for every queue `watch`ed by name."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._queues: dict[str, QueueStats] = {}
        r = registry
        self.adds = Counter(c.M_WORKQUEUE_ADDS, "Total number of adds handled by workqueue", QUEUE_LABELS, registry=r)
        self.latency = Histogram(
            c.M_WORKQUEUE_QUEUE_DURATION,
            "How long in seconds an item stays in workqueue before being requested",
            QUEUE_LABELS,
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.work = Histogram(
            c.M_WORKQUEUE_WORK_DURATION,
            "How long in seconds processing an item from workqueue takes.",
            QUEUE_LABELS,
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            c.M_WORKQUEUE_RETRIES, "Total number of retries handled by workqueue", QUEUE_LABELS, registry=r
        )
        r.register(_QueueCollector(self._queues))

    def watch(self, name: str, queue: QueueStats) -> QueueInstruments:
        self._queues[name] = queue
        return QueueInstruments(
            self.adds.labels(name, name),
            self.latency.labels(name, name),
            self.work.labels(name, name),
            self.retries.labels(name, name),
        )


def _standard(registry: CollectorRegistry) -> None:
    """The process and platform series and the build's version, on a component's own registry."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    build = Gauge(
        c.M_BUILD_INFO, "Always 1; the labels say which sandkeep and Python.", ["version", "python"], registry=registry
    )
    build.labels(version=__version__, python=platform.python_version()).set(1)


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        _standard(r)
        self.sandboxes = Gauge(c.M_SANDBOXES, "RetainedSandboxes by phase and node.", ["phase", "node"], registry=r)
        self.deletions_requested = Counter(
            c.M_DELETIONS_REQUESTED,
            "DELETE requests issued for expired sandboxes and for quotas (QuotaExceeded), by reason.",
            ["reason"],
            registry=r,
        )
        self.expiry_lag = Histogram(
            c.M_EXPIRY_LAG, "Seconds from a sandbox's deadline to its delete request.", buckets=LAG_BUCKETS, registry=r
        )
        self.reconcile_errors = Counter(
            c.M_RECONCILE_ERRORS, "Reconcile attempts that failed, by component.", ["component"], registry=r
        )
        self.queues = QueueMetrics(r)
        self.reconcile_total = Counter(
            c.M_RECONCILE_TOTAL, "Total number of reconciliations per controller", ["controller", "result"], registry=r
        )
        self.reconcile_errors_total = Counter(
            c.M_RECONCILE_ERRORS_TOTAL,
            "Total number of reconciliation errors per controller",
            ["controller"],
            registry=r,
        )
        self.reconcile_time = Histogram(
            c.M_RECONCILE_TIME,
            "Length of time per reconciliation per controller",
            ["controller"],
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.pins_active = Gauge(c.M_PINS_ACTIVE, "Sandboxes with a valid, unexpired pin.", registry=r)
        self.past_max_age = Gauge(
            c.M_PAST_MAX_AGE,
            "Sandboxes past their hard end (createdAt + maxAge) still there: held by a live user, or dry-run.",
            ["namespace"],
            registry=r,
        )
        self.leader = Gauge(c.M_LEADER, "1 while this replica holds the leader lease and acts.", registry=r)
        self.events_dropped = Counter(
            c.M_EVENTS_DROPPED, "Events not posted because the backlog of unsent Events was full.", registry=r
        )
        self.warn_notices = Counter(
            c.M_WARN_NOTICES,
            "warnWebhook notices by result: sent, retried (an attempt failed), failed (given up), dropped (no room).",
            ["result"],
            registry=r,
        )
        self.quota_unrelieved = Gauge(
            c.M_QUOTA_UNRELIEVED,
            "1 while a namespace is over its SandboxPolicy's quota with only pinned or held sandboxes left.",
            ["namespace"],
            registry=r,
        )


class AgentMetrics:
    """Every sandkeep series but build_info carries the node's name, so one dashboard and one rule set cover
    every node (the process series are the scrape target's, which Prometheus labels with the Pod)."""

    def __init__(self, node: str, registry: CollectorRegistry | None = None) -> None:
        self.node = node
        self.registry = registry or CollectorRegistry()
        _standard(self.registry)
        self.queues = QueueMetrics(self.registry)
        gauge = partial(Gauge, registry=self.registry)
        counter = partial(Counter, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry, buckets=DURATION_BUCKETS)
        node_, by_phase, by_reason = ["node"], ["node", "phase"], ["node", "reason"]
        self.sandboxes = gauge(c.M_AGENT_SANDBOXES, "Sandboxes on this node's disk by phase.", by_phase)
        self.retained_bytes = gauge(c.M_RETAINED_BYTES, "Bytes retained on this node by phase.", by_phase)
        self.tombstones = gauge(c.M_TOMBSTONES, "Tombstones in this node's root.", node_)
        self.tombstones_stuck = gauge(c.M_TOMBSTONES_STUCK, "Tombstones past the stuck threshold.", node_)
        self.tombstone_stuck_oldest = gauge(
            c.M_TOMBSTONE_STUCK_OLDEST, "Age in seconds of the oldest stuck tombstone (0 when none).", node_
        )
        self.deletions = counter(c.M_DELETIONS, "Directories deleted from disk, by reason.", by_reason)
        self.deletion_failures = counter(c.M_DELETION_FAILURES, "Deletion attempts that failed, by reason.", by_reason)
        self.deletion_duration = histogram(c.M_DELETION_DURATION, "Seconds to delete one tombstone.", node_)
        self.scan_duration = histogram(c.M_SCAN_DURATION, "Seconds for one scan of the root (without sizes).", node_)
        self.inuse_scans = counter(c.M_INUSE_SCANS, "Passes over /proc answering whether sandboxes are in use.", node_)
        self.in_use_holds = gauge(c.M_IN_USE_HOLDS, "Sandboxes held because something uses them.", node_)
        self.quarantined = gauge(
            c.M_QUARANTINED, "Root entries no object can own (quarantined until their grace ends), by cause.", by_reason
        )
        self.quarantine_deletions = counter(
            c.M_QUARANTINE_DELETIONS, "Unadoptable entries deleted after their quarantine grace, by cause.", by_reason
        )
        self.root_size = gauge(c.M_ROOT_SIZE, "Size of the filesystem holding the root.", node_)
        self.root_avail = gauge(c.M_ROOT_AVAIL, "Bytes available on the filesystem holding the root.", node_)
        self.heartbeat = gauge(c.M_HEARTBEAT, "Unix time of the agent's last completed pass.", node_)
        self.pressure_unrelieved = gauge(
            c.M_PRESSURE_UNRELIEVED, "1 while the root is above its high watermark with nothing releasable.", node_
        )
        self.pressure_releases = counter(
            c.M_PRESSURE_RELEASES, "Sandboxes released (delete requested) for disk pressure.", node_
        )


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    healthy: Callable[[], bool]
    ready: Callable[[], bool]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/livez"):
            ok = type(self).healthy()
            self._send(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")
        elif path == "/readyz":
            ok = type(self).ready()
            self._send(200 if ok else 503, b"ok\n" if ok else b"not ready\n")
        else:
            self._send(404, b"not found\n")

    def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes every 15 s would drown the log
        return


def serve(
    registry: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    healthy: Callable[[], bool] = lambda: True,
    ready: Callable[[], bool] = lambda: True,
) -> ThreadingHTTPServer:
    """Serve /metrics, /healthz and /readyz on host:port (0 = any free port; read `server_port`)."""
    handler = type(
        "Handler", (_Handler,), {"registry": registry, "healthy": staticmethod(healthy), "ready": staticmethod(ready)}
    )
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def series_names() -> set[str]:
    """Every series name the two components can export, as Prometheus sees it (counters with `_total`,
    histograms with `_bucket`/`_sum`/`_count`): what alert rules, dashboards and docs may refer to."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
    names: set[str] = set()
    for registry in (ControllerMetrics().registry, AgentMetrics("n1").registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in suffixes.get(family.type, ()))
    return names
