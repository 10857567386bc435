"""Serving the plugin: the Identity and Node services on one unix socket, in a bounded pool of threads.

The gRPC server is grpcio's threaded one, apart from the agent's event loop: a pass stuck on a slow disk never
holds up a Pod's mount, and a backend call (blocking disk work) runs in the pool thread that took its RPC.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from controller.csi import sockets
from controller.csi.identity import IdentityService
from controller.csi.node import NodeService, SandboxLookup, VolumeBackend
from controller.csi.proto import csi_pb2_grpc
from controller.observe import logs
from controller.rules.contracts import CSI_DRIVER

log = logging.getLogger("sandkeep.csi")

# RPCs served at once, so at most this many backend calls run together (a publish is a mkdir, an unpublish a
# rename: short, but they may wait on a busy disk). More wait in grpc's queue, up to MAX_PENDING in all; past
# that the kubelet gets RESOURCE_EXHAUSTED and retries with its backoff.
WORKERS = 8
MAX_PENDING = 256
MAX_MESSAGE = 1 << 20  # a publish is a few hundred bytes of attributes; anything near this is not the kubelet
STOP_GRACE = 5.0  # seconds an RPC in flight gets to finish when the agent stops


@dataclass
class Serving:
    """A running plugin server and the socket it serves on."""

    server: grpc.Server
    socket: sockets.Placed
    node_service: NodeService

    def stop(self, grace: float = STOP_GRACE) -> None:
        self.server.stop(grace).wait(grace + 1.0)
        self.socket.remove()
        logs.say(log, "csi_plugin_stopped", socket=self.socket.path)


def serve(
    endpoint: Path, node: str, backend: VolumeBackend, kubelet_dir: str, sandboxes: SandboxLookup | None = None
) -> Serving:
    """Start the plugin on the unix socket `endpoint` (SocketRefused when something else is there)."""
    server = grpc.server(
        ThreadPoolExecutor(WORKERS, thread_name_prefix="csi"),
        maximum_concurrent_rpcs=MAX_PENDING,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE)],
    )
    node_service = NodeService(node, backend, kubelet_dir, sandboxes)
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(), server)
    csi_pb2_grpc.add_NodeServicer_to_server(node_service, server)
    try:
        placed = sockets.place(endpoint, server.add_insecure_port)
    except BaseException:
        server.stop(None)
        raise
    server.start()
    logs.say(log, "csi_plugin_started", driver=CSI_DRIVER, socket=endpoint, node=node, kubelet_dir=kubelet_dir)
    return Serving(server, placed, node_service)
