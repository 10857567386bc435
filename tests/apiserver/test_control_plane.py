"""Smoke tests proving each piece of the local control plane is real (issue 3).

Real CRD validation, server-side dry-run, resourceVersion preconditions and RBAC are decided by the
kube-apiserver these tests start; helm and promtool are the built binaries. Every test also checks the
negative case, so it fails if the piece it stands for is faked or missing.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from hack.apimetrics import writes_by_resource
from hack.localcluster import ClusterError, KubectlError, LocalCluster, kube_version
from tests.bed.controller_harness import wait_for

SMOKE_GROUP = "smoke.sandkeep.test"

WIDGET_CRD = f"""
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.{SMOKE_GROUP}
spec:
  group: {SMOKE_GROUP}
  scope: Namespaced
  names: {{plural: widgets, singular: widget, kind: Widget}}
  versions:
    - name: v1
      served: true
      storage: true
      subresources: {{status: {{}}}}
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              required: [size]
              properties:
                size: {{type: integer, minimum: 1}}
"""


def widget(namespace: str, name: str, size: object) -> str:
    return json.dumps(
        {
            "apiVersion": f"{SMOKE_GROUP}/v1",
            "kind": "Widget",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"size": size},
        }
    )


def configmap(namespace: str, name: str, **data: str) -> str:
    return json.dumps(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace}, "data": data}
    )


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not true within {timeout}s: {predicate}"
        time.sleep(0.2)


def test_crd_applied_with_kubectl_is_served_and_enforces_its_schema(cluster: LocalCluster, namespace: str) -> None:
    out = cluster.kubectl("apply", "-f", "-", input=WIDGET_CRD).stdout
    assert f"widgets.{SMOKE_GROUP}" in out
    cluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{SMOKE_GROUP}", "--timeout=60s")

    cluster.kubectl("apply", "-f", "-", input=widget(namespace, "good", 3))
    got = cluster.kubectl_json("get", f"widgets.{SMOKE_GROUP}", "good", "-n", namespace)
    assert got["spec"] == {"size": 3}

    with pytest.raises(KubectlError) as wrong_type:
        cluster.kubectl("apply", "-f", "-", input=widget(namespace, "bad-type", "three"))
    assert 'spec.size: Invalid value: "string": spec.size in body must be of type integer' in str(wrong_type.value)

    with pytest.raises(KubectlError) as too_small:
        cluster.kubectl("apply", "-f", "-", input=widget(namespace, "bad-min", 0))
    assert "spec.size in body should be greater than or equal to 1" in str(too_small.value)

    names = cluster.kubectl("get", f"widgets.{SMOKE_GROUP}", "-n", namespace, "-o", "name").stdout.split()
    assert names == [f"widget.{SMOKE_GROUP}/good"]


def test_server_side_dry_run_is_answered_by_the_server_and_creates_nothing(
    cluster: LocalCluster, namespace: str
) -> None:
    dry = cluster.kubectl_json("apply", "--dry-run=server", "-f", "-", input=configmap(namespace, "dry", a="1"))
    # Only the server assigns a uid and a creation time: a client-side dry run would have neither.
    assert dry["metadata"]["uid"]
    assert dry["metadata"]["creationTimestamp"]
    gone = cluster.kubectl("get", "configmap", "dry", "-n", namespace, check=False)
    assert gone.returncode != 0
    assert 'configmaps "dry" not found' in gone.stderr

    # The dry run goes through the server's admission: a namespace that does not exist is refused there.
    with pytest.raises(KubectlError, match='namespaces "no-such-namespace" not found'):
        cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=configmap("no-such-namespace", "dry"))


def test_delete_with_stale_resource_version_is_refused_with_409(cluster: LocalCluster, namespace: str) -> None:
    with cluster.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        created = core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="cm"), data={"v": "1"})
        )
        stale = created.metadata.resource_version
        updated = core.patch_namespaced_config_map("cm", namespace, {"data": {"v": "2"}})
        fresh = updated.metadata.resource_version
        assert fresh != stale

        with pytest.raises(ApiException) as conflict:
            core.delete_namespaced_config_map(
                "cm",
                namespace,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version=stale)),
            )
        assert conflict.value.status == 409
        status = json.loads(conflict.value.body)
        assert status["reason"] == "Conflict"
        assert f"the ResourceVersion in the precondition ({stale}) does not match" in status["message"]
        assert core.read_namespaced_config_map("cm", namespace).data == {"v": "2"}

        core.delete_namespaced_config_map(
            "cm", namespace, body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version=fresh))
        )
        with pytest.raises(ApiException) as missing:
            core.read_namespaced_config_map("cm", namespace)
        assert missing.value.status == 404


def test_service_account_is_denied_until_a_role_binding_allows_it(
    cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    token = cluster.token_for(namespace, "reader")
    assert token.count(".") == 2  # a signed JWT from TokenRequest
    token_config = cluster.kubeconfig_for_token(token, tmp_path / "reader.kubeconfig")
    as_reader = f"system:serviceaccount:{namespace}:reader"

    who = cluster.kubectl_json("auth", "whoami", kubeconfig=token_config)
    assert who["status"]["userInfo"]["username"] == as_reader

    def list_status(api_client: client.ApiClient) -> int:
        try:
            client.CoreV1Api(api_client).list_namespaced_config_map(namespace)
        except ApiException as e:
            return int(e.status)
        return 200

    configuration = client.Configuration()
    configuration.host = cluster.server
    configuration.ssl_ca_cert = str(cluster.ca_file)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(configuration) as reader:
        assert list_status(reader) == 403
        denied = cluster.kubectl("get", "configmaps", "-n", namespace, kubeconfig=token_config, check=False)
        assert denied.returncode != 0
        assert f'User "{as_reader}" cannot list resource "configmaps"' in denied.stderr
        impersonated = cluster.kubectl("get", "configmaps", "-n", namespace, as_user=as_reader, check=False)
        assert impersonated.returncode != 0
        assert f'User "{as_reader}" cannot list resource "configmaps"' in impersonated.stderr

        cluster.kubectl("create", "role", "read-cm", "--verb=get,list", "--resource=configmaps", "-n", namespace)
        binding = ("reader-read-cm", "--role=read-cm", f"--serviceaccount={namespace}:reader")
        cluster.kubectl("create", "rolebinding", *binding, "-n", namespace)
        # The RBAC authorizer reads bindings from an informer cache: allow it a moment to see the new one.
        wait_until(lambda: list_status(reader) == 200)
        cluster.kubectl("get", "configmaps", "-n", namespace, kubeconfig=token_config)
        cluster.kubectl("get", "configmaps", "-n", namespace, as_user=as_reader)
        # The binding grants exactly what it says: writing is still refused.
        still = cluster.kubectl("create", "configmap", "x", "-n", namespace, as_user=as_reader, check=False)
        assert still.returncode != 0
        assert f'User "{as_reader}" cannot create resource "configmaps"' in still.stderr


def test_version_is_the_stamped_pin(cluster: LocalCluster) -> None:
    pinned = kube_version()
    assert pinned.startswith("v1.")
    server = json.loads(cluster.kubectl("get", "--raw", "/version").stdout)
    assert server["gitVersion"] == pinned
    assert server["minor"] == pinned.split(".")[1]
    versions = cluster.kubectl_json("version")
    assert versions["clientVersion"]["gitVersion"] == pinned


def test_nodes_metrics_and_logs(cluster: LocalCluster) -> None:
    node = cluster.create_node("smoke-node-1", ready=True)
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "smoke-node-1"
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    assert "smoke-node-1" in cluster.kubectl("get", "nodes", "-o", "name").stdout

    assert "apiserver_request_total{" in cluster.metrics_text()
    logs = cluster.logs()
    assert "----- etcd" in logs
    assert "----- kube-apiserver" in logs
    assert "----- kube-controller-manager" in logs


def test_write_counts_leave_out_reads_and_collection_deletes() -> None:
    """Only writes a client of ours could make count: collection deletes are kube-controller-manager's."""
    text = "\n".join(
        [
            "# TYPE apiserver_request_total counter",
            'apiserver_request_total{code="201",resource="events",scope="namespace",verb="POST"} 3',
            'apiserver_request_total{code="200",resource="events",scope="namespace",verb="DELETE"} 7',
            'apiserver_request_total{code="200",resource="events",scope="namespace",verb="LIST"} 9',
            'apiserver_request_total{code="200",resource="retainedsandboxes",scope="resource",verb="DELETE"} 2',
            'apiserver_request_total{code="200",resource="retainedsandboxes",scope="resource",verb="APPLY"} 1',
            'apiserver_request_total{code="200",resource="nodes",scope="cluster",verb="DELETE"} 4',
            'apiserver_request_duration_seconds_count{resource="events",verb="POST"} 5',
        ]
    )
    assert writes_by_resource(text) == {"events": 3.0, "retainedsandboxes": 3.0}


