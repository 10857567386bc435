"""`sandkeep doctor` against the real API server: objects and Leases in the states the agent publishes."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.agent import stuck_message
from controller.api import kube, leases
from controller.api.kube import AGENT_MANAGER, Kube
from controller.cli.doctor import build_report, choose_install, render
from controller.node.store import tombstone_name
from controller.rules import contracts as c
from controller.rules import objects
from controller.rules.durations import format_instant
from hack.localcluster import LocalCluster
from tests.bed.own_cluster import own_cluster

REPO = Path(__file__).resolve().parents[2]
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


def _run_doctor(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "controller.cli.sandkeep",
        "doctor",
        "--kubeconfig",
        str(cluster.kubeconfig),
        *args,
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


def _doctor(cluster: Any, namespace: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return _run_doctor(cluster, "--install-namespace", namespace, "--sandbox-namespace", namespace, *extra)


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
        {
            "phase": "Stuck",
            "tombstone": tomb,
            "conditions": [objects.condition("TombstoneStuck", True, c.Reason.DELETE_FAILED, message)],
        },
        AGENT_MANAGER,
    )
    # A held one: its deletion waits on a process.
    held = _create(client, namespace, "held", "node-a", finalizers=[c.FINALIZER])
    cluster.kubectl("delete", "rsb", "held", "-n", namespace, "--wait=false")
    held = client.get_sandbox(namespace, "held")
    client.apply_status(
        held,
        {
            "phase": "Held",
            "inUse": True,
            "heldBy": ["pid 42 (bash) cwd"],
            "conditions": [objects.condition("InUse", True, c.Reason.IN_USE, "pid 42 (bash) cwd")],
        },
        AGENT_MANAGER,
    )
    # A pin that lapses in two hours, and one that does not lapse within a day.
    _create(
        client, namespace, "lapsing", "node-b", annotations={c.ANN_PIN_UNTIL: format_instant(now + timedelta(hours=2))}
    )
    _create(client, namespace, "safe", "node-b", annotations={c.ANN_PIN_UNTIL: format_instant(now + timedelta(days=3))})
    # node-a's agent reports fresh with an orphan stuck tombstone; node-b's stopped reporting long ago.
    leases.renew_heartbeat(client, namespace, "node-a", "agent-a")
    orphans = [{"name": ".reap-deadbeef-1", "errno": "EBUSY", "path": "/var/lib/sandkeep/.reap-deadbeef-1/mnt"}]
    client.request(
        "PATCH",
        leases.lease_path(namespace, leases.heartbeat_name("node-a")),
        body={"metadata": {"annotations": {c.ANN_ORPHAN_TOMBSTONES: json.dumps(orphans)}}},
        content_type="application/merge-patch+json",
    )
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
        [sys.executable, "-m", "controller.cli.sandkeep", "doctor", "--kubeconfig", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cannot read the cluster" in result.stderr


# --- finding the install's namespace -----------------------------------------------------------------------
def _lease(renewed_ago: timedelta | None, duration_s: int = 60) -> leases.LeaseState:
    now = datetime.now(UTC)
    renewed = None if renewed_ago is None else now - renewed_ago
    return leases.LeaseState("agent", renewed, renewed, timedelta(seconds=duration_s), 0, "1", {})


def test_the_one_namespace_with_a_live_lease_is_the_install_and_the_others_are_leftovers():
    now = datetime.now(UTC)
    found = {
        "sandkeep": [_lease(timedelta(seconds=5))],
        "sandkeep-system": [_lease(timedelta(days=3)), _lease(None)],
    }
    install = choose_install(found, now)
    assert install.namespace == "sandkeep" and install.leftovers == ("sandkeep-system",) and not install.ambiguous


def test_two_namespaces_with_live_leases_are_ambiguous_and_none_is_chosen():
    now = datetime.now(UTC)
    install = choose_install({"a": [_lease(timedelta(seconds=1))], "b": [_lease(timedelta(seconds=2))]}, now)
    assert install.namespace is None and install.ambiguous == ("a", "b")


def test_with_no_live_lease_the_most_recently_renewed_namespace_is_the_install():
    now = datetime.now(UTC)
    found = {"old": [_lease(timedelta(days=30))], "stopped": [_lease(timedelta(hours=2)), _lease(None)]}
    assert choose_install(found, now).namespace == "stopped"
    assert choose_install({"never": [_lease(None)]}, now).namespace == "never"
    assert choose_install({}, now).namespace is None


@pytest.fixture(scope="module")
def empty_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Finding the install is a question about the whole cluster, so it gets a cluster of its own."""
    yield from own_cluster(tmp_path_factory.mktemp("doctor-cluster"))


