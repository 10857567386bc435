"""`sandkeep doctor` against the real API server: objects and Leases in the states the agent publishes."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller import contracts as c
from controller import kube, leases
from controller.agent import stuck_message
from controller.durations import format_instant
from controller.kube import AGENT_MANAGER, Kube
from controller.store import tombstone_name

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "sandkeep.io_retainedsandboxes.yaml"


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{c.SANDBOX_PLURAL}.{c.GROUP}")


@pytest.fixture
def client(cluster: Any) -> Kube:
    return Kube(kube.load_config(cluster.kubeconfig), component="test")


def _create(client: Kube, namespace: str, name: str, node: str, **meta: Any) -> dict[str, Any]:
    body = {
        "metadata": {"name": name, "namespace": namespace, **meta},
        "spec": {"nodeName": node, "createdAt": "2026-01-01T00:00:00Z"},
    }
    return client.create_sandbox(namespace, body)


def _doctor(cluster: Any, namespace: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", "doctor", "--kubeconfig", str(cluster.kubeconfig),
         "--namespace", namespace, "--sandbox-namespace", namespace, *extra],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_doctor_names_stuck_held_lapsing_stale_and_orphans_and_exits_non_zero(cluster, namespace, crd, client):
    now = datetime.now(UTC)
    # A stuck tombstone, as the agent reports it: Terminating, phase Stuck, a condition with errno and path.
    stuck = _create(client, namespace, "stuck", "node-a", finalizers=[c.FINALIZER])
    cluster.kubectl("delete", "rsb", "stuck", "-n", namespace, "--wait=false")
    stuck = client.get_sandbox(namespace, "stuck")
    tomb = tombstone_name(stuck["metadata"]["uid"], now - timedelta(minutes=20))
    message = stuck_message(f"{namespace}/stuck", "node-a", tomb, errno.EPERM, f"/var/lib/sandkeep/{tomb}/x/immutable")
    client.apply_status(
        stuck,
        {"phase": "Stuck", "tombstone": tomb,
         "conditions": [kube.condition("TombstoneStuck", True, c.Reason.DELETE_FAILED, message)]},
        AGENT_MANAGER,
    )  # fmt: skip
    # A held one: its deletion waits on a process.
    held = _create(client, namespace, "held", "node-a", finalizers=[c.FINALIZER])
    cluster.kubectl("delete", "rsb", "held", "-n", namespace, "--wait=false")
    held = client.get_sandbox(namespace, "held")
    client.apply_status(
        held,
        {"phase": "Held", "inUse": True, "heldBy": ["pid 42 (bash) cwd"],
         "conditions": [kube.condition("InUse", True, c.Reason.IN_USE, "pid 42 (bash) cwd")]},
        AGENT_MANAGER,
    )  # fmt: skip
    # A pin that lapses in two hours, and one that does not lapse within a day.
    _create(
        client, namespace, "lapsing", "node-b", annotations={c.ANN_PIN_UNTIL: format_instant(now + timedelta(hours=2))}
    )
    _create(client, namespace, "safe", "node-b", annotations={c.ANN_PIN_UNTIL: format_instant(now + timedelta(days=3))})
    # node-a's agent reports fresh with an orphan stuck tombstone; node-b's stopped reporting long ago.
    leases.renew_heartbeat(client, namespace, "node-a", "agent-a")
    orphans = [{"name": ".reap-deadbeef-1", "errno": "EBUSY", "path": "/var/lib/sandkeep/.reap-deadbeef-1/mnt"}]
    client.request(
        "PATCH", leases.lease_path(namespace, leases.heartbeat_name("node-a")),
        body={"metadata": {"annotations": {c.ANN_ORPHAN_TOMBSTONES: json.dumps(orphans)}}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    leases.renew_heartbeat(client, namespace, "node-b", "agent-b", duration_s=10)
    lease_b = client.request("GET", leases.lease_path(namespace, leases.heartbeat_name("node-b")))
    lease_b["spec"]["renewTime"] = kube.micro_time(now - timedelta(hours=1))
    client.request("PUT", leases.lease_path(namespace, leases.heartbeat_name("node-b")), body=lease_b)

    result = _doctor(cluster, namespace)

    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    stuck_line = next(line for line in out.splitlines() if f"{namespace}/stuck" in line)
    assert "node-a" in stuck_line and "EPERM" in stuck_line and f"/var/lib/sandkeep/{tomb}/x/immutable" in stuck_line
    assert "20m" in stuck_line
    held_line = next(line for line in out.splitlines() if f"{namespace}/held" in line)
    assert "pid 42 (bash) cwd" in held_line
    assert f"{namespace}/lapsing" in out and f"{namespace}/safe" not in out
    stale = out.split("Agents not reporting")[1].split("\n\n")[0]
    assert "node-b" in stale and "node-a" not in stale
    assert ".reap-deadbeef-1" in out and "EBUSY" in out
    assert out.rstrip().endswith("needs a person")


def test_doctor_is_quiet_and_exits_zero_when_nothing_needs_a_person(cluster, namespace, crd, client):
    _create(client, namespace, "fine", "node-c", finalizers=[c.FINALIZER])
    leases.renew_heartbeat(client, namespace, "node-c", "agent-c")
    result = _doctor(cluster, namespace)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing needs a person" in result.stdout
    assert "Stuck tombstones: none" in result.stdout


def test_doctor_says_when_it_cannot_reach_the_cluster(tmp_path):
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    result = subprocess.run(
        [sys.executable, "-m", "controller.cli", "doctor", "--kubeconfig", str(bad)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "cannot read the cluster" in result.stderr