def test_the_controller_manager_runs_workloads_namespaces_and_aggregation(cluster: LocalCluster) -> None:
    """kube-controller-manager's loops act: a Deployment gets Pods through its ReplicaSet, a new namespace its
    `default` ServiceAccount, an aggregated ClusterRole the rules of the roles it selects, and a deleted
    namespace goes away with what was in it."""
    ns = f"kcm-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("create", "deployment", "web", "--image=registry.invalid/web:1", "--replicas=2", "-n", ns)
    wait_for("two Pods of the Deployment", lambda: len(cluster.kubectl_json("get", "pods", "-n", ns)["items"]) == 2)
    wait_for(
        "the default ServiceAccount",
        lambda: cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0,
    )
    label = f"kcm-test/{ns}"
    aggregate = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"{ns}-all"},
        "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {label: "true"}}]},
    }
    part = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"{ns}-part", "labels": {label: "true"}},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
    }
    try:
        cluster.apply([aggregate, part])
        wait_for(
            "the aggregated rules",
            lambda: cluster.kubectl_json("get", "clusterrole", f"{ns}-all").get("rules") == part["rules"],
        )
    finally:
        cluster.kubectl("delete", "clusterrole", f"{ns}-all", f"{ns}-part", "--ignore-not-found", check=False)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    wait_for(
        "the namespace to be removed",
        lambda: cluster.kubectl("get", "namespace", ns, check=False).returncode != 0,
        timeout=60,
    )


