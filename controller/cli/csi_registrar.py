"""`sandkeep csi-registrar`: registers sandkeep's CSI node plugin with the kubelet, as a sidecar beside the agent.

The kubernetes-csi node-driver-registrar's job, with its flag names, done here because its Go module is not
served by the Go module proxy this project builds from (docs/csi.md). It keeps the sidecar's separation: the
plugin (in the agent) only serves CSI; this process, in its own container, tells the kubelet where it is:

1. wait, with backoff, until the plugin's socket (`--csi-address`) answers Identity.GetPluginInfo with
   sandkeep's driver name;
2. serve the kubelet's pluginregistration.v1 Registration service on
   `<--plugin-registration-path>/<driver>-reg.sock`, the directory the kubelet's plugin watcher watches;
   GetInfo answers a CSIPlugin of that name at `--kubelet-registration-path` (the plugin's socket as the
   kubelet sees it), for CSI 1.0.0;
3. when the kubelet reports the registration failed, log its error and exit 1, so the container restarts and
   registers again; on SIGTERM or SIGINT remove the socket and exit 0.
"""

from __future__ import annotations

import argparse
import http.server
import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

import grpc

from controller.csi import sockets
from controller.csi.proto import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from controller.observe import logs
from controller.rules.contracts import CSI_DRIVER, Reason
from controller.rules.durations import Invalid, parse_duration

log = logging.getLogger("sandkeep.csi-registrar")

PLUGIN_TYPE = "CSIPlugin"  # the kubelet's plugin type for CSI drivers
SUPPORTED_VERSIONS = ["1.0.0"]  # the CSI versions the kubelet may speak to the plugin
FIRST_RETRY = 0.5  # seconds before probing the plugin again; doubled after each failure, up to LAST_RETRY
LAST_RETRY = 30.0


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--csi-address",
        default="/run/csi/socket",
        help="the plugin's unix socket as this container sees it (default /run/csi/socket)",
    )
    parser.add_argument(
        "--kubelet-registration-path",
        required=True,
        help="the plugin's unix socket as the kubelet sees it, e.g. /var/lib/kubelet/plugins/csi.sandkeep.io/csi.sock",
    )
    parser.add_argument(
        "--plugin-registration-path",
        default="/registration",
        help="the kubelet's plugin registration directory as this container sees it (default /registration)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve GET /healthz on this port (0: any free port; default: not served)",
    )
    parser.add_argument("--timeout", default="1s", help="how long one call to the plugin may take (default 1s)")


def run(command: str, args: argparse.Namespace) -> int:
    timeout = parse_duration(args.timeout)
    if isinstance(timeout, Invalid) or not timeout:
        print(f"sandkeep csi-registrar: --timeout {timeout}: a duration above 0, e.g. 1s", file=sys.stderr)
        return 2
    if not args.kubelet_registration_path.startswith("/"):
        print("sandkeep csi-registrar: --kubelet-registration-path must be an absolute path", file=sys.stderr)
        return 2
    done = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    if not wait_for_plugin(Path(args.csi_address), timeout.total_seconds(), done):
        logs.say(log, "registrar_stopped", registered=False, message="stopped before the plugin answered")
        return 0
    registration = Registration(args.kubelet_registration_path, done)
    server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="registration"))
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(registration, server)
    path = Path(args.plugin_registration_path) / f"{CSI_DRIVER}-reg.sock"
    try:
        placed = sockets.place(path, server.add_insecure_port)
    except (sockets.SocketRefused, OSError) as err:
        logs.say(log, "registrar_refused", level=logging.ERROR, socket=path, message=str(err))
        server.stop(None)
        return 1
    server.start()
    health = _serve_health(args.health_port, placed, registration) if args.health_port is not None else None
    logs.say(
        log,
        "registrar_started",
        driver=CSI_DRIVER,
        socket=path,
        endpoint=args.kubelet_registration_path,
        health_port=health.server_address[1] if health else None,
    )
    while not done.wait(1.0):
        pass
    server.stop(1.0).wait(2.0)
    placed.remove()
    if health:
        health.shutdown()
    logs.say(log, "registrar_stopped", socket=path, registered=registration.registered)
    return 1 if registration.failed is not None else 0


