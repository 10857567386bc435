"""`sandkeep controller`: its flags, and its start and stop (the election, the watches, the workers, /metrics)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
from concurrent.futures import ThreadPoolExecutor

from controller.api import listwatch
from controller.api.kube import Kube, RateLimiter, load_config
from controller.api.leases import LeaderElector
from controller.cluster.controller import Controller, build_registry, sandbox_watches
from controller.cluster.settings import COMPONENT, ControllerSettings
from controller.observe import logs, metrics
from controller.rules import contracts as c
from controller.rules import flags

log = logging.getLogger("sandkeep.controller")


async def serve(settings: ControllerSettings, ready: asyncio.Event | None = None) -> Controller:
    """Run the controller until cancelled or signalled (kopf handles SIGTERM/SIGINT)."""
    # Every API call runs in a thread (the official client is synchronous): enough threads for every
    # worker plus the Events and the election, or expiries queue behind each other.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(settings.workers + 4, "api"))
    kube = Kube(
        load_config(settings.kubeconfig), COMPONENT, limiter=RateLimiter.of(settings.kube_qps, settings.kube_burst)
    )
    metrics_ = metrics.ControllerMetrics()
    ctl = Controller(kube, settings, metrics_)
    elector = LeaderElector(
        kube, settings.lease_namespace, c.CONTROLLER_LEASE, settings.identity, settings.lease_duration
    )

    statuses: set[asyncio.Task[None]] = set()

    async def leadership(leading: bool) -> None:
        metrics_.leader.set(1 if leading else 0)
        if leading:
            ctl.enqueue_all()
            ctl.quota.check_all()
            if ctl.sessions is not None:
                ctl.sessions.collect_all()
            # Off the election's loop: renewing the Lease never waits on these writes.
            statuses.add(task := asyncio.create_task(ctl.write_all_policy_statuses(), name="policy-statuses"))
            task.add_done_callback(statuses.discard)

    elector.on_change = leadership
    ctl.is_leader = lambda: elector.is_leader
    tasks = [asyncio.create_task(ctl.worker(), name=f"worker-{i}") for i in range(settings.workers)]
    tasks.append(asyncio.create_task(ctl.quota_worker(), name="quotas"))
    if ctl.sessions is not None:
        ctl.sessions.is_leader = ctl.is_leader
        tasks.append(asyncio.create_task(ctl.sessions_worker(), name="sessions"))

    def healthy() -> bool:
        return all(not t.done() for t in tasks)

    server = metrics.serve(metrics_.registry, settings.metrics_port, settings.metrics_host, healthy=healthy)
    logs.say(
        log,
        "controller_started",
        identity=elector.identity,
        lease=f"{settings.lease_namespace}/{c.CONTROLLER_LEASE}",
        metrics=f"http://{settings.metrics_host}:{server.server_port}/metrics",
        watch=",".join(settings.watch_namespaces) or "cluster",
    )
    http = listwatch.http_session(kube)
    tasks += [asyncio.create_task(w.run(http), name=f"watch-{w.path}") for w in sandbox_watches(ctl)]
    election = asyncio.create_task(elector.run(), name="leader-election")
    kopf_settings = listwatch.operator_settings(discover=not settings.watch_namespaces)  # names: nothing to scan
    operator = listwatch.run(build_registry(ctl), kopf_settings, namespaces=settings.watch_namespaces)
    if ready is not None:
        ready.set()
    try:
        await asyncio.wait([operator, election, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        logs.say(log, "controller_stopping", identity=elector.identity)
        for task in (*tasks, operator):
            task.cancel()
        election.cancel()
        await asyncio.gather(election, *tasks, operator, return_exceptions=True)
        await http.close()
        server.shutdown()
        metrics_.leader.set(0)
        kube.close()
        logs.say(log, "controller_stopped", identity=elector.identity)
    return ctl


# --- the command -----------------------------------------------------------------------------------------
def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig path (default: in-cluster, else $KUBECONFIG)")
    flags.add_renamed(
        parser, "--lease-namespace", "--namespace", help="namespace of the leader Lease (env SANDKEEP_LEASE_NAMESPACE)"
    )
    parser.add_argument(
        "--watch-namespace",
        action="append",
        dest="watch_namespaces",
        help="watch only this namespace (repeatable; default: the whole cluster)",
    )
    parser.add_argument("--metrics-port", type=int, help="port of /metrics and /healthz (0 = any free port)")
    parser.add_argument("--metrics-host", help="address to serve metrics on (default 127.0.0.1)")
    parser.add_argument("--retention", help="cluster default retention window, e.g. 72h")
    parser.add_argument("--max-pin", help="cluster default longest pin, e.g. 30d")
    parser.add_argument("--max-retention", help="ceiling no namespace policy can exceed")
    parser.add_argument("--max-pin-ceiling", help="pin ceiling no namespace policy can exceed")
    parser.add_argument("--dry-run", action="store_true", default=None, help="decide and report, delete nothing")
    parser.add_argument("--node-grace", help="how long a node may be gone before its sandboxes are Lost")
    parser.add_argument("--quota-max-bytes", help="default quota per namespace in bytes (e.g. 50Gi; default none)")
    parser.add_argument("--quota-max-count", type=int, help="default quota per namespace in sandboxes (default none)")
    parser.add_argument("--quota-ceiling-bytes", help="bytes quota no namespace policy can exceed (default none)")
    parser.add_argument("--quota-ceiling-count", type=int, help="count quota no namespace policy can exceed")
    parser.add_argument("--lease-duration", type=int, help="leader Lease duration in seconds (default 15)")
    parser.add_argument("--workers", type=int, help="concurrent reconciles (default 8)")
    parser.add_argument(
        "--kube-qps",
        type=float,
        help="API requests per second on average; negative: no client-side limit (default -1, the server's APF)",
    )
    parser.add_argument("--kube-burst", type=int, help="API requests at once above the average (default 200)")
    parser.add_argument("--identity", help="leader-election identity (default hostname_pid)")
    parser.add_argument(
        "--sessions",
        action="store_true",
        default=None,
        help="serve SandboxSessions: a Pod in the sandbox's own namespace (default: off)",
    )
    parser.add_argument("--sessions-image", help="image of a session that names none")
    parser.add_argument("--sessions-max-lifetime", help="longest session lifetime (default 8h)")
    parser.add_argument("--sessions-run-as-user", type=int, help="uid of a session whose workspace owner is unknown")
    parser.add_argument(
        "--sessions-admission-binding", help="ValidatingAdmissionPolicyBinding that proves a session's user"
    )
    parser.add_argument(
        c.SESSIONS_ADMISSION_POLICY, help="the policy that binding must bind (default: the binding's name)"
    )
    parser.add_argument(
        c.SESSIONS_MAX_PER_USER.flag, type=int, help="live sessions one user may have, cluster-wide (default 3)"
    )
    parser.add_argument(
        c.SESSIONS_MAX_PER_NAMESPACE.flag, type=int, help="live sessions a namespace may have (default 20)"
    )
    parser.add_argument(
        c.SESSIONS_MIN_OWNER_ID.flag,
        type=int,
        help="lowest workspace owner uid/gid a session runs as; lower ones run as --sessions-run-as-user",
    )
    parser.add_argument(
        c.SESSIONS_ALLOWED_IMAGE,
        action="append",
        dest="sessions_allowed_images",
        help="an image sessions may run besides --sessions-image (repeat for each)",
    )
    parser.add_argument(c.SESSIONS_RESOURCES, help="JSON: the session container's requests and limits")
    parser.add_argument(c.SESSIONS_TOLERATIONS, help="JSON list: the agent's tolerations (bound a session's)")


def settings_from(args: argparse.Namespace) -> ControllerSettings:
    return flags.settings_from(ControllerSettings, args)


def _fewer_malloc_arenas() -> None:
    """glibc gives each thread its own malloc arena, and freed JSON stays spread over all of them.

    Measured at 10,000 sandboxes: 272 MiB peak RSS with the default, far less with two arenas. Only
    glibc has mallopt; elsewhere this does nothing.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX = 2


def run(command: str, args: argparse.Namespace) -> int:
    _fewer_malloc_arenas()
    try:
        settings = settings_from(args)
    except ValueError as err:
        print(f"sandkeep controller: refused to start: {err}")
        return 2
    asyncio.run(serve(settings))
    return 0
