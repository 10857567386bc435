"""The CSI node plugin's protocol half: a real gRPC server on a real unix socket, called by grpcio's client with the
generated stubs, as the kubelet calls it; the backend is tests/csikit.py's in-memory RecordingVolumes.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from controller import __version__
from controller.csi import server as csi_server
from controller.csi import sockets
from controller.csi.proto import csi_pb2, csi_pb2_grpc
from controller.rules.contracts import CSI_DRIVER, POD_INFO_UID, VOLUME_KEEP, Keep
from tests.bed.agentkit import wait_for
from tests.bed.csikit import RecordingVolumes, channel, node_stub, publish_request, socket_dir
from tests.unit.test_volume import POD, TARGET, UID, VOLUME_ID

NODE = "node-a"
KUBELET = "/var/lib/kubelet"


@dataclass
class Plugin:
    path: Path
    serving: csi_server.Serving
    backend: RecordingVolumes
    node: csi_pb2_grpc.NodeStub


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with socket_dir() as path:
        yield path


@pytest.fixture
def plugin(sock_dir: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Plugin]:
    caplog.set_level(logging.DEBUG, "sandkeep.csi")
    backend = RecordingVolumes()
    path = sock_dir / "plugins" / CSI_DRIVER / "csi.sock"
    serving = csi_server.serve(path, NODE, backend, KUBELET)
    try:
        yield Plugin(path, serving, backend, node_stub(path))
    finally:
        if backend.gate is not None:
            backend.gate.set()
        serving.stop(grace=1.0)


def code_of(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    err = caught.value
    assert isinstance(err, grpc.Call)
    return err.code(), err.details() or ""


def target_for(volume: str) -> str:
    return f"{KUBELET}/pods/{UID}/volumes/kubernetes.io~csi/{volume}/mount"


def test_identity_names_the_driver_and_its_version_and_offers_no_controller_service(plugin: Plugin) -> None:
    identity = csi_pb2_grpc.IdentityStub(channel(plugin.path))
    info = identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10)
    assert (info.name, info.vendor_version) == (CSI_DRIVER, __version__)
    assert list(identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest(), timeout=10).capabilities) == []
    assert identity.Probe(csi_pb2.ProbeRequest(), timeout=10).ready.value is True


def test_the_node_is_named_and_takes_the_pods_fs_group_from_the_kubelet(plugin: Plugin) -> None:
    assert plugin.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10).node_id == NODE
    caps = plugin.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
    assert [c.rpc.type for c in caps.capabilities] == [csi_pb2.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP]


def test_a_publish_reaches_the_backend_parsed_and_is_logged_with_its_pod(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    plugin.node.NodePublishVolume(publish_request(attributes={VOLUME_KEEP: "OnFailure"}), timeout=10)
    [req] = plugin.backend.requests
    assert (req.volume_id, req.target_path, req.keep, req.pod_name) == (
        VOLUME_ID,
        TARGET,
        Keep.ON_FAILURE,
        "build-42-x7k2p",
    )
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("volume_published"))
    assert f"volume={VOLUME_ID}" in line and "pod=team-a/build-42-x7k2p" in line and "keep=OnFailure" in line

    plugin.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=VOLUME_ID, target_path=TARGET), timeout=10
    )
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("volume_unpublished"))
    assert f"volume={VOLUME_ID}" in line and "pod=team-a/build-42-x7k2p" in line
    assert plugin.backend.calls == [("publish", VOLUME_ID, TARGET), ("unpublish", VOLUME_ID, TARGET)]


def test_every_node_call_is_idempotent_as_the_kubelet_retries(plugin: Plugin) -> None:
    for _ in range(2):
        plugin.node.NodePublishVolume(publish_request(), timeout=10)
    elsewhere = TARGET.replace("/workspace/", "/other/")
    code, details = code_of(lambda: plugin.node.NodePublishVolume(publish_request(target=elsewhere), timeout=10))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "already published" in details
    unpublish = csi_pb2.NodeUnpublishVolumeRequest(volume_id=VOLUME_ID, target_path=TARGET)
    for _ in range(2):
        plugin.node.NodeUnpublishVolume(unpublish, timeout=10)
    never = csi_pb2.NodeUnpublishVolumeRequest(volume_id="csi-never-published", target_path=TARGET)
    plugin.node.NodeUnpublishVolume(never, timeout=10)  # an unknown volume: done
    assert plugin.backend.published == {}


def test_bad_input_is_the_spec_status_with_the_message_the_user_reads_and_never_reaches_the_backend(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    code, details = code_of(
        lambda: plugin.node.NodePublishVolume(publish_request(attributes={VOLUME_KEEP: "sometimes"}), timeout=10)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith('volumeAttributes.keep is "sometimes"; write Always, OnFailure, Never')
    multi = publish_request(mode=csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER)
    assert code_of(lambda: plugin.node.NodePublishVolume(multi, timeout=10))[0] == grpc.StatusCode.FAILED_PRECONDITION
    block = publish_request()
    block.volume_capability.block.SetInParent()
    assert code_of(lambda: plugin.node.NodePublishVolume(block, timeout=10))[0] == grpc.StatusCode.INVALID_ARGUMENT
    no_capability = publish_request()
    no_capability.ClearField("volume_capability")
    code, details = code_of(lambda: plugin.node.NodePublishVolume(no_capability, timeout=10))
    assert (code, details.split(";")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "the request has no volume_capability")
    outside = publish_request(target="/etc/kubernetes/mount")
    assert code_of(lambda: plugin.node.NodePublishVolume(outside, timeout=10))[0] == grpc.StatusCode.INVALID_ARGUMENT
    empty = csi_pb2.NodeUnpublishVolumeRequest(volume_id="", target_path=TARGET)
    assert code_of(lambda: plugin.node.NodeUnpublishVolume(empty, timeout=10))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert plugin.backend.calls == []
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("volume_refused")]
    assert len(refused) == 6 and all("reason=VolumeRefused" in line for line in refused)


def test_a_backend_failure_is_internal_with_a_short_message_and_logged_with_volume_and_pod(
    plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    plugin.backend.fail = OSError(28, "No space left on device", "/var/lib/sandkeep/private/detail")
    code, details = code_of(lambda: plugin.node.NodePublishVolume(publish_request(), timeout=10))
    assert code == grpc.StatusCode.INTERNAL
    assert details == (
        "sandkeep's node plugin failed (OSError); the sandkeep agent's log on this node has the details under "
        f"volume={VOLUME_ID}"
    )
    assert "Traceback" not in details and "/var/lib/sandkeep" not in details
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("volume_failed"))
    assert f"volume={VOLUME_ID}" in line and "pod=team-a/build-42-x7k2p" in line and "No space left" in line
    assert "reason=AgentError" in line and "rpc=volume_published" in line


def test_the_requests_secrets_are_never_logged(plugin: Plugin, caplog: pytest.LogCaptureFixture) -> None:
    secret = "hunter2-do-not-log"
    with_secrets = publish_request(secrets={"password": secret, "token": secret})
    plugin.node.NodePublishVolume(with_secrets, timeout=10)
    bad = publish_request(attributes={VOLUME_KEEP: "x"}, secrets={"password": secret})
    code_of(lambda: plugin.node.NodePublishVolume(bad, timeout=10))
    plugin.backend.fail = RuntimeError("boom")
    code_of(lambda: plugin.node.NodePublishVolume(with_secrets, timeout=10))
    assert len(caplog.records) >= 3
    assert all(secret not in r.getMessage() and secret not in str(r.__dict__) for r in caplog.records)


def test_every_other_rpc_is_unimplemented(plugin: Plugin) -> None:
    node, ch = plugin.node, channel(plugin.path)
    calls = [
        lambda: node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(volume_id=VOLUME_ID), timeout=10),
        lambda: node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(volume_id=VOLUME_ID), timeout=10),
        lambda: node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(volume_id=VOLUME_ID), timeout=10),
        lambda: node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(volume_id=VOLUME_ID), timeout=10),
        lambda: csi_pb2_grpc.ControllerStub(ch).CreateVolume(csi_pb2.CreateVolumeRequest(name="x"), timeout=10),
    ]
    for call in calls:
        assert code_of(call)[0] == grpc.StatusCode.UNIMPLEMENTED
    assert plugin.backend.calls == []


def test_one_volume_is_served_one_call_at_a_time_and_all_within_the_thread_cap(plugin: Plugin) -> None:
    plugin.backend.gate = threading.Event()
    node = plugin.node
    n = csi_server.WORKERS + 4
    with ThreadPoolExecutor(n + 2) as pool:
        # A publish and the kubelet's retry of it, then many other volumes at once.
        same = [pool.submit(node.NodePublishVolume, publish_request(), timeout=30) for _ in range(2)]
        others = [
            pool.submit(node.NodePublishVolume, publish_request(f"csi-{i}", target_for(f"v{i}")), timeout=30)
            for i in range(n)
        ]
        wait_for(lambda: plugin.backend.running >= csi_server.WORKERS - 1, 30, "the pool's threads busy")
        time.sleep(0.5)  # what else could start, has
        assert plugin.backend.running <= csi_server.WORKERS
        assert [c[1] for c in plugin.backend.calls].count(VOLUME_ID) == 1  # the retry waits for the first
        plugin.backend.gate.set()
        for f in [*same, *others]:
            f.result(timeout=60)
    assert plugin.backend.most_at_once <= csi_server.WORKERS
    assert len(plugin.backend.calls) == n + 2
    assert len(plugin.serving.node_service.serial) == 0  # no lock left behind per volume


def test_the_socket_is_0600_in_its_directory_and_a_stale_one_is_replaced(sock_dir: Path) -> None:
    path = sock_dir / "csi.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening, then closed: the file stays behind, as after a crash
    stale.close()
    assert not sockets.answers(path)
    serving = csi_server.serve(path, NODE, RecordingVolumes(), KUBELET)
    try:
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert sorted(p.name for p in sock_dir.iterdir()) == ["csi.sock"]  # the private bind directory is gone
        assert node_stub(path).NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10).node_id == NODE
    finally:
        serving.stop(grace=1.0)
    assert not path.exists()


def test_a_link_a_file_or_a_live_socket_at_the_path_is_refused_and_left_as_it_was(sock_dir: Path) -> None:
    victim = sock_dir / "victim"
    victim.write_text("keep me")
    link = sock_dir / "link.sock"
    link.symlink_to(victim)
    regular = sock_dir / "file.sock"
    regular.write_text("not a socket")
    for path, words in [(link, "a symbolic link"), (regular, "a file"), (sock_dir, "a directory")]:
        with pytest.raises(sockets.SocketRefused, match=words):
            csi_server.serve(path, NODE, RecordingVolumes(), KUBELET)
    assert link.is_symlink() and victim.read_text() == "keep me" and regular.read_text() == "not a socket"
    live = sock_dir / "live.sock"
    first = csi_server.serve(live, NODE, RecordingVolumes(), KUBELET)
    try:
        with pytest.raises(sockets.SocketRefused, match="another process is serving"):
            csi_server.serve(live, NODE, RecordingVolumes(), KUBELET)
        assert node_stub(live).NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10).node_id == NODE
    finally:
        first.stop(grace=1.0)
    assert sorted(p.name for p in sock_dir.iterdir()) == ["file.sock", "link.sock", "victim"]


def test_stopping_removes_the_socket_only_while_it_is_still_ours(sock_dir: Path) -> None:
    path = sock_dir / "csi.sock"
    serving = csi_server.serve(path, NODE, RecordingVolumes(), KUBELET)
    path.unlink()
    successor = csi_server.serve(path, NODE, RecordingVolumes(), KUBELET)  # a new agent took the path over
    serving.stop(grace=1.0)
    assert path.exists() and successor.socket.is_ours()
    successor.stop(grace=1.0)
    assert not path.exists()


def test_a_pod_uid_the_path_does_not_carry_is_refused(plugin: Plugin) -> None:
    other = publish_request(attributes={POD_INFO_UID: "1111-2222"})
    code, details = code_of(lambda: plugin.node.NodePublishVolume(other, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"{KUBELET}/pods/1111-2222/volumes" in details
    assert POD[POD_INFO_UID] in details
