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
from controller.rules.models import Settings

log = logging.getLogger("sandkeep.agent")


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    """Every flag from its setting's declaration (settings.py: `Flag`); the policy settings it shares with the
    controller are env only here."""
    flags.add_settings_arguments(parser, AgentSettings, without=Settings.model_fields)


def settings_from(args: argparse.Namespace) -> AgentSettings:
    return flags.settings_from(AgentSettings, args)


def _hold_lock(root: Root, settings: AgentSettings, stack: contextlib.ExitStack, port: int) -> bool:
    """Take the root lock, waiting (and saying so, with the port its probes answer on) while another agent
    holds it."""
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
                logs.say(
                    log,
                    "root_locked_waiting",
                    level=logging.WARNING,
                    reason=err.reason,
                    message=str(err),
                    metrics_port=port,
                )
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
        # Served before the root lock: an agent waiting for it (another agent on the node, e.g. an old Pod still
        # stopping) is alive, and not Ready until it holds the lock and its cache is synced.
        agent_metrics = metrics.AgentMetrics(settings.node)
        agent: Agent | None = None
        server = metrics.serve(
            agent_metrics.registry,
            settings.metrics_port,
            settings.metrics_host,
            healthy=lambda: agent is None or agent.healthy(),
            ready=lambda: agent is not None and agent.state.synced,
        )
        stack.callback(server.shutdown)
        if not _hold_lock(root, settings, stack, server.server_port):
            return 1
        limiter = kube.RateLimiter.of(settings.kube_qps, settings.kube_burst)
        client = Kube(kube.load_config(settings.kubeconfig), component="sandkeep-agent", limiter=limiter)
        agent = Agent(settings, client, root, agent_metrics)
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