@pytest.mark.cluster
@pytest.mark.slow
def test_stop_ends_every_process_and_removes_the_directory(tools: Path, tmp_path: Path) -> None:
    local = LocalCluster(tmp_path, tools)
    with local:
        pids = local.pids()
        assert len(pids) == 3  # etcd, kube-apiserver, kube-controller-manager
        directory = local.dir
        assert directory is not None and directory.is_dir()
        assert local.startup_seconds is not None
        print(f"start-up: {local.startup_seconds:.2f}s", file=sys.stderr)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"pid {pid} survived stop()"
    assert not directory.exists()
    assert local.pids() == []


def processes_under(path: Path) -> list[int]:
    """Pids of live processes whose command line mentions `path` (read from /proc, nothing is signalled)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.cluster
@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept"])
def test_failed_start_raises_with_component_logs_and_leaves_no_process(
    tools: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    # A real etcd, then a kube-apiserver that exits at once: the error must carry its log, etcd must be
    # stopped, and the directory kept only when asked to.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for tool in ("etcd", "kubectl", "kube-controller-manager"):
        (fake_bin / tool).symlink_to(tools / tool)
    (fake_bin / "kube-apiserver").write_text("#!/bin/sh\necho 'fake apiserver: refusing to start' >&2\nexit 3\n")
    (fake_bin / "kube-apiserver").chmod(0o755)
    if keep:
        monkeypatch.setenv("SANDKEEP_KEEP_CLUSTER_DIR", "1")
    else:
        monkeypatch.delenv("SANDKEEP_KEEP_CLUSTER_DIR", raising=False)
    work = tmp_path / "work"

    local = LocalCluster(work, fake_bin)
    with pytest.raises(ClusterError) as failed:
        local.start()
    message = str(failed.value)
    assert "kube-apiserver exited with 3" in message
    assert "fake apiserver: refusing to start" in message
    assert "----- etcd" in message
    assert local.pids() == []
    assert processes_under(work) == []
    kept = list(work.iterdir())
    if keep:
        assert len(kept) == 1
        assert "refusing to start" in (kept[0] / "kube-apiserver.log").read_text()
    else:
        assert kept == []


def write_chart(root: Path) -> Path:
    """A trivial chart that needs a current Kubernetes and prints the version helm renders for."""
    chart = root / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: smoke\nversion: 0.1.0\nkubeVersion: '>=1.30.0-0'\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(
        textwrap.dedent(
            """\
            apiVersion: v1
            kind: ConfigMap
            metadata:
              name: {{ .Release.Name }}-greeting
            data:
              greeting: {{ .Values.greeting | quote }}
              kubeVersion: {{ .Capabilities.KubeVersion.Version | quote }}
            """
        )
    )
    return chart


def run_helm(tools: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"HELM_CACHE_HOME": str(home), "HELM_CONFIG_HOME": str(home), "HELM_DATA_HOME": str(home), "PATH": str(tools)}
    return subprocess.run([str(tools / "helm"), *args], capture_output=True, text=True, env=env, timeout=60)


def test_helm_template_and_lint_a_trivial_chart(tools: Path, tmp_path: Path) -> None:
    chart = write_chart(tmp_path)
    pin = f"--kube-version={kube_version()}"

    rendered = run_helm(tools, tmp_path / "h", "template", "rel", str(chart), pin, "--set", "greeting=hi there")
    assert rendered.returncode == 0, rendered.stderr
    assert "name: rel-greeting" in rendered.stdout
    assert 'greeting: "hi there"' in rendered.stdout
    assert f'kubeVersion: "{kube_version()}"' in rendered.stdout

    too_old = run_helm(tools, tmp_path / "h", "template", "rel", str(chart), "--kube-version=v1.29.0")
    assert too_old.returncode != 0
    assert "chart requires kubeVersion: >=1.30.0-0" in too_old.stderr

    linted = run_helm(tools, tmp_path / "h", "lint", str(chart), pin)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in linted.stdout

    (chart / "templates" / "broken.yaml").write_text("kind: ConfigMap\nname: {{ .Values.greeting \n")
    broken = run_helm(tools, tmp_path / "h", "lint", str(chart), pin)
    assert broken.returncode != 0
    assert "1 chart(s) linted, 1 chart(s) failed" in broken.stderr
    assert "unclosed action" in broken.stdout


def test_helm_defaults_to_a_current_kubernetes(tools: Path, tmp_path: Path) -> None:
    # Without --kube-version, `helm template` and `helm lint` check the chart's kubeVersion against the
    # version compiled into helm; a chart that requires a current Kubernetes must still render.
    chart = write_chart(tmp_path)
    rendered = run_helm(tools, tmp_path / "h", "template", "rel", str(chart))
    assert rendered.returncode == 0, rendered.stderr
    linted = run_helm(tools, tmp_path / "h", "lint", str(chart))
    assert linted.returncode == 0, linted.stdout + linted.stderr


RULES = """\
groups:
  - name: smoke
    rules:
      - alert: DiskNearlyFull
        expr: disk_free_ratio < 0.1
        for: 5m
        labels: {severity: page}
        annotations: {summary: "disk of {{ $labels.node }} nearly full"}