def wait_for_plugin(address: Path, timeout: float, done: threading.Event) -> bool:
    """Probe the plugin until it answers as sandkeep's driver (True), or `done` is set first (False)."""
    delay = FIRST_RETRY
    said = None
    while not done.is_set():
        problem = probe(address, timeout)
        if problem is None:
            logs.say(log, "plugin_found", driver=CSI_DRIVER, address=address)
            return True
        if problem != said:  # each new problem once, not every retry
            logs.say(
                log,
                "plugin_unreachable",
                level=logging.WARNING,
                reason=Reason.PLUGIN_UNREACHABLE,
                address=address,
                message=problem,
                retry_in=delay,
            )
            said = problem
        done.wait(delay)
        delay = min(delay * 2, LAST_RETRY)
    return False


def probe(address: Path, timeout: float) -> str | None:
    """None when the socket at `address` answers GetPluginInfo as sandkeep's driver; else what is wrong."""
    # A fresh channel each time: a kept one reconnects on grpc's own backoff, up to two minutes after the socket
    # appears.
    with grpc.insecure_channel(f"unix:{address}") as channel:
        try:
            info = csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code().name if isinstance(err, grpc.Call) else "ERROR"
            details = err.details() if isinstance(err, grpc.Call) else str(err)
            return f"GetPluginInfo: {code}: {details}"
    if info.name != CSI_DRIVER:
        return f"the socket answers as CSI driver {info.name!r}, not {CSI_DRIVER!r}: is --csi-address sandkeep's?"
    return None


class Registration(pluginregistration_pb2_grpc.RegistrationServicer):
    """What the kubelet's plugin watcher asks: who the plugin is and where; then whether registering worked."""

    def __init__(self, endpoint: str, done: threading.Event) -> None:
        self.endpoint = endpoint
        self.done = done
        self.registered = False
        self.failed: str | None = None  # the kubelet's error, once it said registering failed

    def GetInfo(
        self, request: pluginregistration_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> pluginregistration_pb2.PluginInfo:
        logs.say(log, "registration_asked", driver=CSI_DRIVER, endpoint=self.endpoint)
        return pluginregistration_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=CSI_DRIVER, endpoint=self.endpoint, supported_versions=SUPPORTED_VERSIONS
        )

    def NotifyRegistrationStatus(
        self, request: pluginregistration_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> pluginregistration_pb2.RegistrationStatusResponse:
        if request.plugin_registered:
            self.registered = True
            logs.say(log, "plugin_registered", driver=CSI_DRIVER, endpoint=self.endpoint)
        else:
            # As node-driver-registrar: exit, so the container restarts and the kubelet is asked again.
            self.failed = request.error or "(no error given)"
            logs.say(
                log,
                "registration_failed",
                level=logging.ERROR,
                reason=Reason.REGISTRATION_FAILED,
                driver=CSI_DRIVER,
                error=self.failed[:500],
            )
            self.done.set()
        return pluginregistration_pb2.RegistrationStatusResponse()


def _serve_health(port: int, placed: sockets.Placed, registration: Registration) -> http.server.ThreadingHTTPServer:
    """GET /healthz: 200 while the registration socket is still ours and the kubelet has not refused it."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            healthy = placed.is_ours() and registration.failed is None
            code = 200 if self.path == "/healthz" and healthy else 404 if self.path != "/healthz" else 503
            body = b"ok\n" if code == 200 else f"{placed.path}: not serving\n".encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # the kubelet probes every few seconds
            pass

    # All addresses, as node-driver-registrar's --health-port: the kubelet's httpGet probe comes to the Pod's IP.
    server = http.server.ThreadingHTTPServer(("", port), Health)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
