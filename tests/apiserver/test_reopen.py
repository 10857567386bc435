"""Reopening a retained sandbox through the CSI driver, on the real local control plane: a real `sandkeep
csi-node` process (its kubeconfig pointed at the test cluster) publishes a real sandbox of a real root with a
real bind mount, refuses what `kubectl sandkeep open` refuses as the Pod's Events would show it, and a real
`sandkeep agent` holds the sandbox while the reopen is published and releases it after the unpublish."""

from __future__ import annotations

import errno
import json
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.csi.proto import csi_pb2
from controller.node.capture import Volumes
from controller.rules import contracts as c
from controller.rules.contracts import CSI_DRIVER, VOLUME_READ_WRITE, VOLUME_SANDBOX
from tests.bed.agentkit import Node, adopted, delete, get, make_object, wait_for
from tests.bed.csikit import node_stub, publish_request, socket_dir
from tests.disk.test_capture import mounts_at, unmount_under
from tests.disk.test_csi_node import wait_for_socket

REPO = Path(__file__).resolve().parents[2]


class Plugin:
    """`sandkeep csi-node` for node n1, and the kubelet's side: a Pod of the test's namespace per publish."""

    def __init__(self, cluster: Any, node: Node, tmp: Path, sockets: Path) -> None:
        self.kubelet = tmp / "kubelet"
        self.endpoint = sockets / CSI_DRIVER / "csi.sock"
        command = [sys.executable, "-m", "controller.cli.sandkeep", "csi-node", f"--node={node.name}"]
        command += [f"--root={node.root.path}", f"--endpoint={self.endpoint}", f"--kubelet-dir={self.kubelet}"]
        command += [f"--kubeconfig={cluster.kubeconfig}"]
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for_socket(self.endpoint, self.proc)

    def publish(self, namespace: str, sandbox: str, **attributes: str) -> tuple[str, Path]:
        """Publish a reopen of `sandbox` for a new Pod of `namespace`: its volume id and target."""
        uid = f"{secrets.token_hex(4)}-0000-4000-8000-{secrets.token_hex(6)}"
        target = self.kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / "workspace" / "mount"
        target.parent.mkdir(parents=True)
        volume_id = f"csi-{secrets.token_hex(32)}"
        pod = {
            "csi.storage.k8s.io/pod.namespace": namespace,
            "csi.storage.k8s.io/pod.name": "debug",
            "csi.storage.k8s.io/pod.uid": uid,
        }
        request = publish_request(volume_id, str(target), {**pod, VOLUME_SANDBOX: sandbox, **attributes})
        node_stub(self.endpoint).NodePublishVolume(request, timeout=30)
        return volume_id, target

    def refusal(self, namespace: str, sandbox: str) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as caught:
            self.publish(namespace, sandbox)
        err = caught.value
        assert isinstance(err, grpc.Call)
        return err.code(), err.details() or ""

    def unpublish(self, volume_id: str, target: Path) -> None:
        request = csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        node_stub(self.endpoint).NodeUnpublishVolume(request, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def plugin(cluster: Any, nodes: tuple[Node, Node], tmp_path: Path) -> Iterator[Plugin]:
    with socket_dir() as sockets:
        started = Plugin(cluster, nodes[0], tmp_path, sockets)
        try:
            yield started
        finally:
            started.stop()
            unmount_under(tmp_path)


def set_phase(cluster: Any, namespace: str, name: str, phase: str) -> None:
    """What the controller writes when a sandbox's deadline passed (no controller runs here)."""
    patch = json.dumps({"status": {"phase": phase}})
    cluster.kubectl("patch", "rsb", name, "-n", namespace, "--subresource=status", "--type=merge", "-p", patch)


def test_a_reopen_mounts_the_sandbox_read_only_or_read_write_as_asked(cluster, namespace, nodes, plugin):
    n1, _ = nodes
    workspace = n1.retain(namespace, "run-42", {"logs/build.log": "error\n"}) / c.WORKSPACE_DIR
    make_object(cluster, namespace, "run-42", n1.name)
    volume_id, target = plugin.publish(namespace, "run-42")
    assert (target / "logs" / "build.log").read_text() == "error\n"
    assert {"ro", "nosuid", "nodev"} <= set(mounts_at(str(target))[0].split(","))
    with pytest.raises(OSError) as caught:
        (target / "new.txt").write_text("x")
    assert caught.value.errno == errno.EROFS
    plugin.unpublish(volume_id, target)
    assert mounts_at(str(target)) == [] and list(Volumes(n1.root).records()) == []
    volume_id, target = plugin.publish(namespace, "run-42", **{VOLUME_READ_WRITE: "true"})
    (target / "notes.txt").write_text("looked")
    assert (workspace / "notes.txt").read_text() == "looked"
    plugin.unpublish(volume_id, target)


def test_what_open_refuses_a_reopen_refuses_as_the_pods_events_show_it(cluster, namespace, nodes, plugin):
    n1, n2 = nodes
    other = f"{namespace[:50]}-b"
    cluster.kubectl("create", "namespace", other)
    try:
        n1.retain(other, "theirs")
        make_object(cluster, other, "theirs", n1.name)  # another namespace's: not found from this one
        code, message = plugin.refusal(namespace, "theirs")
        assert code == grpc.StatusCode.NOT_FOUND and f"RetainedSandbox {namespace}/theirs does not exist" in message
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false")
    make_object(cluster, namespace, "elsewhere", n2.name)
    code, message = plugin.refusal(namespace, "elsewhere")
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"is on node {n2.name}" in message and f"kubernetes.io/hostname={n2.name}" in message
    n1.retain(namespace, "old")
    make_object(cluster, namespace, "old", n1.name)
    set_phase(cluster, namespace, "old", c.Phase.EXPIRED)
    code, message = plugin.refusal(namespace, "old")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "is expired" in message and "sandkeep pin old" in message
    assert list(Volumes(n1.root).records()) == []


def reopened_and_held(cluster: Any, namespace: str, plugin: Plugin, name: str) -> tuple[str, Path]:
    """A sandbox adopted by the running agent, reopened by a Pod `debug` and held for it: its volume id, target."""
    adopted(cluster, namespace, name)
    volume_id, target = plugin.publish(namespace, name)
    holder = f"pod {namespace}/debug (reopen volume)"
    wait_for(lambda: holder in ((get(cluster, namespace, name) or {}).get("status") or {}).get("heldBy", []))
    return volume_id, target


def test_the_agent_holds_a_reopened_sandbox_until_its_unpublish(
    cluster, namespace, nodes, plugin, agents: Callable[..., Any]
):
    n1, _ = nodes
    path = n1.retain(namespace, "held")
    agents(n1)
    volume_id, target = reopened_and_held(cluster, namespace, plugin, "held")
    holder = f"pod {namespace}/debug (reopen volume)"
    delete(cluster, namespace, "held")
    held = wait_for(lambda: (o := get(cluster, namespace, "held")) and o["status"].get("phase") == "Held" and o)
    assert holder in held["status"]["heldBy"] and path.is_dir()
    code, message = plugin.refusal(namespace, "held")  # a deletion is final: no new reopen
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "is being deleted" in message
    plugin.unpublish(volume_id, target)
    wait_for(lambda: get(cluster, namespace, "held") is None, what="deleted once the reopen is unpublished")
    assert not path.exists()


def test_a_reopen_whose_unpublish_never_comes_is_released_once_unmounted_and_its_pod_gone(
    cluster, namespace, nodes, plugin, agents: Callable[..., Any]
):
    n1, _ = nodes
    path = n1.retain(namespace, "rebooted")
    agents(n1)
    _, target = reopened_and_held(cluster, namespace, plugin, "rebooted")  # its Pod "debug" is not in the API
    unmount_under(target)  # the node rebooted: the mount is gone, the record is not
    wait_for(lambda: list(Volumes(n1.root).records()) == [], what="the stale reopen record released")
    wait_for(lambda: not ((get(cluster, namespace, "rebooted") or {}).get("status") or {}).get("heldBy"))
    assert (path / c.WORKSPACE_DIR / "README").read_text() == "hello"