"""

RULE_TESTS = """\
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'disk_free_ratio{node="n1"}'
        values: '0.05x15'
      - series: 'disk_free_ratio{node="n2"}'
        values: '0.5x15'
    alert_rule_test:
      - eval_time: 3m
        alertname: DiskNearlyFull
        exp_alerts: []
      - eval_time: 10m
        alertname: DiskNearlyFull
        exp_alerts:
          - exp_labels: {severity: page, node: n1}
            exp_annotations: {summary: "disk of n1 nearly full"}
"""


def test_promtool_checks_and_tests_rules(tools: Path, tmp_path: Path) -> None:
    def promtool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(tools / "promtool"), *args], capture_output=True, text=True, cwd=tmp_path, timeout=60
        )

    (tmp_path / "rules.yaml").write_text(RULES)
    (tmp_path / "tests.yaml").write_text(RULE_TESTS)
    checked = promtool("check", "rules", "rules.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rules found" in checked.stdout

    tested = promtool("test", "rules", "tests.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout

    # An expectation that the alert does not fire is reported as a failure, so the test above means something.
    (tmp_path / "wrong.yaml").write_text(RULE_TESTS.replace("node: n1", "node: n2"))
    wrong = promtool("test", "rules", "wrong.yaml")
    assert wrong.returncode != 0
    assert "FAILED" in wrong.stdout + wrong.stderr

    (tmp_path / "bad.yaml").write_text(RULES.replace("disk_free_ratio < 0.1", "disk_free_ratio <"))
    bad = promtool("check", "rules", "bad.yaml")
    assert bad.returncode != 0