def test_doctor_finds_an_install_in_namespace_sandkeep_and_names_leftovers_in_sandkeep_system(empty_cluster):
    client = Kube(kube.load_config(empty_cluster.kubeconfig), component="test")
    for ns in ("sandkeep", "sandkeep-system", "work", "other"):
        empty_cluster.kubectl("create", "namespace", ns)
    _create(client, "work", "fine", "node-1", finalizers=[c.FINALIZER])
    # The install, as the README installs it: the agent's heartbeat and the controller's Lease in `sandkeep`.
    leases.renew_heartbeat(client, "sandkeep", "node-1", "agent-1")
    assert leases.try_acquire_or_renew(client, "sandkeep", c.CONTROLLER_LEASE, "controller-1")
    # An earlier install's heartbeat, long expired, in the old default namespace.
    leases.renew_heartbeat(client, "sandkeep-system", "node-1", "old-agent", duration_s=10)
    old = client.request("GET", leases.lease_path("sandkeep-system", leases.heartbeat_name("node-1")))
    old["spec"]["renewTime"] = kube.micro_time(datetime.now(UTC) - timedelta(days=2))
    client.request("PUT", leases.lease_path("sandkeep-system", leases.heartbeat_name("node-1")), body=old)

    found = _run_doctor(empty_cluster)

    assert found.returncode == 0, found.stdout + found.stderr
    assert "Agents not reporting: none" in found.stdout
    assert "Heartbeat Leases read from namespace sandkeep (found" in found.stdout
    assert "Expired sandkeep Leases also in namespace sandkeep-system" in found.stdout

    # The flag still wins: told to read the old namespace, doctor reads it and finds node-1 silent there. The
    # flag's old spelling (--namespace) still works for one release, and is warned about once.
    for spelling in ("--install-namespace", "--namespace"):
        told = _run_doctor(empty_cluster, spelling, "sandkeep-system", spelling, "sandkeep-system")
        assert told.returncode == 1, told.stdout + told.stderr
        assert "node-1" in told.stdout.split("Agents not reporting")[1].split("\n\n")[0]
        assert "namespace sandkeep-system (--install-namespace)" in told.stdout
        warned = [line for line in told.stderr.splitlines() if "deprecated_spelling" in line]
        if spelling == "--install-namespace":
            assert warned == [], told.stderr
        else:
            [line] = warned  # given twice, said once
            assert "used=--namespace use=--install-namespace" in line and " warning " in line, line

    # A second live install: doctor will not guess which one is meant.
    leases.renew_heartbeat(client, "other", "node-2", "agent-2")
    ambiguous = _run_doctor(empty_cluster)
    assert ambiguous.returncode == 2
    assert "namespaces other, sandkeep all hold live sandkeep Leases" in ambiguous.stderr
    assert "--install-namespace" in ambiguous.stderr
    client.close()


def test_quarantined_entries_are_listed_per_node_with_when_they_go_and_how_many_more() -> None:
    def heartbeat(node: str, report: dict[str, Any]) -> leases.LeaseState:
        raw = {
            "metadata": {"resourceVersion": "1", "annotations": {c.ANN_QUARANTINE: json.dumps(report)}},
            "spec": {"holderIdentity": f"agent-{node}", "renewTime": kube.micro_time(datetime.now(UTC))},
        }
        return leases._state(raw)

    a = {
        "total": 3,
        "grace": 86400,
        "entries": [{"entry": "team/x", "reason": "ManifestAbsent", "since": "s", "deleteAt": "d"}],
    }
    b = {
        "total": 1,
        "grace": 0,
        "entries": [{"entry": "Bad_Name", "reason": "BadName", "since": "s", "deleteAt": None}],
    }
    report = build_report(
        [], {"node-a": heartbeat("node-a", a), "node-b": heartbeat("node-b", b)}, timedelta(minutes=2)
    )
    assert report.quarantined == [
        ["node-a", "team/x", "ManifestAbsent", "s", "d"],
        ["node-b", "Bad_Name", "BadName", "s", "never"],
    ]
    assert report.needs_a_person
    assert any("node-a has 2 more quarantined entries" in n for n in report.notes)
    assert "Quarantined entries" in render(report) and "never" in render(report)
