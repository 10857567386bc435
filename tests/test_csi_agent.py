"""`sandkeep agent --csi-endpoint`: the agent process serves the CSI node plugin beside its passes, against the real
local control plane, and takes its socket away when it stops.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from csikit import channel, node_stub, publish_request, socket_dir
from test_agent import REPO, AgentProcess, Node, agents, crd, nodes, wait_for
from test_volume import TARGET

from controller.csi.proto import csi_pb2, csi_pb2_grpc
from controller.rules.contracts import CSI_DRIVER

__all__ = ["agents", "crd", "nodes"]  # fixtures of test_agent, used here


def test_the_agent_serves_the_plugin_on_its_csi_endpoint_and_removes_the_socket_as_it_stops(
    agents: Callable[..., AgentProcess], nodes: tuple[Node, Node]
) -> None:
    node = nodes[0]
    with socket_dir() as sock_dir:
        endpoint = sock_dir / CSI_DRIVER / "csi.sock"
        agent = agents(node, extra=["--csi-endpoint", str(endpoint), "--kubelet-dir", "/data/kubelet"])
        wait_for(lambda: "csi_plugin_started" in agent.log() or agent.proc.poll() is not None, 90, "plugin start")
        identity = csi_pb2_grpc.IdentityStub(channel(endpoint))
        assert identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10).name == CSI_DRIVER
        assert node_stub(endpoint).NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10).node_id == node.name
        with pytest.raises(grpc.RpcError) as caught:  # the target is checked against the agent's --kubelet-dir
            node_stub(endpoint).NodePublishVolume(publish_request(target=TARGET), timeout=10)
        err = caught.value
        assert isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "/data/kubelet/pods/" in (err.details() or "")

        # Another agent given the same socket cannot take it while this one serves: it says why and stops.
        second = agents(nodes[1], extra=["--csi-endpoint", str(endpoint)])
        assert second.proc.wait(timeout=90) == 1
        assert "csi_plugin_refused" in second.log() and "another process is serving" in second.log()
        agent.stop()
        assert agent.proc.returncode == 0
        assert "csi_plugin_stopped" in agent.log() and not endpoint.exists()


def test_a_relative_kubelet_dir_stops_the_agent_at_start_with_the_flag_named(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "controller.cli.sandkeep", "agent", "--node=n", "--kubelet-dir=var/lib/kubelet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--kubelet-dir var/lib/kubelet: must be an absolute path" in out.stderr
