"""`sandkeep csi-node`: the CSI node plugin as its own process (the agent Pod's privileged `csi` container), over
a real unix socket, publishing a real workspace of a real root with a real bind mount, and refusing a socket that
another plugin serves. What becomes of the volume after its Pod ends is the agent's (test_capture_agent.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from controller.csi.proto import csi_pb2, csi_pb2_grpc
from controller.node.capture import State, Volumes
from controller.node.store import Root
from controller.rules.contracts import CSI_DRIVER
from tests.bed.csikit import channel, node_stub, publish_request, socket_dir
from tests.unit.test_volume import UID, VOLUME_ID

REPO = Path(__file__).resolve().parents[2]


def csi_node(root: Path, endpoint: Path, kubelet: Path, node: str = "node-a") -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "controller.cli.sandkeep", "csi-node", f"--node={node}", f"--root={root}"]
    command += [f"--endpoint={endpoint}", f"--kubelet-dir={kubelet}"]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_socket(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.is_socket():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the plugin's socket never appeared"
        time.sleep(0.1)


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[tuple[Path, Path, Path, subprocess.Popen[str]]]:
    root, kubelet = tmp_path / "root", tmp_path / "kubelet"
    with socket_dir() as sockets:
        endpoint = sockets / CSI_DRIVER / "csi.sock"
        proc = csi_node(root, endpoint, kubelet)
        try:
            wait_for_socket(endpoint, proc)
            yield root, kubelet, endpoint, proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for line in Path("/proc/self/mountinfo").read_text().splitlines():  # nothing left mounted
                point = line.split()[4]
                if point.startswith(str(kubelet)):
                    subprocess.run(["umount", point], check=False)


def test_the_plugin_process_publishes_a_real_workspace_and_stops_cleanly_on_sigterm(
    plugin: tuple[Path, Path, Path, subprocess.Popen[str]],
) -> None:
    root, kubelet, endpoint, proc = plugin
    identity = csi_pb2_grpc.IdentityStub(channel(endpoint))
    assert identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10).name == CSI_DRIVER
    assert node_stub(endpoint).NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10).node_id == "node-a"
    target = kubelet / "pods" / UID / "volumes" / "kubernetes.io~csi" / "workspace" / "mount"
    target.parent.mkdir(parents=True)
    node_stub(endpoint).NodePublishVolume(publish_request(target=str(target)), timeout=10)
    (target / "result.txt").write_text("built")  # the Pod writes through its mount into the root
    (volume,) = Volumes(Root(root)).records()
    assert volume.record is not None and volume.record.state is State.PUBLISHED
    assert (root / ".sandkeep-volumes" / volume.entry / "workspace" / "result.txt").read_text() == "built"
    node_stub(endpoint).NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=VOLUME_ID, target_path=str(target)), timeout=10
    )
    assert not os.path.ismount(target)
    (volume,) = Volumes(Root(root)).records()
    assert volume.record is not None and volume.record.state is State.UNPUBLISHED
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "csi_plugin_stopped" in out and not endpoint.exists()


def test_a_second_plugin_on_the_same_socket_is_refused_and_the_first_keeps_serving(
    plugin: tuple[Path, Path, Path, subprocess.Popen[str]],
) -> None:
    root, kubelet, endpoint, _ = plugin
    second = csi_node(root, endpoint, kubelet, node="node-b")
    out = second.communicate(timeout=60)[0]
    assert second.returncode == 1 and "csi_plugin_refused" in out and "another process is serving" in out
    with pytest.raises(grpc.RpcError) as caught:  # the target is checked against --kubelet-dir
        node_stub(endpoint).NodePublishVolume(publish_request(), timeout=10)
    err = caught.value
    assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{kubelet}/pods/" in (err.details() or "")


@pytest.mark.parametrize("flag", ["--root=var/lib/sandkeep", "--kubelet-dir=var/lib/kubelet", "--endpoint=csi.sock"])
def test_a_relative_path_stops_it_at_start_with_the_flag_named(flag: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "controller.cli.sandkeep", "csi-node", "--node=n", flag],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert f"{flag.replace('=', ' ')}: must be an absolute path" in out.stderr
