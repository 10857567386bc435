"""The CRDs installed, upgraded and uninstalled by the chart (crds.enabled, crds.keep), on a real API server.

A cluster of this module's own with no sandkeep CRDs in it, as a new cluster is: the chart is what creates
them. The README's install commands run as written; an upgrade to a chart whose CRD adds a field makes
the API server accept the field; `helm uninstall` leaves the CRDs and every object with `crds.keep`
(the default) and removes them without it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from controller.rules import contracts as c
from hack.localcluster import LocalCluster
from hack.registry import LocalRegistry
from hack.release import package_chart, push_chart
from tests.bed.chart import CHART, MONITORING_CRDS, NO_HOOKS, helm
from tests.bed.controller_harness import wait_for
from tests.bed.own_cluster import own_cluster

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operations.md"
HAND_OVER = "# Hand the CRDs to the release sandkeep in namespace sandkeep (once, before the first upgrade):"

pytestmark = pytest.mark.xdist_group("chart-crds")  # one cluster for the module, on one worker

CRDS = tuple(f"{plural}.{c.GROUP}" for plural in (c.SANDBOX_PLURAL, c.POLICY_PLURAL, c.SESSION_PLURAL))


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """No sandkeep CRDs (the chart installs them); the prometheus-operator ones the monitors need."""
    clusters = own_cluster(tmp_path_factory.mktemp("crds-cluster"), crds=False)
    local = next(clusters)
    try:
        local.kubectl("apply", "--server-side", "-f", str(MONITORING_CRDS))
        for plural in ("servicemonitors", "podmonitors", "prometheusrules"):
            local.kubectl("wait", "--for=condition=Established", f"crd/{plural}.monitoring.coreos.com", "--timeout=60s")
        yield local
    finally:
        clusters.close()


def crds_present(cluster: LocalCluster) -> set[str]:
    found = cluster.kubectl("get", "crd", *CRDS, "-o", "name", "--ignore-not-found").stdout.split()
    return {name.removeprefix("customresourcedefinition.apiextensions.k8s.io/") for name in found}


def remove_crds(cluster: LocalCluster) -> None:
    cluster.kubectl("delete", "crd", *CRDS, "--ignore-not-found", "--wait=true", "--timeout=60s", check=False)


def readme_helm_commands(registry: str, version: str) -> list[list[str]]:
    """The helm commands of the chart README's first shell block, split as a shell would split them, with its
    REGISTRY and VERSION those of a release pushed to this test's registry (plain HTTP, as only a test's is)."""
    block = (CHART / "README.md").read_text().split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line.startswith("helm ")]
    commands = [shlex.split(line.replace("REGISTRY", registry).replace("VERSION", version)) for line in lines]
    return [[*cmd, "--plain-http"] for cmd in commands]


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """This tree's chart released as VERSION to a real registry (hack/release.py): (its host, the version). The
    image is never pulled here (no kubelet), so the chart names one by a digest of nothing."""
    version = "0.0.1-readme.1"
    with LocalRegistry(tmp_path_factory.mktemp("registry")) as registry:
        image = f"{registry.host}/sandkeep@sha256:{'0' * 64}"
        package = package_chart(REPO, version, image, tmp_path_factory.mktemp("package"))
        push_chart(package, registry.host, plain_http=True)
        yield registry.host, version


def test_the_readme_install_commands_work_as_written_and_uninstall_keeps_the_crds(
    tools: Path, bare_cluster: LocalCluster, released: tuple[str, str]
) -> None:
    cluster = bare_cluster
    commands = readme_helm_commands(*released)
    assert [cmd[:2] for cmd in commands] == [["helm", "install"], ["helm", "upgrade"]]
    assert crds_present(cluster) == set()
    try:
        for cmd in commands:
            result = helm(tools, *cmd[1:], kubeconfig=cluster.kubeconfig)
            assert "STATUS: deployed" in result.stdout, result.stdout
        for kind, name in (
            ("deployment", "sandkeep-controller"),
            ("daemonset", "sandkeep-agent"),
            ("prometheusrule", "sandkeep"),
            ("podmonitor", "sandkeep-agent"),
            ("servicemonitor", "sandkeep-controller"),
            ("configmap", "sandkeep-dashboard"),
        ):
            cluster.kubectl("get", kind, name, "--namespace=sandkeep")
        assert (
            cluster.kubectl_json("get", "deployment", "sandkeep-controller", "-n", "sandkeep")["spec"]["replicas"] == 2
        )
        # the release created the CRDs, owns them, and marks them to be kept
        for name in CRDS:
            crd = cluster.kubectl_json("get", "crd", name)
            assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "sandkeep"
            assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        cluster.kubectl("create", "namespace", "work")
        policy = {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": {"name": "p", "namespace": "work"}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps({**policy, "spec": {"retention": "1h"}}))
        uninstall = helm(
            tools, "uninstall", "sandkeep", "--namespace=sandkeep", NO_HOOKS, kubeconfig=cluster.kubeconfig
        )
        assert "kept due to the resource policy" in uninstall.stdout + uninstall.stderr
        # the CRDs, and the objects of their kinds, are still there
        assert crds_present(cluster) == set(CRDS)
        assert cluster.kubectl_json("get", c.POLICY_PLURAL, "p", "-n", "work")["spec"]["retention"] == "1h"
    finally:
        helm(
            tools, "uninstall", "sandkeep", "--namespace=sandkeep", NO_HOOKS, kubeconfig=cluster.kubeconfig, check=False
        )
        cluster.kubectl("delete", "namespace", "sandkeep", "work", "--ignore-not-found", "--timeout=90s", check=False)
        remove_crds(cluster)  # the next test starts from a cluster without them


def older_chart(tmp_path: Path) -> Path:
    """The chart as a release before SandboxPolicy's `releasePriority` was added: the field gone from its CRD."""
    old = tmp_path / "sandkeep"
    shutil.copytree(CHART, old, symlinks=False)  # files/crds copied as real files
    path = old / "files" / "crds" / f"{c.GROUP}_{c.POLICY_PLURAL}.yaml"
    crd = yaml.safe_load(path.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    del spec["properties"]["releasePriority"]
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return old


def test_helm_upgrade_upgrades_the_crds_and_uninstall_without_keep_removes_them(
    tools: Path, bare_cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster = bare_cluster
    assert crds_present(cluster) == set()
    release, ns = f"crd-{secrets.token_hex(3)}", "sandkeep-crds"
    cluster.kubectl("create", "namespace", ns)
    policy = {
        "apiVersion": c.API_VERSION,
        "kind": c.POLICY_KIND,
        "metadata": {"name": "p", "namespace": ns},
        "spec": {"retention": "1h", "releasePriority": str(c.ReleasePriority.FIRST)},
    }

    def apply_policy() -> tuple[int, str]:
        applied = cluster.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(policy), check=False)
        return applied.returncode, applied.stderr

    def policy_schema() -> dict[str, object]:
        crd = cluster.kubectl_json("get", "crd", f"{c.POLICY_PLURAL}.{c.GROUP}")
        props: dict[str, object] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        return props["spec"]["properties"]  # type: ignore[index,no-any-return]

    try:
        base = [f"--namespace={ns}", "--set=crds.keep=false", "--wait=false"]
        helm(tools, "install", release, str(older_chart(tmp_path)), *base, kubeconfig=cluster.kubeconfig)
        assert "releasePriority" not in policy_schema()
        code, err = apply_policy()
        assert code != 0 and "releasePriority" in err, err  # the older API does not know the field
        helm(tools, "upgrade", release, str(CHART), *base, kubeconfig=cluster.kubeconfig)
        assert "releasePriority" in policy_schema()
        wait_for("the API server to serve the upgraded CRD", lambda: apply_policy()[0] == 0, timeout=30)
        got = cluster.kubectl_json("get", c.POLICY_PLURAL, "p", "-n", ns)
        assert got["spec"]["releasePriority"] == str(c.ReleasePriority.FIRST)
        # --wait: until the API server has deleted the CRDs and their objects (slow on a loaded machine).
        uninstall = (release, f"--namespace={ns}", NO_HOOKS, "--wait", "--timeout=5m")
        helm(tools, "uninstall", *uninstall, kubeconfig=cluster.kubeconfig, timeout=330)
        wait_for("the CRDs to be removed with the release", lambda: crds_present(cluster) == set(), timeout=60)
    finally:
        helm(tools, "uninstall", release, f"--namespace={ns}", NO_HOOKS, kubeconfig=cluster.kubeconfig, check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
        remove_crds(cluster)


def test_crds_applied_before_the_chart_owned_them_are_handed_over_as_the_guide_says(
    tools: Path, bare_cluster: LocalCluster
) -> None:
    """An install from before the CRDs were templates has them unowned (Helm's crds/ directory, or
    `kubectl apply`): Helm refuses to take them until the guide's commands hand them to the release. Such an
    older install lacks the CRDs added since (here SandboxSession): the hand-over skips them, the install adds them."""
    cluster = bare_cluster
    assert crds_present(cluster) == set()
    cluster.kubectl("wait", "--for=delete", "namespace/sandkeep", "--timeout=90s", check=False)  # an earlier test's
    blocks = re.findall(r"```sh\n(.*?)```", GUIDE.read_text(), re.S)
    [hand_over] = [b for b in blocks if b.startswith(HAND_OVER + "\n")]
    install = ["install", "sandkeep", str(CHART), "--namespace=sandkeep", "--create-namespace", "--wait=false"]
    try:
        for older in ("sandkeep.io_retainedsandboxes.yaml", "sandkeep.io_sandboxpolicies.yaml"):
            cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / older))
        assert crds_present(cluster) == set(CRDS[:2])
        refused = helm(tools, *install, kubeconfig=cluster.kubeconfig, check=False)
        assert refused.returncode != 0 and "invalid ownership metadata" in refused.stderr, refused.stderr
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PATH": f"{cluster.bin}:{os.environ['PATH']}"}
        ran = subprocess.run(["bash", "-euo", "pipefail", "-c", hand_over], env=env, capture_output=True, text=True)
        assert ran.returncode == 0, ran.stderr
        helm(
            tools, "uninstall", "sandkeep", "--namespace=sandkeep", NO_HOOKS, kubeconfig=cluster.kubeconfig, check=False
        )
        done = helm(tools, *install, kubeconfig=cluster.kubeconfig)
        assert "STATUS: deployed" in done.stdout
        for name in CRDS:
            crd = cluster.kubectl_json("get", "crd", name)
            assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "sandkeep"
    finally:
        helm(
            tools, "uninstall", "sandkeep", "--namespace=sandkeep", NO_HOOKS, kubeconfig=cluster.kubeconfig, check=False
        )
        cluster.kubectl("delete", "namespace", "sandkeep", "--ignore-not-found", "--timeout=90s", check=False)
        remove_crds(cluster)
