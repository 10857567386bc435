"""The chart on the real API server: every rendered manifest through `kubectl apply --dry-run=server` (with
minimal prometheus-operator CRDs from tests/fixtures installed), `helm install` for real, and the real
kube-controller-manager turning the workloads into Pods under Pod Security admission.

What helm and promtool alone check is in tests/chart/test_chart*.py; the CRDs' install and upgrade by the
chart, on a cluster of its own, in tests/apiserver/test_chart_crds.py.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.rules import contracts as c
from hack.localcluster import LocalCluster
from tests.bed.chart import CHART, EVERYTHING_ON, MONITORING_CRDS, NO_CRDS, NO_HOOKS, helm, objects, render
from tests.bed.controller_harness import install_crds, only_in, wait_for


@pytest.fixture(scope="session")
def monitoring_crds(cluster: LocalCluster) -> Iterator[None]:
    """The prometheus-operator CRDs (test fixture) installed and established on this worker's cluster."""
    cluster.kubectl("apply", "--server-side", "-f", str(MONITORING_CRDS))
    for plural in ("servicemonitors", "podmonitors", "prometheusrules"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{plural}.monitoring.coreos.com", "--timeout=60s")
    yield


@pytest.mark.parametrize("values", [[], EVERYTHING_ON], ids=["defaults", "everything-on"])
def test_every_rendered_manifest_is_accepted_by_the_api_server(
    tools: Path, cluster: LocalCluster, namespace: str, monitoring_crds: None, values: list[str]
) -> None:
    manifest = render(tools, *values, namespace=namespace)
    result = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=manifest)
    applied = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    assert len(applied) == len(objects(manifest)), result.stdout


def test_server_dry_run_refuses_a_misspelt_monitoring_field(
    cluster: LocalCluster, namespace: str, monitoring_crds: None
) -> None:
    # The fixture CRDs are typed: the dry-run above would catch a misspelt field in the chart.
    bad = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "metrics", "intervall": "30s"}]},
    }
    result = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=json.dumps(bad), check=False
    )
    assert result.returncode != 0 and "intervall" in result.stderr


def test_helm_install_creates_every_object(
    tools: Path, cluster: LocalCluster, namespace: str, monitoring_crds: None
) -> None:
    install_crds(cluster)
    release = f"sk-{secrets.token_hex(3)}"
    install = helm(
        tools,
        "install",
        release,
        str(CHART),
        f"--namespace={namespace}",
        *EVERYTHING_ON,
        NO_CRDS,
        only_in(namespace),  # the pin policy too, but not over the other tests' namespaces
        kubeconfig=cluster.kubeconfig,
    )
    try:
        assert "STATUS: deployed" in install.stdout
        assert f"is installed in namespace {namespace}" in install.stdout, "NOTES.txt did not render"
        assert "sandkeep.io/pin-for=72h" in install.stdout and "Alerts: PrometheusRule" in install.stdout
        manifest = helm(tools, "get", "manifest", release, f"--namespace={namespace}", kubeconfig=cluster.kubeconfig)
        for doc in objects(manifest.stdout):
            ns_args = [f"--namespace={doc['metadata'].get('namespace', namespace)}"]
            got = cluster.kubectl_json("get", doc["kind"], doc["metadata"]["name"], *ns_args)
            assert got["metadata"]["labels"]["app.kubernetes.io/instance"] == release
        # the CRDs (applied beside the release, crds.enabled=false) serve the sandbox kinds
        assert cluster.kubectl("get", c.SANDBOX_PLURAL, f"--namespace={namespace}").returncode == 0
    finally:
        helm(
            tools,
            "uninstall",
            release,
            f"--namespace={namespace}",
            NO_HOOKS,
            kubeconfig=cluster.kubeconfig,
            check=False,
        )


