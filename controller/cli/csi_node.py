"""`sandkeep csi-node`: the CSI node plugin, in its own container of the agent's Pods (issue 27).

It serves the Identity and Node services (controller/csi/) on a unix socket and publishes and unpublishes
captured volumes on the node's root (controller/node/capture.py). It is the one privileged container of
sandkeep: a publish bind-mounts a workspace into the Pod's volume directory under the kubelet's, which needs
Bidirectional mount propagation. Its one API call is a GET of the RetainedSandbox a reopen volume names (the
agent's ServiceAccount may): what a captured volume becomes once its Pod ended is decided by the agent
(controller/agent/capture.py), in its own container, which keeps its narrow privileges. The two processes share
the root's volumes directory and lock each volume's entry between them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from controller.api import kube
from controller.api.kube import Kube
from controller.csi import server as csi_server
from controller.csi.node import SandboxLookup
from controller.csi.sockets import SocketRefused
from controller.node.capture import Volumes
from controller.node.store import Root, RootRefused
from controller.observe import logs
from controller.rules.volume import DEFAULT_KUBELET_DIR

log = logging.getLogger("sandkeep.csi")
API_TIMEOUT = 5.0  # seconds a reopen's GET may take: the kubelet's publish deadline is 2 minutes, and it retries


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default $NODE_NAME)")
    parser.add_argument("--root", default="/var/lib/sandkeep", help="the node's root (default /var/lib/sandkeep)")
    parser.add_argument(
        "--endpoint", default="/csi/csi.sock", help="serve the plugin on this unix socket (default /csi/csi.sock)"
    )
    parser.add_argument(
        "--kubeconfig", help="reach the API with this kubeconfig (default: in-cluster, else $KUBECONFIG)"
    )
    parser.add_argument(
        "--kubelet-dir",
        default=DEFAULT_KUBELET_DIR,
        help=f"the kubelet's --root-dir: every volume's target path is under its pods/ (default {DEFAULT_KUBELET_DIR})",
    )


def run(command: str, args: argparse.Namespace) -> int:
    for flag, value in (("--root", args.root), ("--kubelet-dir", args.kubelet_dir), ("--endpoint", args.endpoint)):
        if not value.startswith("/"):
            print(f"sandkeep csi-node: {flag} {value}: must be an absolute path", file=sys.stderr)
            return 2
    if not args.node:
        print("sandkeep csi-node: --node (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    try:
        root = Root(args.root)
    except RootRefused as err:
        logs.say(log, "csi_plugin_refused", level=logging.ERROR, reason=err.reason, message=str(err))
        return 1
    done = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        serving = csi_server.serve(
            Path(args.endpoint), args.node, Volumes(root), args.kubelet_dir, _sandboxes(args.kubeconfig)
        )
    except (SocketRefused, OSError) as err:
        logs.say(log, "csi_plugin_refused", level=logging.ERROR, socket=args.endpoint, message=str(err))
        return 1
    while not done.wait(1.0):
        pass
    serving.stop()
    return 0


def _sandboxes(kubeconfig: str | None) -> SandboxLookup | None:
    """The reopen's lookup: one GET of a RetainedSandbox, bounded. None (reopens refused, captures served) when
    no configuration loads: a plugin without API access still gives Pods their fresh workspaces."""
    try:
        client = Kube(kube.load_config(kubeconfig), component="sandkeep-csi-node", timeout=API_TIMEOUT)
    except Exception as err:
        logs.say(log, "csi_plugin_no_api", level=logging.WARNING, error=repr(err)[:300], action="reopens are refused")
        return None
    return client.get_sandbox
