"""`sandkeep uninstall` (the chart's pre-delete hook) on the real API server, as the hook's own ServiceAccount.

The hook's ServiceAccount, ClusterRole, Role and bindings are rendered by the real helm for a uniquely named
release and applied; `sandkeep uninstall` runs as a real process with a kubeconfig holding that
ServiceAccount's TokenRequest token, so the RBAC is proven sufficient as well as needed. The agents'
DaemonSet is a real DaemonSet (kube-controller-manager gives it a Pod on a Ready node, which no kubelet
runs). The whole hook, Job and all, runs on the real node in tests/node/test_e2e.py. `sandkeep uninstall` acts
on every RetainedSandbox of the cluster, so the module has a cluster of its own (the worker's shared one
holds other tests' sandboxes).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from controller.api.kube import Kube
from controller.rules import contracts as c
from controller.rules.durations import format_instant
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import kube_for, render_templates, wait_for
from tests.bed.own_cluster import own_cluster

REPO = Path(__file__).resolve().parents[2]
OTHER_FINALIZER = "example.com/keep-me"


class Bed:
    """One release's hook RBAC, its agents' DaemonSet, and sandboxes with the agent's finalizer."""

    def __init__(self, cluster: LocalCluster, namespace: str, tmp_path: Path, *values: str) -> None:
        self.cluster, self.namespace, self.dir = cluster, namespace, tmp_path
        self.release = f"un{secrets.token_hex(3)}"
        self.docs = render_templates(self.release, namespace, ("uninstall-hook.yaml",), *values)
        self.rbac = [d for d in self.docs if d["kind"] != "Job"]
        cluster.apply(self.rbac)
        self.sa = f"{self.release}-sandkeep-uninstall"
        token = cluster.token_for(namespace, self.sa)
        self.kubeconfig = cluster.kubeconfig_for_token(token, tmp_path / f"{self.release}.kubeconfig")
        self.daemonset = f"{self.release}-sandkeep-agent"
        self.node = f"{self.release}-node"

    def start_agents(self) -> None:
        """The agents' DaemonSet, with its Pod on a Ready node (kube-controller-manager makes it)."""
        self.cluster.create_node(self.node, ready=True)
        labels = {"app.kubernetes.io/instance": self.release, "app.kubernetes.io/component": "agent"}
        ds = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": self.daemonset, "namespace": self.namespace},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    # every taint tolerated, as the chart's agent does (a new Node is tainted not-ready)
                    "spec": {
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [{"name": "agent", "image": "sandkeep:test"}],
                    },
                },
            },
        }
        self.cluster.apply(ds)
        wait_for("the agents' Pod", lambda: self.pods(), timeout=60)

    def pods(self) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component=agent"
        items: list[dict[str, Any]] = self.cluster.kubectl_json("get", "pods", "-n", self.namespace, "-l", selector)[
            "items"
        ]
        return items

    def daemonset_exists(self) -> bool:
        got = self.cluster.kubectl(
            "get", "ds", self.daemonset, "-n", self.namespace, "--ignore-not-found", "-o", "name"
        )
        return bool(got.stdout.strip())

    def uninstall(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "controller.cli.sandkeep", "uninstall", f"--kubeconfig={self.kubeconfig}"]
        cmd += [f"--install-namespace={self.namespace}", f"--agent-daemonset={self.daemonset}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)

    def remove(self) -> None:
        for doc in self.rbac:
            if doc["kind"].startswith("Cluster"):
                self.cluster.kubectl("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", check=False)
        self.cluster.kubectl("delete", "node", self.node, "--ignore-not-found", "--wait=false", check=False)


pytestmark = pytest.mark.xdist_group("uninstall")  # one cluster for the module, on one worker


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """This module's own control plane, with the CRDs (shadows the worker's shared one)."""
    yield from own_cluster(tmp_path_factory.mktemp("uninstall-cluster"))


@pytest.fixture
def kube(cluster: LocalCluster) -> Iterator[Kube]:
    client = kube_for(cluster)
    yield client
    client.close()


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    name = f"un-{secrets.token_hex(4)}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture
def hook_bed(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Callable[..., Bed]]:
    made: list[Bed] = []

    def make(*values: str) -> Bed:
        made.append(Bed(cluster, namespace, tmp_path, *values))
        return made[-1]

    yield make
    for b in made:
        b.remove()


def sandbox(client: Kube, namespace: str, name: str, *finalizers: str) -> dict[str, Any]:
    body = {
        "metadata": {"name": name, "finalizers": list(finalizers)},
        "spec": {"nodeName": "n", "createdAt": format_instant(datetime.now(UTC)), "jobId": name},
    }
    return client.create_sandbox(namespace, body)


def test_keep_stops_the_agents_then_releases_every_sandbox_so_nothing_is_stranded(
    hook_bed: Callable[..., Bed], cluster: LocalCluster, kube: Kube
) -> None:
    b = hook_bed()
    work = f"{b.release}-work"
    cluster.kubectl("create", "namespace", work)
    try:
        b.start_agents()
        for i in range(3):
            sandbox(kube, work, f"sb-{i}", c.FINALIZER)
        other = sandbox(kube, b.namespace, "shared", OTHER_FINALIZER, c.FINALIZER)
        done = b.uninstall("--timeout=60s")
        assert done.returncode == 0, done.stderr
        assert "removed from 4 RetainedSandboxes; their directories stay" in done.stdout
        # the agents went first (a running one would add its finalizer back), then the finalizers
        assert not b.daemonset_exists() and b.pods() == []
        left = kube.list_sandboxes(work) + kube.list_sandboxes(b.namespace)
        assert {o["metadata"]["name"] for o in left} == {"sb-0", "sb-1", "sb-2", "shared"}  # kept, not deleted
        assert all(c.FINALIZER not in (o["metadata"].get("finalizers") or []) for o in left)
        shared = kube.get_sandbox(b.namespace, "shared")
        assert shared is not None and shared["metadata"]["finalizers"] == [OTHER_FINALIZER]  # not ours: stays
        assert shared["metadata"]["uid"] == other["metadata"]["uid"]
        # nothing stranded: deleting the namespace of the released sandboxes completes
        cluster.kubectl("delete", "namespace", work, "--wait=true", "--timeout=60s")
        # a second run (a retried hook) has nothing to do and succeeds
        again = b.uninstall("--timeout=10s")
        assert again.returncode == 0 and "removed from 0 RetainedSandboxes" in again.stdout, again.stderr
    finally:
        cluster.kubectl("delete", "namespace", work, "--wait=false", "--ignore-not-found", check=False)
        for obj in kube.list_sandboxes(b.namespace):
            if obj["metadata"].get("finalizers"):
                patch = json.dumps({"metadata": {"finalizers": None}})
                name = obj["metadata"]["name"]
                cluster.kubectl("patch", c.SANDBOX_PLURAL, name, "-n", b.namespace, "--type=merge", "-p", patch)


def test_delete_that_cannot_finish_changes_nothing_and_says_what_is_held(
    hook_bed: Callable[..., Bed], cluster: LocalCluster, kube: Kube
) -> None:
    b = hook_bed("--set=uninstall.sandboxes=delete")
    b.start_agents()
    sandbox(kube, b.namespace, "held", c.FINALIZER)  # no agent acts on it: it stays Terminating
    sandbox(kube, b.namespace, "free")  # nothing guards it: deleted at once
    try:
        done = b.uninstall("--sandboxes=delete", "--timeout=3s")
        assert done.returncode == 1, done.stdout + done.stderr
        assert "1 RetainedSandboxes are still there after 3s" in done.stderr
        assert f"{b.namespace}/held" in done.stderr and "Nothing was uninstalled" in done.stderr
        assert kube.get_sandbox(b.namespace, "free") is None
        held = kube.get_sandbox(b.namespace, "held")
        assert held is not None and held["metadata"].get("deletionTimestamp")
        assert held["metadata"]["finalizers"] == [c.FINALIZER]  # the agent's to honour, once it can
        assert b.daemonset_exists() and b.pods(), "the agents must keep running: the uninstall did not happen"
    finally:
        patch = json.dumps({"metadata": {"finalizers": None}})
        cluster.kubectl("patch", c.SANDBOX_PLURAL, "held", "-n", b.namespace, "--type=merge", "-p", patch, check=False)


def test_the_hooks_serviceaccount_can_do_that_and_nothing_more(
    hook_bed: Callable[..., Bed], cluster: LocalCluster
) -> None:
    def can(kubeconfig: Path, *args: str) -> bool:
        result = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
        return result.stdout.strip() == "yes"

    keep, delete = hook_bed(), hook_bed("--set=uninstall.sandboxes=delete")
    ns = keep.namespace
    for b in (keep, delete):
        assert can(b.kubeconfig, "patch", f"{c.SANDBOX_PLURAL}.{c.GROUP}", "-A")
        assert can(b.kubeconfig, "delete", f"daemonset/{b.daemonset}", "-n", ns)
        assert not can(b.kubeconfig, "delete", "daemonset/something-else", "-n", ns)
        assert not can(b.kubeconfig, "delete", "pods", "-n", ns)
        assert not can(b.kubeconfig, "get", "secrets", "-n", ns)
        assert not can(b.kubeconfig, "create", f"{c.SANDBOX_PLURAL}.{c.GROUP}", "-n", ns)
    # only the mode that deletes sandboxes may delete them
    assert not can(keep.kubeconfig, "delete", f"{c.SANDBOX_PLURAL}.{c.GROUP}", "-A")
    assert can(delete.kubeconfig, "delete", f"{c.SANDBOX_PLURAL}.{c.GROUP}", "-A")
    # every hook object is a pre-delete hook, deleted again once it succeeded
    for doc in keep.docs:
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete", doc["kind"]
        assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
    job = next(d for d in keep.docs if d["kind"] == "Job")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "uninstall" in args and f"--agent-daemonset={keep.daemonset}" in args and "--sandboxes=keep" in args
    # the Job runs before its RBAC could be gone: the RBAC objects are created first (lower weight)
    weights = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in keep.docs}
    assert all(w < weights["Job"] for k, w in weights.items() if k != "Job")


def test_uninstall_refuses_a_bad_timeout() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli.sandkeep",
            "uninstall",
            "--namespace=x",
            "--agent-daemonset=y",
            "--timeout=soon",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2 and "--timeout" in done.stderr
