"""`sandkeep uninstall`: what `helm uninstall` runs first (the chart's pre-delete hook), so that nothing is stranded.

Every RetainedSandbox carries the agent's finalizer. Once the agents are gone nothing removes it, so a
sandbox deleted afterwards (by a person, by its namespace's deletion, by the CRD's) would stay
Terminating forever, and its namespace with it. Before the chart's objects go, this command:

1. with `--sandboxes delete`: deletes every RetainedSandbox while the agents still run, and waits until
   the agents have deleted their directories and released them (in-use ones are held, as always). If
   some are still there at `--timeout`, it lists them and fails, so the uninstall stops with everything
   in place: free them, or uninstall with `--sandboxes keep`.
2. stops the agents: deletes their DaemonSet and waits until none of its Pods is left, so no agent can
   add its finalizer back;
3. removes the agent's finalizer from every RetainedSandbox left (with `--sandboxes keep`: all of them; the
   directories stay on the nodes and a reinstall adopts them again). Each patch tests that the finalizer
   it removes is the agent's at the index read, so any other finalizer stays.

Idempotent: a second run (a retried hook) finds nothing to do. Exit 0 when done, 1 when sandboxes could
not be deleted in time (step 1), 2 on bad arguments or a cluster it cannot read.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

from controller.api import kube
from controller.api.kube import Kube, KubeError
from controller.observe import logs
from controller.rules import contracts as c
from controller.rules import flags, objects
from controller.rules.durations import Invalid, parse_duration
from controller.rules.objects import Obj, finalizers

log = logging.getLogger("sandkeep.uninstall")
POLL = 1.0  # seconds between looks while waiting
SHOWN = 20  # sandboxes named when some are left


def _ref(obj: Obj) -> str:
    namespace, name = objects.key_of(obj)
    return f"{namespace}/{name}"


def remaining(client: Kube) -> tuple[int, list[str]]:
    """How many sandboxes exist, and the first few of them by name (one small list request)."""
    page = client.request("GET", kube.sandbox_path(), query={"limit": str(SHOWN)})
    items = page.get("items", [])
    more = int((page.get("metadata") or {}).get("remainingItemCount") or 0)
    return len(items) + more, [_ref(o) for o in items]


def _wait(what: str, done: Callable[[], bool], timeout: float) -> bool:
    limit = time.monotonic() + timeout
    while not done():
        if time.monotonic() > limit:
            return False
        logs.say(log, "waiting", what=what)
        time.sleep(POLL)
    return True


def delete_all(client: Kube, timeout: float) -> tuple[int, list[str]]:
    """Delete every sandbox and wait for the agents to release them; how many are left at the timeout."""
    for obj in client.iter_sandboxes():
        if obj["metadata"].get("deletionTimestamp"):
            continue
        try:
            client.request("DELETE", kube.sandbox_path(*objects.key_of(obj)))
        except KubeError as err:
            if not err.not_found:
                raise
    what = f"every RetainedSandbox deleted by its node's agent (up to {timeout:.0f}s)"
    _wait(what, lambda: remaining(client)[0] == 0, timeout)
    return remaining(client)


def stop_agents(client: Kube, namespace: str, daemonset: str, timeout: float) -> bool:
    """Delete the agents' DaemonSet (a no-op when it is gone) and wait until none of its Pods is left."""
    path = f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{daemonset}"
    try:
        found: Obj = client.request("GET", path)
    except KubeError as err:
        if not err.not_found:
            raise
        found = {}
    labels = ((found.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    if found:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground"}
        try:
            client.request("DELETE", path, body=body)
        except KubeError as err:
            if not err.not_found:
                raise
        logs.say(log, "agents_stopping", daemonset=f"{namespace}/{daemonset}")

    def stopped() -> bool:
        try:
            client.request("GET", path)
            return False  # still there: its Pods are being deleted (foreground)
        except KubeError as err:
            if not err.not_found:
                raise
        if not selector:
            return True
        pods = client.request("GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector})
        return not pods.get("items")

    return _wait(f"the agents' DaemonSet {namespace}/{daemonset} and its Pods gone", stopped, timeout)


def release_all(client: Kube) -> int:
    """Remove the agent's finalizer from every sandbox that has it; how many were released."""
    released = 0
    for obj in client.iter_sandboxes():
        while c.FINALIZER in finalizers(obj):
            try:
                client.remove_finalizer(obj, c.FINALIZER)
                released += 1
                break
            except KubeError as err:
                if err.not_found:
                    break
                if not err.conflict:
                    raise
                fresh = client.get_sandbox(*objects.key_of(obj))  # changed since the list: read it again
                if fresh is None:
                    break
                obj = fresh
    return released


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    flags.add_renamed(parser, "--install-namespace", "--namespace", help="the namespace sandkeep is installed in")
    parser.add_argument("--agent-daemonset", required=True, help="the name of the agents' DaemonSet")
    parser.add_argument(
        "--sandboxes",
        choices=("keep", "delete"),
        default="keep",
        help="keep: leave every directory on its node and release the objects (default); "
        "delete: have the agents delete every sandbox first",
    )
    parser.add_argument("--timeout", default="10m", help="how long to wait for each step (default 10m)")


def run(command: str, args: argparse.Namespace) -> int:
    if not args.install_namespace:  # required, in either spelling
        print("sandkeep uninstall: --install-namespace is required", file=sys.stderr)
        return 2
    timeout = parse_duration(args.timeout)
    if isinstance(timeout, Invalid):
        print(f"sandkeep uninstall: --timeout {timeout}", file=sys.stderr)
        return 2
    seconds = timeout.total_seconds()
    try:
        client = Kube(kube.load_config(args.kubeconfig), component="sandkeep-uninstall")
    except Exception as err:
        print(f"sandkeep uninstall: cannot reach the cluster: {err}", file=sys.stderr)
        return 2
    try:
        if args.sandboxes == "delete":
            count, first = delete_all(client, seconds)
            if count:
                names = ", ".join(first) + (" ..." if count > len(first) else "")
                print(
                    f"sandkeep uninstall: {count} RetainedSandboxes are still there after {args.timeout} "
                    f"(held: in use, or their node's agent is not running): {names}. Nothing was uninstalled; "
                    "free them (`sandkeep doctor` says what holds each) and run the uninstall again, or "
                    "keep their directories with --sandboxes keep (chart value uninstall.sandboxes=keep)",
                    file=sys.stderr,
                )
                return 1
        if not stop_agents(client, args.install_namespace, args.agent_daemonset, seconds):
            print(
                f"sandkeep uninstall: the agents ({args.install_namespace}/{args.agent_daemonset}) did not stop within "
                f"{args.timeout}; no finalizer was removed, since a running agent adds its finalizer back",
                file=sys.stderr,
            )
            return 1
        released = release_all(client)
    except KubeError as err:
        print(f"sandkeep uninstall: {err}", file=sys.stderr)
        return 2
    finally:
        client.close()
    logs.say(log, "uninstalled", sandboxes=args.sandboxes, released=released)
    print(
        f"sandkeep uninstall: agents stopped; the finalizer {c.FINALIZER} removed from {released} "
        "RetainedSandboxes" + ("; their directories stay on the nodes" if args.sandboxes == "keep" else "")
    )
    return 0