def _pods(cluster: LocalCluster, namespace: str, component: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io%2Fcomponent%3D{component}"
    items: list[dict[str, Any]] = cluster.read(f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")["items"]
    return items


def _target_node(pod: dict[str, Any]) -> str:
    """The node a DaemonSet Pod is for: the controller pins it with a matchFields node affinity."""
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    name: str = terms["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
    return name


def _refusals(cluster: LocalCluster, namespace: str, kind: str) -> str:
    events = cluster.read(f"/api/v1/namespaces/{namespace}/events")["items"]
    return "\n".join(
        e["message"] for e in events if e["reason"] == "FailedCreate" and e["involvedObject"]["kind"] == kind
    )


@pytest.mark.slow
def test_the_workloads_get_their_pods_from_the_real_controllers_at_the_pod_security_level_documented(
    tools: Path, cluster: LocalCluster, namespace: str
) -> None:
    """kube-controller-manager turns the chart's Deployment and DaemonSet into Pods, admitted by the real
    Pod Security admission: the agent needs `privileged` (hostPID and hostPath are refused by `baseline`),
    as the READMEs say, and the controller passes `restricted`. The agent goes to every selected node,
    tainted or not, and to no other: not to an unselected node, nor to a Windows node of the selected pool
    (the default agent.nodeSelector, kept beside the pool label given here)."""
    install_crds(cluster)
    wanted = f"jobs-{secrets.token_hex(3)}"
    nodes = {name: f"{namespace[:40]}-{name}" for name in ("plain", "tainted", "unselected", "windows")}
    for name, node in nodes.items():
        labels = {"kubernetes.io/os": "windows" if name == "windows" else "linux"}  # as the kubelet labels them
        if name != "unselected":
            labels["sandkeep.io/test-pool"] = wanted
        cluster.create_node(node, ready=True, labels=labels)
    taint = {"spec": {"taints": [{"key": "dedicated", "value": "jobs", "effect": "NoSchedule"}]}}
    cluster.kubectl("patch", "node", nodes["tainted"], "--type=merge", "-p", json.dumps(taint))
    levels = {"privileged": namespace, "baseline": f"{namespace[:50]}-base", "restricted": f"{namespace[:50]}-restr"}
    releases = []
    try:
        for level, ns in levels.items():
            if ns != namespace:
                cluster.kubectl("create", "namespace", ns)
            cluster.kubectl("label", "namespace", ns, f"pod-security.kubernetes.io/enforce={level}")
            release = f"pods-{secrets.token_hex(3)}"
            pool = f"--set=agent.nodeSelector.sandkeep\\.io/test-pool={wanted}"
            # The CSIDriver is cluster-scoped (one per cluster, as the CRDs): the first release alone has it.
            csi = f"--set=csi.enabled={str(ns == namespace).lower()}"
            helm(
                tools,
                "install",
                release,
                str(CHART),
                f"--namespace={ns}",
                pool,
                csi,
                NO_CRDS,
                only_in(ns),
                kubeconfig=cluster.kubeconfig,
            )
            releases.append((release, ns))
        for level, ns in levels.items():
            wait_for(f"two controller Pods under {level}", lambda n=ns: len(_pods(cluster, n, "controller")) == 2, 60)
        # the disruption controller finds the PodDisruptionBudget's selector covers both controller Pods
        pdb = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{releases[0][0]}-sandkeep-controller"
        wait_for(
            "the PodDisruptionBudget to cover both controller Pods",
            lambda: (cluster.read(pdb) or {}).get("status", {}).get("expectedPods") == 2,
            60,
        )
        expected = {nodes["plain"], nodes["tainted"]}
        agents = wait_for(
            "an agent Pod on each selected node",
            lambda: (got := _pods(cluster, namespace, "agent")) and {_target_node(p) for p in got} == expected and got,
            timeout=60,
        )
        assert len(agents) == 2, [_target_node(p) for p in agents]
        assert all(p["spec"]["hostPID"] for p in agents)
        for level in ("baseline", "restricted"):
            ns = levels[level]
            refusal = wait_for(f"the agent refused under {level}", lambda n=ns: _refusals(cluster, n, "DaemonSet"), 60)
            assert "violates PodSecurity" in refusal and "hostPID" in refusal and "hostPath" in refusal, refusal
            assert _pods(cluster, ns, "agent") == []
    finally:
        for release, ns in releases:
            helm(tools, "uninstall", release, f"--namespace={ns}", NO_HOOKS, kubeconfig=cluster.kubeconfig, check=False)
        for ns in levels.values():
            if ns != namespace:
                cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
        for node in nodes.values():
            cluster.kubectl("delete", "node", node, "--wait=false", check=False)
