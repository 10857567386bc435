"""The Helm chart, its image and e2e script, checked by the real tools.

`helm lint` and `helm template` run the built helm, with no server: the rendered objects are read here.
Monitoring (alerts, runbooks, dashboard) is in test_chart_monitoring.py, the security context and RBAC
shape in test_chart_security.py, sessions in test_chart_sessions.py. The same manifests on the real API
server (`--dry-run=server`, `helm install`, the Pods the real controllers make) are
tests/apiserver/test_chart_install.py's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from controller.observe import logs
from controller.rules import contracts as c
from hack.localcluster import REPO, kube_version
from tests.bed.chart import CHART, EVERYTHING_ON, container_of, find, helm, objects, refused, render

E2E_SCRIPT = REPO / "hack" / "kind-e2e.sh"
CRD_KIND = "CustomResourceDefinition"


# --- lint and render -----------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [[], EVERYTHING_ON], ids=["defaults", "everything-on"])
def test_helm_lint_is_clean(tools: Path, values: list[str]) -> None:
    result = helm(tools, "lint", str(CHART), "--strict", f"--kube-version={kube_version()}", *values)
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_defaults_render_every_component(tools: Path) -> None:
    docs = objects(render(tools))
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == [
        f"CSIDriver/{c.CSI_DRIVER}",
        "ClusterRole/sk-sandkeep-agent",
        "ClusterRole/sk-sandkeep-controller",
        "ClusterRole/sk-sandkeep-edit",
        "ClusterRole/sk-sandkeep-uninstall",
        "ClusterRole/sk-sandkeep-view",
        "ClusterRoleBinding/sk-sandkeep-agent",
        "ClusterRoleBinding/sk-sandkeep-controller",
        "ClusterRoleBinding/sk-sandkeep-uninstall",
        "ConfigMap/sk-sandkeep-agent-seccomp",
        f"{CRD_KIND}/{c.SANDBOX_PLURAL}.{c.GROUP}",
        f"{CRD_KIND}/{c.POLICY_PLURAL}.{c.GROUP}",
        f"{CRD_KIND}/{c.SESSION_PLURAL}.{c.GROUP}",
        "DaemonSet/sk-sandkeep-agent",
        "Deployment/sk-sandkeep-controller",
        "Job/sk-sandkeep-uninstall",
        "PodDisruptionBudget/sk-sandkeep-controller",
        "ResourceQuota/sk-sandkeep-critical-pods",
        "Role/sk-sandkeep-agent-leases",
        "Role/sk-sandkeep-controller-leases",
        "Role/sk-sandkeep-uninstall",
        "RoleBinding/sk-sandkeep-agent-leases",
        "RoleBinding/sk-sandkeep-controller-leases",
        "RoleBinding/sk-sandkeep-uninstall",
        "Service/sk-sandkeep-agent-metrics",
        "Service/sk-sandkeep-controller-metrics",
        "ServiceAccount/sk-sandkeep-agent",
        "ServiceAccount/sk-sandkeep-controller",
        "ServiceAccount/sk-sandkeep-uninstall",
        "ValidatingAdmissionPolicy/sk-sandkeep-agent-node-scope",
        "ValidatingAdmissionPolicy/sk-sandkeep-pins",
        "ValidatingAdmissionPolicyBinding/sk-sandkeep-agent-node-scope",
        "ValidatingAdmissionPolicyBinding/sk-sandkeep-pins",
    ]
    deployment = find(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {p["httpGet"]["path"] for p in (container["livenessProbe"], container["readinessProbe"])} == {
        "/healthz",
        "/readyz",
    }
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SANDKEEP_RETENTION"] == "72h" and env["SANDKEEP_DRY_RUN"] == "false"


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("controller.replicas=two", "/controller/replicas"),
        ("agent.root=relative/path", "/agent/root"),
        ("agent.root=/", "/agent/root"),
        ("agent.root=/var/lib/../../etc", "/agent/root"),
        ("settings.retention=3 days", "/settings/retention"),
        ("settings.maxPin=", "/settings/maxPin"),
        ("agent.stuckAfter=10 minutes", "/agent/stuckAfter"),
        ("controller.antiAffinity=sometimes", "/controller/antiAffinity"),
        ("logLevel=LOUD", "/logLevel"),
        ("controller.metricsPort=70000", "/controller/metricsPort"),
        ("monitoring.enabeld=true", "enabeld"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("settings.dryRun=maybe", "/settings/dryRun"),
        ("agent.appArmorProfile.type=Localhost", "localhostProfile"),
        ("logFormat=yaml", "/logFormat"),
        ("commonLabels.team[0]=a", "/commonLabels/team"),
        ("image.digest=abc123", "/image/digest"),
        ("image.registry=https://registry.example.com", "/image/registry"),
        ("controller.extraArgs=--workers=4", "/controller/extraArgs"),
        ("agent.extraArgs[0]=pressure-high=90", "/agent/extraArgs/0"),
        ("controller.extraEnv[0].value=x", "name"),
        ("agent.extraEnv=TZ", "/agent/extraEnv"),
        ("controller.affinity.nodeAfinity.x=y", "nodeAfinity"),
        ("agent.topologySpreadConstraints[0].maxSkew=1", "topologyKey"),
        ("controller.podSecurityContext.runAsUser=root", "/controller/podSecurityContext/runAsUser"),
        ("agent.securityContext.capabilities.add=KILL", "/agent/securityContext/capabilities/add"),
        ("controller.watchNamespaces[0]=Team_A", "/controller/watchNamespaces/0"),
        ("controller.workers=0", "/controller/workers"),
        ("controller.leaseDuration=15s", "/controller/leaseDuration"),
        ("agent.quarantineGrace=1 day", "/agent/quarantineGrace"),
        ("agent.quarantineGrace=-1h", "/agent/quarantineGrace"),
        ("agent.sizeBudget=2 minutes", "/agent/sizeBudget"),
        ("criticalPriorityQuota.pods=many", "/criticalPriorityQuota/pods"),
        ("monitoring.serviceMonitor.enabled=yes", "/monitoring/serviceMonitor/enabled"),
        ("monitoring.podMonitor.enabeld=false", "enabeld"),
        ("monitoring.prometheusRule.enabled=off", "/monitoring/prometheusRule/enabled"),
        ("monitoring.runbookBaseURL=docs/runbooks.md", "/monitoring/runbookBaseURL"),
        ("monitoring.alerts.SandkeepAgentDwn.enabled=false", "SandkeepAgentDwn"),
        ("monitoring.alerts.SandkeepAgentDown.enabled=no", "/monitoring/alerts/SandkeepAgentDown/enabled"),
        ("monitoring.alerts.SandkeepAgentDown.for=5 minutes", "/monitoring/alerts/SandkeepAgentDown/for"),
        ("monitoring.alerts.SandkeepAgentDown.labels.bad-name=x", "bad-name"),
        ("monitoring.serviceMonitor=null", "serviceMonitor"),
        # a session bound cannot be removed or mistyped (issue 25)
        ("sessions.maxPerUser=-1", "/sessions/maxPerUser"),
        ("sessions.maxPerNamespace=many", "/sessions/maxPerNamespace"),
        ("sessions.minOwnerId=0", "/sessions/minOwnerId"),
        ("sessions.runAsUser=0", "/sessions/runAsUser"),
        ("sessions.resources.limits.cpu=null", "cpu"),
        ("sessions.resources.limits.gpu=1", "gpu"),
        ("sessions.allowedImages[0]=not an image", "/sessions/allowedImages/0"),
    ],
)
def test_a_wrong_value_fails_at_template_time(tools: Path, value: str, complaint: str) -> None:
    result = helm(
        tools, "template", "sk", str(CHART), f"--kube-version={kube_version()}", f"--set={value}", check=False
    )
    assert result.returncode != 0, f"{value} was accepted"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr, result.stderr


def test_schema_durations_agree_with_the_parser(tools: Path) -> None:
    # The schema's pattern and controller/rules/durations.py must accept and refuse the same spellings.
    from controller.rules.durations import Invalid, parse_duration

    template = ("template", "sk", str(CHART), f"--kube-version={kube_version()}")
    for text in ("72h", "30d", "2w", "1h30m", "45s", "0", "10m"):
        assert not isinstance(parse_duration(text), Invalid)
        helm(tools, *template, f"--set-string=settings.retention={text}")
    for text in ("3 days", "h", "1.5h", "-1h", "72"):
        assert isinstance(parse_duration(text), Invalid), text
        result = helm(tools, *template, f"--set-string=settings.retention={text}", check=False)
        assert result.returncode != 0, f"the schema accepted {text!r}, which the controller would refuse at start"


# --- escape hatches --------------------------------------------------------------------------------------
def test_every_escape_hatch_reaches_the_manifest(tools: Path) -> None:
    docs = objects(render(tools, *EVERYTHING_ON))
    deployment, daemonset = find(docs, "Deployment"), find(docs, "DaemonSet")
    for doc in docs:  # commonLabels on every object, and on the pods
        assert doc["metadata"]["labels"]["team"] == "platform", doc["metadata"]["name"]
    for workload in (deployment, daemonset):
        pod = workload["spec"]["template"]
        assert pod["metadata"]["labels"]["team"] == "platform"
        assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        container = container_of(workload)
        assert container["image"] == "registry.example.com:5000/ghcr.io/sandkeep/sandkeep@sha256:" + "ab" * 32
        assert {"name": "SANDKEEP_LOG_FORMAT", "value": "json"} in container["env"]

    controller = container_of(deployment)
    assert controller["args"][-5:] == [
        "--watch-namespace=team-a",
        "--watch-namespace=team-b",
        "--workers=4",
        "--lease-duration=30",
        "--identity=$(POD_NAME)",
    ]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in controller["env"]
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread == [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]},
        }
    ]

    agent = container_of(daemonset)
    assert agent["args"][-1] == "--pressure-high=90"
    assert {"name": "TZ", "value": "UTC"} in agent["env"]
    terms = daemonset["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    assert terms["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "example.com/retains", "operator": "Exists"}
    ]


def test_defaults_keep_the_image_tag_and_schedule_on_linux_only(tools: Path) -> None:
    docs = objects(render(tools))
    for kind in ("Deployment", "DaemonSet"):
        workload = find(docs, kind)
        assert (
            container_of(workload)["image"]
            == "ghcr.io/sandkeep/sandkeep:" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
        )
        assert workload["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
        assert {"name": "SANDKEEP_LOG_FORMAT", "value": "text"} in container_of(workload)["env"]
        assert "team" not in workload["metadata"]["labels"]
    args = container_of(find(docs, "Deployment"))["args"]
    assert not any(a.startswith(("--workers", "--lease-duration", "--watch-namespace")) for a in args)


def test_common_and_pod_labels_never_replace_the_charts_own_labels(tools: Path) -> None:
    values = [
        "--set=commonLabels.team=common",
        "--set=commonLabels.app\\.kubernetes\\.io/name=other",
        "--set=commonLabels.app\\.kubernetes\\.io/component=other",
        "--set=agent.podLabels.team=agents",
        "--set=agent.podLabels.app\\.kubernetes\\.io/component=other",
    ]
    docs = objects(render(tools, *values))  # a duplicate key would not even parse
    daemonset = find(docs, "DaemonSet")
    assert daemonset["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"
    assert daemonset["metadata"]["labels"]["app.kubernetes.io/name"] == "sandkeep"
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert pod_labels == {**daemonset["spec"]["selector"]["matchLabels"], "team": "agents"}
    assert find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]["team"] == "common"


def test_openshift_restricted_scc_can_drop_the_fixed_user_and_group(tools: Path) -> None:
    values = [
        "--set=controller.podSecurityContext.runAsUser=null",
        "--set=controller.podSecurityContext.runAsGroup=null",
    ]
    pod = find(objects(render(tools, *values)), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # and a container override is taken as written (here a fixed uid some platforms require)
    values = ["--set=controller.securityContext.runAsUser=1000680000"]
    container = container_of(find(objects(render(tools, *values)), "Deployment"))
    assert container["securityContext"]["runAsUser"] == 1000680000
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_controller_affinity_adds_to_the_anti_affinity_or_replaces_it(tools: Path) -> None:
    node = {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}
        ]
    }
    given = "--set-json=controller.affinity=" + json.dumps({"nodeAffinity": node})
    affinity = find(objects(render(tools, given)), "Deployment")["spec"]["template"]["spec"]["affinity"]
    assert affinity["nodeAffinity"] == node
    assert set(affinity) == {"nodeAffinity", "podAntiAffinity"}
    assert "preferredDuringSchedulingIgnoredDuringExecution" in affinity["podAntiAffinity"]
    own = "--set-json=controller.affinity.podAntiAffinity={}"
    affinity = find(objects(render(tools, own)), "Deployment")["spec"]["template"]["spec"].get("affinity")
    assert affinity == {"podAntiAffinity": {}}
    none = find(objects(render(tools, "--set=controller.antiAffinity=none")), "Deployment")
    assert "affinity" not in none["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("values", "classes"),
    [
        ([], ["system-node-critical"]),
        (
            ["--set=controller.priorityClassName=system-cluster-critical"],
            ["system-node-critical", "system-cluster-critical"],
        ),
        (["--set=agent.priorityClassName=", "--set=controller.priorityClassName=batch-high"], None),
        (["--set=criticalPriorityQuota.enabled=false"], None),
    ],
)
def test_critical_priority_quota_covers_exactly_the_critical_classes_in_use(
    tools: Path, values: list[str], classes: list[str] | None
) -> None:
    quotas = [d for d in objects(render(tools, *values)) if d["kind"] == "ResourceQuota"]
    if classes is None:
        assert quotas == []
        return
    (quota,) = quotas
    assert quota["spec"]["scopeSelector"]["matchExpressions"] == [
        {"scopeName": "PriorityClass", "operator": "In", "values": classes}
    ]
    assert quota["spec"]["hard"] == {"pods": "10000"}


@pytest.mark.parametrize(("kind", "command"), [("Deployment", "controller"), ("DaemonSet", "agent")])
def test_container_args_are_accepted_by_the_real_command_line(
    tools: Path, monkeypatch: pytest.MonkeyPatch, kind: str, command: str
) -> None:
    # The chart's args and SANDKEEP_* env go through the same parser and settings model as `sandkeep`,
    # so a renamed flag or an env value the process would refuse at start fails here, not in a cluster.
    import importlib

    from controller.cli import sandkeep

    values = [
        "--set=agent.scanInterval=15s",
        "--set=agent.stuckAfter=20m",
        "--set=settings.retention=48h",
        "--set=logFormat=json",
        "--set=controller.watchNamespaces={team-a,team-b}",
        "--set=controller.workers=4",
        "--set=controller.leaseDuration=30",
        "--set=controller.extraArgs={--identity=sk-0}",
        "--set=agent.extraArgs={--pressure-high=90}",
    ]
    container = find(objects(render(tools, *values)), kind)["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("$(NODE_NAME)", "node-a") for a in container["args"]]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["SANDKEEP_LOG_FORMAT"] == "json"
    parsed = sandkeep._parser(command).parse_args(args)
    assert parsed.command == command
    module = importlib.import_module(sandkeep.COMMANDS[command][0])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = module.settings_from(parsed)
    assert settings.retention.total_seconds() == 48 * 3600
    assert settings.lease_namespace == "sandkeep" and settings.metrics_host == "0.0.0.0"
    if command == "agent":
        assert settings.node == "node-a" and str(settings.root) == "/var/lib/sandkeep"
        assert settings.scan_interval.total_seconds() == 15 and settings.stuck_after.total_seconds() == 1200
        assert settings.pressure_high == 90
    else:
        assert settings.watch_namespaces == ("team-a", "team-b")
        assert settings.workers == 4 and settings.lease_duration == 30 and settings.identity == "sk-0"
    assert env["SANDKEEP_LOG_FORMAT"] in logs.FORMATS  # one logs.setup accepts at start


# --- the CRDs: one source of truth ----------------------------------------------------------------------
def test_chart_crds_are_the_repository_crds(tools: Path, tmp_path: Path) -> None:
    """One source of truth: the chart renders the repository's crds/ (files/crds links to it), adding only
    its labels and, with crds.keep (the default), the policy that makes `helm uninstall` leave them."""
    assert (CHART / "files" / "crds").is_symlink()
    assert (CHART / "files" / "crds").resolve() == (REPO / "crds").resolve()
    assert not (CHART / "crds").exists(), "a crds/ directory is installed once and never upgraded by Helm"
    sources = {p.name: p.read_bytes() for p in sorted((REPO / "crds").glob("*.yaml"))}
    assert sources, "no CRDs in crds/"
    for values, keep in (([], True), (["--set=crds.keep=false"], False)):
        rendered = {d["metadata"]["name"]: d for d in objects(render(tools, *values)) if d["kind"] == CRD_KIND}
        assert len(rendered) == len(sources)
        for data in sources.values():
            want = yaml.safe_load(data)
            got = rendered[want["metadata"]["name"]]
            labels, annotations = got["metadata"].pop("labels"), got["metadata"].pop("annotations", {})
            assert labels.items() >= want["metadata"].pop("labels").items()
            assert labels["app.kubernetes.io/instance"] == "sk" and labels["app.kubernetes.io/managed-by"] == "Helm"
            assert annotations == ({"helm.sh/resource-policy": "keep"} if keep else {})
            assert got == want  # everything else exactly as written
    assert not [d for d in objects(render(tools, "--set=crds.enabled=false")) if d["kind"] == CRD_KIND]
    # what `helm package` stores: real files, identical bytes
    helm(tools, "package", str(CHART), f"--destination={tmp_path}")
    (package,) = tmp_path.glob("sandkeep-*.tgz")
    with tarfile.open(package) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("sandkeep/files/crds/")]
        packaged = {Path(m.name).name: tar.extractfile(m).read() for m in members}  # type: ignore[union-attr]
        assert members and all(m.isfile() for m in members)
    assert packaged == sources


# --- values table, image, e2e script ---------------------------------------------------------------------
def test_values_table_in_the_readme_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "hack" / "chart_values_table.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_an_undocumented_value_is_refused_by_the_table_generator() -> None:
    import hack.chart_values_table as cvt

    documented = "# -- the thing\nthing: 1\nnested:\n  # -- a leaf\n  leaf: x\n"
    assert '| `nested.leaf` | string | `"x"` | a leaf |' in cvt.table(documented)
    with pytest.raises(cvt.UndocumentedValueError, match=r"nested\.other"):
        cvt.table(documented + "  other: 2\n")


def test_dockerfile_installs_from_the_lock_and_runs_as_non_root() -> None:
    text = (REPO / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, flags=re.M)
    assert base and re.match(r"python:3\.\d+-slim", base[1]) and all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    assert re.search(r"pip install --constraint constraints\.txt \.", text)
    assert "COPY constraints.txt" in text
    user = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and "!constraints.txt" in ignore and "!controller/" in ignore


def test_kind_e2e_script_passes_shellcheck_and_bash_n() -> None:
    assert subprocess.run(["bash", "-n", str(E2E_SCRIPT)], capture_output=True).returncode == 0
    result = subprocess.run(["shellcheck", "--severity=style", str(E2E_SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    text = E2E_SCRIPT.read_text()
    # It runs the very suite CI runs on the local node, on a kind bed (tests/bed/e2e_bed.py's KindBed).
    for step in ("kind create cluster", "kind load docker-image", "SANDKEEP_E2E_KIND=", "tests/node/test_e2e.py"):
        assert step in text, f"the e2e script lost its step {step!r}"


@pytest.mark.parametrize("surge", ["1", "10%"])
def test_an_agent_surge_is_refused_saying_why(tools: Path, surge: str) -> None:
    """A surged agent Pod would wait for its node's root lock, never be Ready, and stop the rollout."""
    refused(tools, f"--set=agent.updateStrategy.rollingUpdate.maxSurge={surge}", f"maxSurge ({surge}) must be 0:")


def test_an_agent_surge_of_zero_renders(tools: Path) -> None:
    ds = find(objects(render(tools, "--set=agent.updateStrategy.rollingUpdate.maxSurge=0")), "DaemonSet")
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}


def test_the_controller_rolls_one_replica_at_a_time_without_a_surge(tools: Path) -> None:
    """Under a hard anti-affinity on as many nodes as replicas, a surge Pod would stay Pending and stall the
    rollout; one replica down at a time is safe, as only the Lease holder acts."""
    deployment = find(objects(render(tools, "--set=controller.antiAffinity=hard")), "Deployment")
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
