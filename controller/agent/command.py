"""`sandkeep agent`: flags, settings, the root lock, and starting the runtime."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Collection

from controller.agent.runtime import Agent
from controller.agent.settings import AgentSettings
from controller.api import kube
from controller.api.kube import Kube
from controller.node.inuse import uninspectable_pids
from controller.node.store import Root, RootRefused
from controller.observe import logs, metrics
from controller.rules import flags
from controller.rules.contracts import Reason

log = logging.getLogger("sandkeep.agent")


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", help="this node's name (env SANDKEEP_NODE)")
    parser.add_argument("--root", help="the node's sandbox root (env SANDKEEP_ROOT)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    flags.add_renamed(
        parser,
        "--lease-namespace",
        "--namespace",
        help="namespace of the heartbeat Lease (env SANDKEEP_LEASE_NAMESPACE)",
    )
    parser.add_argument("--metrics-port", type=int, help="port for /metrics /healthz /readyz (0: any free port)")
    parser.add_argument("--metrics-host", help="address to serve metrics on (default 127.0.0.1)")
    parser.add_argument("--scan-interval", help="time between full passes (default 30s)")
    parser.add_argument("--stuck-after", help="age at which a tombstone counts as stuck (default 10m)")
    parser.add_argument("--relog-every", help="how often a stuck tombstone is logged again (default 24h)")
    parser.add_argument("--orphan-timeout", help="how long a killed orphan command may take to end (default 10s)")
    parser.add_argument("--lock-wait", help="give up after waiting this long for the root lock (default: forever)")
    parser.add_argument(
        "--quarantine-grace",
        help="how long the agent watches an entry no object can own (no or a bad manifest, a missing namespace, "
        "a link, a bad name) before deleting it (default 24h; 0: never delete, only report)",
    )
    parser.add_argument("--ignore-pid", type=int, action="append", dest="ignore_pids", help="a pid vouched for")
    parser.add_argument(
        "--pressure-high",
        type=float,
        help="used percent of the root's filesystem above which sandboxes are released "
        "(default 85, below the kubelet's eviction at nodefs.available<10%%; 100: never)",
    )
    parser.add_argument("--pressure-low", type=float, help="used percent releasing stops under (default 80)")
    parser.add_argument("--kube-qps", type=float, help="API requests per second on average (default 20)")
    parser.add_argument("--kube-burst", type=int, help="API requests at once above the average (default 40)")
    parser.add_argument(
        "--pressure-min-free-bytes", type=int, help="also release while fewer bytes than this are available (default 0)"
    )
    parser.add_argument(
        "--size-budget",
        help="how long measuring one sandbox may take; past it the bytes counted so far are reported, with "
        "condition SizePartial (default 2m; 0: no limit)",
    )


def settings_from(args: argparse.Namespace) -> AgentSettings:
    return flags.settings_from(AgentSettings, args)


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
        limiter = kube.RateLimiter.of(settings.kube_qps, settings.kube_burst)
        client = Kube(kube.load_config(settings.kubeconfig), component="sandkeep-agent", limiter=limiter)
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
