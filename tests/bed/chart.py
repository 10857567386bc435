"""The Helm chart as the tests run it: the built helm, `helm template` for the local control plane's version,
the rendered objects, the values the chart tests share (everything turned on; no CRDs, no hooks), the
values' `# --` documentation and a workload's first container.

Used by the chart's own tests (tests/chart/) and by those that install it on the API server (tests/apiserver/).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.cluster.settings import ControllerSettings
from hack.chart_values_table import documented_keys
from hack.localcluster import REPO, kube_version

CHART = REPO / "charts" / "sandkeep"
MONITORING_CRDS = REPO / "tests" / "fixtures" / "prometheus-operator-crds.yaml"
# The worker's shared cluster has the CRDs applied with kubectl (tests/bed/controller_harness.install_crds) and
# holds several releases at once, so an install there does not own them (as a second install in a real
# cluster); tests/apiserver/test_chart_crds.py installs and upgrades them with the chart on a cluster of its own.
NO_CRDS = "--set=crds.enabled=false"
# The uninstall hook is a Job, and no kubelet runs Pods on the API-only control plane: helm would wait for
# it until its timeout. Its command runs in tests/apiserver/test_uninstall.py, the whole hook in tests/node/test_e2e.py.
NO_HOOKS = "--no-hooks"

EVERYTHING_ON = [
    "--set=monitoring.enabled=true",
    "--set=dashboard.enabled=true",
    "--set=controller.antiAffinity=hard",
    "--set=monitoring.alertLabels.team=platform",
    "--set=imagePullSecrets[0].name=regcred",
    "--set=controller.priorityClassName=system-cluster-critical",
    "--set=controller.serviceAccount.annotations.example\\.com/role=sandkeep",
    "--set=logFormat=json",
    "--set=commonLabels.team=platform",
    "--set=image.registry=registry.example.com:5000",
    "--set=image.digest=sha256:" + "ab" * 32,
    "--set=controller.watchNamespaces={team-a,team-b}",
    "--set=controller.workers=4",
    "--set=controller.leaseDuration=30",
    "--set=controller.extraArgs={--identity=$(POD_NAME)}",
    "--set=controller.extraEnv[0].name=POD_NAME",
    "--set=controller.extraEnv[0].valueFrom.fieldRef.fieldPath=metadata.name",
    "--set=agent.extraArgs={--pressure-high=90}",
    "--set=agent.extraEnv[0].name=TZ",
    "--set=agent.extraEnv[0].value=UTC",
    "--set=controller.topologySpreadConstraints[0].maxSkew=1",
    "--set=controller.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
    "--set=controller.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
    "--set=agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
    ".matchExpressions[0].key=example.com/retains",
    "--set=agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
    ".matchExpressions[0].operator=Exists",
    "--set=monitoring.alerts.SandkeepRootNearlyFull.enabled=false",
    "--set=monitoring.alerts.SandkeepAgentDown.for=10m",
    "--set=monitoring.alerts.SandkeepAgentDown.severity=page",
    "--set=monitoring.runbookBaseURL=https://wiki.example.com/sandkeep",
]


def helm(
    tools: Path, *args: str, check: bool = True, kubeconfig: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the built helm; raise with its stderr when it fails and `check` is set."""
    cmd = [str(tools / "helm"), *args]
    if kubeconfig is not None:
        cmd.append(f"--kubeconfig={kubeconfig}")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)  # the README's paths
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def render(tools: Path, *values: str, namespace: str = "sandkeep") -> str:
    """`helm template` of the chart, for the Kubernetes version of the local control plane."""
    args = ["template", "sk", str(CHART), f"--namespace={namespace}", f"--kube-version={kube_version()}", *values]
    return helm(tools, *args).stdout


def objects(manifest: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def find(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, f"expected one {kind} named *{suffix}, got {[d['metadata']['name'] for d in matches]}"
    return matches[0]


def refused(tools: Path, value: str, words: str) -> None:
    result = helm(tools, "template", "sk", str(CHART), f"--kube-version={kube_version()}", value, check=False)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def controller_settings(manifest: str) -> ControllerSettings:
    """The rendered Deployment's SANDKEEP_* environment, read by the controller's own settings."""
    container = find(objects(manifest), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("SANDKEEP_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return ControllerSettings()


def values_docs() -> dict[tuple[str, ...], str]:
    """The `# --` documentation of each value, as hack/chart_values_table.py reads it."""
    return documented_keys((CHART / "values.yaml").read_text())


def container_of(doc: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = doc["spec"]["template"]["spec"]["containers"][0]
    return container
