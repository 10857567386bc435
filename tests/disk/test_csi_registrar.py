"""`sandkeep csi-registrar` as a real process: it waits for a real plugin socket, serves the kubelet's
pluginregistration.v1 Registration service, and is called with grpcio's client as the kubelet's plugin watcher
calls it; signals, a refused registration and what it leaves behind, checked on the real files.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from controller.csi import server as csi_server
from controller.csi import sockets
from controller.csi.proto import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from controller.rules.contracts import CSI_DRIVER
from tests.bed.agentkit import wait_for
from tests.bed.csikit import REGISTRATION_PATH, RecordingVolumes, channel, socket_dir

REPO = Path(__file__).resolve().parents[2]
REG_SOCKET = f"{CSI_DRIVER}-reg.sock"
SANDKEEP = [sys.executable, "-m", "controller.cli.sandkeep"]


@dataclass
class Registrar:
    proc: subprocess.Popen[bytes]
    log_path: Path
    reg_dir: Path

    @property
    def socket(self) -> Path:
        return self.reg_dir / REG_SOCKET

    def log(self) -> str:
        return self.log_path.read_text()

    def registration(self) -> pluginregistration_pb2_grpc.RegistrationStub:
        return pluginregistration_pb2_grpc.RegistrationStub(channel(self.socket))

    def wait_serving(self) -> None:
        wait_for(lambda: "registrar_started" in self.log() or self.proc.poll() is not None, 90, "registrar start")
        assert self.proc.poll() is None, self.log()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with socket_dir() as path:
        yield path


@pytest.fixture
def registrar(sock_dir: Path, tmp_path: Path, pids: list[int]) -> Iterator[Callable[..., Registrar]]:
    """Start `sandkeep csi-registrar` for a plugin socket; killed by pid at the end if still running."""
    started: list[Registrar] = []

    def start(csi_address: Path, *extra: str) -> Registrar:
        reg_dir = sock_dir / "plugins_registry"
        log_path = tmp_path / f"registrar-{len(started)}.log"
        args = [
            *SANDKEEP,
            "csi-registrar",
            f"--csi-address={csi_address}",
            f"--kubelet-registration-path={REGISTRATION_PATH}",
            f"--plugin-registration-path={reg_dir}",
            *extra,
        ]
        with log_path.open("wb") as out:
            proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        pids.append(proc.pid)
        started.append(Registrar(proc, log_path, reg_dir))
        return started[-1]

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.stop(signal.SIGKILL)


@pytest.fixture
def plugin(sock_dir: Path) -> Iterator[Path]:
    path = sock_dir / "csi" / "csi.sock"
    serving = csi_server.serve(path, "node-a", RecordingVolumes(), "/var/lib/kubelet")
    yield path
    serving.stop(grace=1.0)


def test_the_kubelet_gets_the_drivers_info_and_a_registration_keeps_it_serving_until_sigterm(
    registrar: Callable[..., Registrar], plugin: Path, sock_dir: Path
) -> None:
    reg_dir = sock_dir / "plugins_registry"
    reg_dir.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(reg_dir / REG_SOCKET))  # left by a registrar that was killed
    stale.close()
    r = registrar(plugin, "--health-port=0")
    r.wait_serving()
    st = os.lstat(r.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert sorted(p.name for p in reg_dir.iterdir()) == [REG_SOCKET]  # the watcher sees only the socket

    info = r.registration().GetInfo(pluginregistration_pb2.InfoRequest(), timeout=10)
    assert (info.type, info.name, info.endpoint) == ("CSIPlugin", CSI_DRIVER, REGISTRATION_PATH)
    assert list(info.supported_versions) == ["1.0.0"]
    status = pluginregistration_pb2.RegistrationStatus(plugin_registered=True)
    r.registration().NotifyRegistrationStatus(status, timeout=10)
    wait_for(lambda: "plugin_registered" in r.log(), 30, "the registration logged")
    port = int(r.log().split("health_port=")[1].split()[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
        assert answer.status == 200
    assert r.proc.poll() is None

    assert r.stop() == 0
    assert not r.socket.exists()
    assert "registrar_stopped" in r.log() and "registered=True" in r.log()


def test_the_registrar_waits_for_the_plugin_then_exits_1_when_the_kubelet_refuses_the_registration(
    registrar: Callable[..., Registrar], sock_dir: Path
) -> None:
    address = sock_dir / "csi" / "csi.sock"
    r = registrar(address)
    wait_for(lambda: "plugin_unreachable" in r.log(), 90, "the first probe")
    assert not r.socket.exists()
    serving = csi_server.serve(address, "node-a", RecordingVolumes(), "/var/lib/kubelet")
    try:
        r.wait_serving()  # found on a retry, within the backoff
        assert r.log().count("plugin_unreachable") == 1  # the same problem is said once, not per retry
        assert "reason=PluginUnreachable" in r.log()
        refused = pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error="no CSI 1.0.0 here")
        r.registration().NotifyRegistrationStatus(refused, timeout=10)
        assert r.proc.wait(timeout=60) == 1
    finally:
        serving.stop(grace=1.0)
    line = next(line for line in r.log().splitlines() if "registration_failed" in line)
    assert line.split()[1] == "error" and "reason=RegistrationFailed" in line and "no CSI 1.0.0 here" in line
    assert not r.socket.exists()


class _OtherDriver(csi_pb2_grpc.IdentityServicer):
    def GetPluginInfo(
        self, request: csi_pb2.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name="hostpath.csi.k8s.io", vendor_version="1")


def test_a_socket_of_another_driver_is_never_registered_and_sigterm_while_waiting_exits_0(
    registrar: Callable[..., Registrar], sock_dir: Path
) -> None:
    address = sock_dir / "other" / "csi.sock"
    server = grpc.server(ThreadPoolExecutor(1))
    csi_pb2_grpc.add_IdentityServicer_to_server(_OtherDriver(), server)
    placed = sockets.place(address, server.add_insecure_port)
    server.start()
    try:
        r = registrar(address)
        wait_for(lambda: "hostpath.csi.k8s.io" in r.log(), 90, "the other driver's name reported")
        assert "is --csi-address sandkeep's?" in r.log()
        assert r.stop() == 0
    finally:
        server.stop(None)
        placed.remove()
    assert not (sock_dir / "plugins_registry").exists()  # nothing was ever served


def test_a_link_at_the_registration_socket_is_refused_and_left_alone(
    registrar: Callable[..., Registrar], plugin: Path, sock_dir: Path
) -> None:
    reg_dir = sock_dir / "plugins_registry"
    reg_dir.mkdir()
    (reg_dir / REG_SOCKET).symlink_to(plugin)
    r = registrar(plugin)
    assert r.proc.wait(timeout=90) == 1
    assert "registrar_refused" in r.log() and "a symbolic link" in r.log()
    assert (reg_dir / REG_SOCKET).is_symlink() and os.readlink(reg_dir / REG_SOCKET) == str(plugin)


def test_health_fails_once_the_registration_socket_is_no_longer_ours(
    registrar: Callable[..., Registrar], plugin: Path
) -> None:
    r = registrar(plugin, "--health-port=0")
    r.wait_serving()
    port = int(r.log().split("health_port=")[1].split()[0])
    r.socket.unlink()  # as a kubelet's cleanup of its plugin directory would
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)
    assert caught.value.code == 503
    assert r.stop(signal.SIGINT) == 0
