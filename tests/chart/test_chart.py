"""The Helm chart, its alerts, dashboard, image and e2e script, checked by the real tools.

`helm lint` and `helm template` run the built helm, with no server: the rendered objects are read here.
The alert rules run through `promtool check rules` and `promtool test rules`; the metric names in the
rules and the dashboard are checked against the names the code's registries export. The same manifests on
the real API server (`--dry-run=server`, `helm install`, the Pods the real controllers make) are
tests/apiserver/test_chart_install.py's.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.observe import logs
from controller.observe.metrics import series_names
from controller.rules import contracts as c
from controller.rules.durations import MAX_DURATION, MAX_INSTANT, MIN_INSTANT, format_instant
from controller.rules.models import NAME_MAX
from hack.chart_values_table import documented_keys
from hack.localcluster import REPO, kube_version
from tests.bed.chart import CHART, EVERYTHING_ON, find, helm, objects, refused, render
from tests.bed.controller_harness import only_in

ALERTS = CHART / "files" / "alerts.yaml"
DASHBOARD = CHART / "files" / "dashboard.json"
RUNBOOKS = REPO / "docs" / "runbooks.md"
PROMTOOL_TESTS = Path(__file__).resolve().parent / "promtool"
E2E_SCRIPT = REPO / "hack" / "kind-e2e.sh"
CRD_KIND = "CustomResourceDefinition"
REQUIRED_ALERTS = {
    "SandkeepTombstoneStuck",
    "SandkeepDeletionsFailing",
    "SandkeepAgentDown",
    "SandkeepRootNearlyFull",
    "SandkeepControllerDown",
    "SandkeepExpiryLagging",
    "SandkeepPressureUnrelieved",
    "SandkeepQuarantineNotEmpty",
    "SandkeepPastMaxAge",
}
# sandkeep's own series, and the controller-runtime and client-go ones it exports under their usual names
_METRIC = re.compile(r"\b(?:sandkeep|controller_runtime|workqueue)_[a-z0-9_]+")


# --- helpers -------------------------------------------------------------------------------------------
def values_docs() -> dict[tuple[str, ...], str]:
    """The `# --` documentation of each value, as hack/chart_values_table.py reads it."""
    return documented_keys((CHART / "values.yaml").read_text())


def container_of(doc: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = doc["spec"]["template"]["spec"]["containers"][0]
    return container


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in markdown.splitlines():
        if heading := re.match(r"^#{1,6}\s+(.*)$", line):
            text = re.sub(r"[^\w\- ]", "", heading[1].strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


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


def test_monitoring_and_dashboard_turn_on_with_one_value_each(tools: Path) -> None:
    docs = objects(render(tools, "--set=monitoring.enabled=true", "--set=dashboard.enabled=true"))
    rule = find(docs, "PrometheusRule")
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} == REQUIRED_ALERTS
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"], "the rule file must ship unchanged"
    endpoints = {
        "sandkeep-controller": find(docs, "ServiceMonitor")["spec"]["endpoints"][0],
        "sandkeep-agent": find(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0],
    }
    for job, endpoint in endpoints.items():  # the fixed job names the rules select on
        assert {"targetLabel": "job", "replacement": job} in endpoint["relabelings"]
    dashboard = find(docs, "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["sandkeep.json"]) == json.loads(DASHBOARD.read_text())


def test_alert_labels_are_added_to_every_alert(tools: Path) -> None:
    docs = objects(render(tools, "--set=monitoring.enabled=true", "--set=monitoring.alertLabels.team=platform"))
    for group in find(docs, "PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["team"] == "platform" and rule["labels"]["severity"] in ("warning", "critical")


@pytest.mark.parametrize(
    ("switches", "expected"),
    [
        ([], {"ServiceMonitor", "PodMonitor", "PrometheusRule"}),
        (["--set=monitoring.serviceMonitor.enabled=false"], {"PodMonitor", "PrometheusRule"}),
        (["--set=monitoring.podMonitor.enabled=false"], {"ServiceMonitor", "PrometheusRule"}),
        (["--set=monitoring.prometheusRule.enabled=false"], {"ServiceMonitor", "PodMonitor"}),
        (["--set=monitoring.enabled=false"], set()),  # the master switch wins over the three
    ],
)
def test_servicemonitor_podmonitor_and_rules_switch_separately(
    tools: Path, switches: list[str], expected: set[str]
) -> None:
    docs = objects(render(tools, "--set=monitoring.enabled=true", *switches))
    assert {d["kind"] for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"} == expected


ALERT_OVERRIDES = [
    "--set=monitoring.enabled=true",
    "--set=monitoring.alertLabels.team=platform",
    "--set=monitoring.alerts.SandkeepRootNearlyFull.enabled=false",
    "--set=monitoring.alerts.SandkeepAgentDown.for=10m",
    "--set=monitoring.alerts.SandkeepAgentDown.severity=page",
    "--set=monitoring.alerts.SandkeepAgentDown.labels.team=infra",
    "--set=monitoring.alerts.SandkeepAgentDown.labels.escalate=oncall",
    "--set=monitoring.runbookBaseURL=https://wiki.example.com/sandkeep/runbooks",
]


def test_alert_overrides_change_only_what_they_name(tools: Path) -> None:
    rules = {
        r["alert"]: r
        for g in find(objects(render(tools, *ALERT_OVERRIDES)), "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
    }
    shipped = {r["alert"]: r for r in alert_rules()}
    assert set(rules) == REQUIRED_ALERTS - {"SandkeepRootNearlyFull"}
    for name, rule in rules.items():
        assert rule["expr"] == shipped[name]["expr"], "expressions ship as promtool tested them"
        anchor = name.lower()
        assert rule["annotations"]["runbook_url"] == f"https://wiki.example.com/sandkeep/runbooks#{anchor}"
        assert anchor in github_anchors(RUNBOOKS.read_text())
        if name != "SandkeepAgentDown":
            assert rule["for"] == shipped[name]["for"]
            assert rule["labels"] == {**shipped[name]["labels"], "team": "platform"}
    down = rules["SandkeepAgentDown"]
    assert down["for"] == "10m"
    assert down["labels"] == {"severity": "page", "team": "infra", "escalate": "oncall"}


def test_promtool_fires_the_overridden_rules_as_configured(tools: Path, tmp_path: Path) -> None:
    # The PrometheusRule as rendered, loaded by promtool: SandkeepAgentDown now waits 10 minutes and pages
    # with its own labels and runbook; SandkeepRootNearlyFull is gone even on a full disk.
    groups = find(objects(render(tools, *ALERT_OVERRIDES)), "PrometheusRule")["spec"]["groups"]
    rule_file = tmp_path / "rendered.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": groups}))
    checked = subprocess.run(
        [str(tools / "promtool"), "check", "rules", str(rule_file)], capture_output=True, text=True
    )
    assert checked.returncode == 0 and f"SUCCESS: {len(REQUIRED_ALERTS) - 1} rules found" in checked.stdout, (
        checked.stdout + checked.stderr
    )
    agent = yaml.safe_load((PROMTOOL_TESTS / "agent_down.yaml").read_text())["tests"][0]
    annotations = next(c for c in agent["alert_rule_test"] if c["exp_alerts"])["exp_alerts"][0]["exp_annotations"]
    annotations["runbook_url"] = "https://wiki.example.com/sandkeep/runbooks#sandkeepagentdown"
    spec = {
        "rule_files": [str(rule_file)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    *agent["input_series"],  # n1 down from 6m
                    {
                        "series": 'sandkeep_root_filesystem_size_bytes{job="sandkeep-agent", node="n1"}',
                        "values": "100x25",
                    },
                    {
                        "series": 'sandkeep_root_filesystem_avail_bytes{job="sandkeep-agent", node="n1"}',
                        "values": "1x25",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "15m", "alertname": "SandkeepAgentDown", "exp_alerts": []},  # pending 9 of 10 min
                    {
                        "eval_time": "16m",
                        "alertname": "SandkeepAgentDown",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "page", "team": "infra", "escalate": "oncall", "node": "n1"},
                                "exp_annotations": annotations,
                            }
                        ],
                    },
                    {"eval_time": "25m", "alertname": "SandkeepRootNearlyFull", "exp_alerts": []},  # 99% full, off
                ],
            }
        ],
    }
    test_file = tmp_path / "overrides_test.yaml"
    test_file.write_text(yaml.safe_dump(spec))
    result = subprocess.run([str(tools / "promtool"), "test", "rules", str(test_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


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


# --- security context and RBAC shape ---------------------------------------------------------------------
def test_agent_drops_every_capability_and_adds_back_only_four_each_justified(tools: Path) -> None:
    ds = find(objects(render(tools)), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    container = pod["containers"][0]
    sc = container["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(sc["capabilities"]["add"]) == ["DAC_OVERRIDE", "FOWNER", "KILL", "SYS_PTRACE"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False and not sc["privileged"]
    assert sc["appArmorProfile"] == {"type": "Unconfined"}  # the default profile hides other processes' /proc
    node_env = next(e for e in container["env"] if e["name"] == "NODE_NAME")
    assert node_env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--node=$(NODE_NAME)" in container["args"]
    root = next(v for v in pod["volumes"] if v["name"] == "root")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "root")
    assert root["hostPath"]["path"] == mount["mountPath"] == "/var/lib/sandkeep"
    # each added capability is justified in the documentation of agent.securityContext (the values table)
    doc = values_docs()[("agent", "securityContext")]
    for cap in sc["capabilities"]["add"]:
        assert re.search(rf"\b{cap} [a-z]", doc), f"capability {cap} has no sentence saying why"


def test_the_agent_runs_under_the_charts_seccomp_profile_installed_by_its_init_container(tools: Path) -> None:
    docs = objects(render(tools, "--set=agent.seccomp.kubeletRootDir=/data/kubelet/"))
    pod = find(docs, "DaemonSet")["spec"]["template"]
    profile = (CHART / "files" / "agent-seccomp.json").read_text()
    assert find(docs, "ConfigMap", "-agent-seccomp")["data"] == {"sk-sandkeep-agent.json": profile}
    agent, init = pod["spec"]["containers"][0], pod["spec"]["initContainers"][0]
    assert agent["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "sandkeep/sk-sandkeep-agent.json",
    }
    assert "sandkeep/sk-sandkeep-agent.json.tmp /host-seccomp/sandkeep/sk-sandkeep-agent.json" in init["command"][2]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kubelet-seccomp"]["hostPath"] == {"path": "/data/kubelet/seccomp", "type": "DirectoryOrCreate"}
    assert {m["name"] for m in init["volumeMounts"]} == {"seccomp-profile", "kubelet-seccomp"}
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "kubelet-seccomp" not in {m["name"] for m in agent["volumeMounts"]}, "the agent cannot rewrite its profile"
    # a new profile rolls the agents, each new Pod installing it before its agent starts
    assert pod["metadata"]["annotations"]["checksum/seccomp"] == hashlib.sha256(profile.encode()).hexdigest()


def test_without_the_seccomp_profile_the_agent_keeps_the_runtime_default(tools: Path) -> None:
    docs = objects(render(tools, "--set=agent.seccomp.enabled=false", "--set=agent.podAnnotations.team=ci"))
    pod = find(docs, "DaemonSet")["spec"]["template"]
    assert not [d for d in docs if d["kind"] == "ConfigMap"] and "initContainers" not in pod["spec"]
    assert "seccompProfile" not in pod["spec"]["containers"][0]["securityContext"]
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["metadata"]["annotations"] == {"team": "ci"}


def test_the_csi_driver_is_the_contracts_and_only_its_plugin_container_is_privileged(tools: Path) -> None:
    from controller.cli import sandkeep

    docs = objects(render(tools, "--set=csi.kubeletDir=/data/kubelet/"))
    driver = find(docs, "CSIDriver")
    assert driver["metadata"]["name"] == c.CSI_DRIVER
    assert driver["spec"]["attachRequired"] is False and driver["spec"]["podInfoOnMount"] is True
    assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"] and driver["spec"]["fsGroupPolicy"] == "File"
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    containers = {k["name"]: k for k in pod["containers"]}
    assert list(containers) == ["agent", "csi", "csi-registrar"]
    assert not containers["agent"]["securityContext"]["privileged"]
    assert containers["csi"]["securityContext"]["privileged"] is True
    registrar = containers["csi-registrar"]["securityContext"]
    assert registrar["capabilities"]["drop"] == ["ALL"] and registrar["allowPrivilegeEscalation"] is False
    # Only the kubelet's directory propagates mounts back to the host, and only from the plugin.
    propagating = {
        (name, m["mountPath"])
        for name, k in containers.items()
        for m in k["volumeMounts"]
        if m.get("mountPropagation") == "Bidirectional"
    }
    assert propagating == {("csi", "/data/kubelet")}
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert paths["csi-socket"] == f"/data/kubelet/plugins/{c.CSI_DRIVER}"
    assert paths["registration"] == "/data/kubelet/plugins_registry"
    args = containers["csi-registrar"]["args"]
    assert f"--kubelet-registration-path=/data/kubelet/plugins/{c.CSI_DRIVER}/csi.sock" in args
    # Both containers' args go through the real command line, as the agent's do.
    for name, command in (("csi", "csi-node"), ("csi-registrar", "csi-registrar")):
        argv = [a.replace("$(NODE_NAME)", "node-a") for a in containers[name]["args"]]
        parsed = sandkeep._parser(command).parse_args(argv)
        assert parsed.command == command
    node_args = sandkeep._parser("csi-node").parse_args(containers["csi"]["args"])
    assert node_args.kubelet_dir == "/data/kubelet" and node_args.endpoint == "/csi/csi.sock"
    off = objects(render(tools, "--set=csi.enabled=false"))
    assert not [d for d in off if d["kind"] == "CSIDriver"]
    assert [k["name"] for k in find(off, "DaemonSet")["spec"]["template"]["spec"]["containers"]] == ["agent"]


def test_controller_runs_as_non_root_without_capabilities(tools: Path) -> None:
    pod = find(objects(render(tools)), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = pod["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert not pod.get("hostPID") and not any("hostPath" in v for v in pod["volumes"])


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


def test_agent_role_deletes_only_sandboxes_reads_no_secrets_and_grants_nothing(tools: Path) -> None:
    docs = objects(render(tools))
    rules = find(docs, "ClusterRole", "-agent")["rules"] + find(docs, "Role", "-agent-leases")["rules"]
    for rule in rules:
        # delete: releasing its own node's sandboxes for space (the node-scope policy holds it to its node)
        if "delete" in rule["verbs"]:
            assert rule["apiGroups"] == [c.GROUP] and rule["resources"] == [c.SANDBOX_PLURAL], rule
        assert "deletecollection" not in rule["verbs"] and "*" not in rule["verbs"]
        assert "secrets" not in rule["resources"] and "*" not in rule["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        assert "rbac.authorization.k8s.io" not in rule["apiGroups"]


def test_agent_node_scope_policy_uses_the_contracts_lease_prefix(tools: Path) -> None:
    policy = find(objects(render(tools)), "ValidatingAdmissionPolicy", "-agent-node-scope")
    lease = next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "lease")
    # leases.heartbeat_name, as CEL (tests/apiserver/test_rbac.py shows both on the API server with a 253-char node)
    prefixed = f"'{c.AGENT_LEASE_PREFIX}' + variables.node"
    assert lease == f"size({prefixed}) <= {NAME_MAX} ? {prefixed} : variables.node"
    node_rule = next(v["expression"] for v in policy["spec"]["validations"] if "leaseNode" in v["expression"])
    assert f"annotations[?'{c.LABEL_NODE}']" in node_rule
    agent = "system:serviceaccount:sandkeep:sk-sandkeep-agent"
    assert policy["spec"]["matchConditions"][0]["expression"] == f'request.userInfo.username == "{agent}"'


def test_pin_policy_reads_the_contracts_keys_and_bounds_and_spares_the_charts_serviceaccounts(tools: Path) -> None:
    # tests/apiserver/test_admission.py proves the CEL against durations.py on the API server; this ties the names.
    values = ("--set=controller.serviceAccount.name=ctl", "--set=agent.serviceAccount.name=agt")
    policy = find(objects(render(tools, *values)), "ValidatingAdmissionPolicy", "-pins")
    expressions = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert expressions["changed"].startswith(f"['{c.ANN_PIN_UNTIL}', '{c.ANN_PIN_FOR}']")
    latest = format_instant(MAX_INSTANT).replace("Z", ".000000999Z")  # Python keeps microseconds only
    assert f"timestamp('{format_instant(MIN_INSTANT)}')" in expressions["instantInRange"]
    assert f"timestamp('{latest}')" in expressions["instantInRange"]
    too_large = next(v for v in policy["spec"]["validations"] if "too large" in v["messageExpression"])
    assert f"<= {int(MAX_DURATION.total_seconds())})" in too_large["expression"]
    assert f"at most {MAX_DURATION.days}d" in too_large["messageExpression"]
    users = '["system:serviceaccount:sandkeep:ctl","system:serviceaccount:sandkeep:agt"]'
    assert policy["spec"]["matchConditions"][0]["expression"] == f"!(request.userInfo.username in {users})"


def test_pin_policy_turns_off_and_binds_only_the_namespaces_asked(tools: Path) -> None:
    assert not [
        d for d in objects(render(tools, "--set=admission.pinPolicy=false")) if d["metadata"]["name"].endswith("-pins")
    ]
    assert "matchResources" not in find(objects(render(tools)), "ValidatingAdmissionPolicyBinding", "-pins")["spec"]
    binding = find(objects(render(tools, only_in("team-a"))), "ValidatingAdmissionPolicyBinding", "-pins")
    selector = {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}
    assert binding["spec"]["matchResources"] == {"namespaceSelector": selector}


def test_aggregated_roles_carry_the_aggregation_labels(tools: Path) -> None:
    docs = objects(render(tools))
    view, edit = find(docs, "ClusterRole", "-view"), find(docs, "ClusterRole", "-edit")
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in view["rules"])
    assert {v for r in edit["rules"] for v in r["verbs"]} == {"get", "list", "watch", "patch", "update", "delete"}
    assert all("retainedsandboxes/status" not in r["resources"] for r in edit["rules"])


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


# --- alerts, runbooks, dashboard -----------------------------------------------------------------------
def test_alerts_are_the_required_six_each_with_summary_description_and_runbook() -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == REQUIRED_ALERTS
    anchors = github_anchors(RUNBOOKS.read_text())
    for rule in rules:
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and annotations["description"].strip(), rule["alert"]
        url = annotations["runbook_url"]
        assert url.split("#")[0].endswith("/docs/runbooks.md"), url
        assert url.split("#")[1] in anchors, f"{rule['alert']}: anchor #{url.split('#')[1]} not in docs/runbooks.md"
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_runbooks_say_how_to_confirm_with_doctor_and_kubectl() -> None:
    sections = re.split(r"^## ", RUNBOOKS.read_text(), flags=re.M)[1:]
    assert {s.splitlines()[0].strip() for s in sections} == REQUIRED_ALERTS
    for section in sections:
        assert "**Means.**" in section and "**Confirm.**" in section and "**Fix.**" in section, section[:40]
        assert "kubectl" in section


def test_alert_and_dashboard_metrics_are_exported_by_the_code() -> None:
    exported = series_names()
    used_by_alerts = {m for r in alert_rules() for m in _METRIC.findall(r["expr"])}
    used_by_dashboard = {m for e in dashboard_exprs() for m in _METRIC.findall(e)}
    assert used_by_alerts - exported == set(), "alert rules use metrics the code does not export"
    assert used_by_dashboard - exported == set(), "dashboard queries use metrics the code does not export"
    assert all(_METRIC.search(r["expr"]) for r in alert_rules()), "every alert reads a sandkeep metric"


def test_the_name_check_catches_a_drifted_name() -> None:
    # The check above is only worth something if a name the code does not export is caught.
    exported = series_names()
    assert c.M_TOMBSTONE_STUCK_OLDEST in exported and f"{c.M_DELETION_FAILURES}" in exported
    assert "sandkeep_tombstone_stuck_oldest" not in exported
    assert f"{c.M_EXPIRY_LAG}_bucket" in exported and f"{c.M_EXPIRY_LAG}_total" not in exported


def test_dashboard_shows_what_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used = {m for e in dashboard_exprs() for m in _METRIC.findall(e)}
    for needed in (
        c.M_RETAINED_BYTES,
        c.M_SANDBOXES,
        c.M_TOMBSTONES,
        c.M_TOMBSTONES_STUCK,
        c.M_DELETIONS,
        f"{c.M_DELETION_DURATION}_bucket",
        f"{c.M_EXPIRY_LAG}_bucket",
        c.M_IN_USE_HOLDS,
        c.M_WORKQUEUE_DEPTH,
        f"{c.M_WORKQUEUE_QUEUE_DURATION}_bucket",
        c.M_RECONCILE_TOTAL,
        f"{c.M_RECONCILE_TIME}_bucket",
    ):
        assert needed in used, f"the dashboard has no panel on {needed}"
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"


def test_dashboard_has_datasource_cluster_and_job_variables_every_query_honours(tools: Path, tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "cluster", "job", "node"]
    for expr in dashboard_exprs():
        if expr.startswith("label_values(sandkeep_build_info"):  # the cluster and job variables themselves
            continue
        for selector in re.findall(_METRIC.pattern + r"(\{[^}]*\})?", expr):
            assert 'cluster=~"$cluster"' in selector and 'job=~"$job"' in selector, expr
    for grouping in re.findall(r"\bby \(([^)]*)\)", " ".join(dashboard_exprs())):
        assert grouping.startswith("cluster"), f"by ({grouping}) merges clusters"
    # every query is valid PromQL once Grafana fills the variables in (promtool parses them as rules)
    filled = {"$__rate_interval": "5m", "$cluster": ".*", "$job": ".*", "$node": ".*"}
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        if expr.startswith("label_values("):
            expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
        for name, value in filled.items():
            expr = expr.replace(name, value)
        rules.append({"record": f"dashboard:query{i}", "expr": expr})
    rule_file = tmp_path / "dashboard.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(
        [str(tools / "promtool"), "check", "rules", str(rule_file)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_promtool_checks_the_rule_file(tools: Path) -> None:
    result = subprocess.run([str(tools / "promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in result.stdout


def test_promtool_unit_tests_pass_and_cover_every_alert_firing_and_silent(tools: Path) -> None:
    files = sorted(PROMTOOL_TESTS.glob("*.yaml"))
    fires: set[str] = set()
    silent: set[str] = set()
    for path in files:
        spec = yaml.safe_load(path.read_text())
        assert [str((path.parent / f).resolve()) for f in spec["rule_files"]] == [str(ALERTS)]
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert fires == REQUIRED_ALERTS and silent == REQUIRED_ALERTS
    result = subprocess.run(
        [str(tools / "promtool"), "test", "rules", *map(str, files)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files)


def test_promtool_tests_fail_when_a_threshold_moves(tools: Path, tmp_path: Path) -> None:
    # Mutate the rule file (a later `for`, a higher threshold): the unit tests must notice.
    mutations = (
        ("> 300", "> 900"),
        ("for: 15m", "for: 20m"),
        ("> 0.90", "> 0.99"),
        ("vector(0)", "vector(1)"),
        ("for: 1h", "for: 2h"),
        # `cluster` dropped: one cluster hides another's outage (tests/chart/promtool/cluster_label.yaml)
        ("sum by (cluster) (sandkeep_controller_leader", "sum(sandkeep_controller_leader"),
        ("by (cluster, node)", "by (node)"),
    )
    for old, new in mutations:
        text = ALERTS.read_text()
        assert old in text
        (tmp_path / "files").mkdir(exist_ok=True)
        (tmp_path / "files" / "alerts.yaml").write_text(text.replace(old, new))
        copies = []
        for path in sorted(PROMTOOL_TESTS.glob("*.yaml")):
            spec = yaml.safe_load(path.read_text())
            spec["rule_files"] = [str(tmp_path / "files" / "alerts.yaml")]
            copy = tmp_path / path.name
            copy.write_text(yaml.safe_dump(spec))
            copies.append(str(copy))
        result = subprocess.run([str(tools / "promtool"), "test", "rules", *copies], capture_output=True, text=True)
        assert result.returncode != 0, f"changing {old!r} to {new!r} went unnoticed"


# --- sessions (issue 25): bounds named once in contracts.py, from the values to the controller and the policy ----
SESSIONS_ON = "--set=sessions.enabled=true"


def test_session_bounds_are_the_contracts_defaults_and_reach_the_controller_as_it_parses_them(tools: Path) -> None:
    from controller.cli import sandkeep
    from controller.cluster.main import settings_from
    from controller.cluster.session_decide import DEFAULT_RESOURCES

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sessions = values["sessions"]
    docs = values_docs()
    for bound in (c.SESSIONS_MAX_PER_USER, c.SESSIONS_MAX_PER_NAMESPACE, c.SESSIONS_MIN_OWNER_ID):
        assert sessions[bound.value] == bound.default, bound
    for value in (c.SESSIONS_MAX_PER_USER.value, c.SESSIONS_MAX_PER_NAMESPACE.value):
        assert c.Reason.SESSION_LIMIT in docs[("sessions", value)]
    assert c.Reason.IMAGE_NOT_ALLOWED in docs[("sessions", "allowedImages")]
    assert sessions["resources"] == DEFAULT_RESOURCES and sessions["runAsUser"] == c.NOBODY
    assert sessions["allowedImages"] == []
    tolerations = ('--set-json=agent.tolerations=[{"key":"dedicated","operator":"Exists","effect":"NoExecute"}]',)
    extra = ("--set=sessions.allowedImages={busybox:1.36,alpine:3.20}", "--set=sessions.maxPerUser=1", *tolerations)
    for given in ((), extra):
        args = container_of(find(objects(render(tools, SESSIONS_ON, *given)), "Deployment"))["args"]
        assert any(a.startswith(c.SESSIONS_RESOURCES + "=") for a in args)
        assert any(a.startswith(c.SESSIONS_TOLERATIONS + "=") for a in args)
        session = settings_from(sandkeep._parser("controller").parse_args(args)).session_settings()
        assert session is not None
        assert session.resources == DEFAULT_RESOURCES and session.min_owner_id == c.SESSIONS_MIN_OWNER_ID.default
        assert session.policy_name == session.admission_binding == "sk-sandkeep-sessions"
        if given:
            assert session.allowed_images == ("busybox:1.36", "alpine:3.20") and session.max_per_user == 1
            assert session.tolerations == ({"key": "dedicated", "operator": "Exists", "effect": "NoExecute"},)
        else:
            assert session.allowed_images == () and session.tolerations == ({"operator": "Exists"},)
            assert session.max_per_user == c.SESSIONS_MAX_PER_USER.default
            assert session.max_per_namespace == c.SESSIONS_MAX_PER_NAMESPACE.default


def test_the_sessions_policy_proves_the_user_and_admits_only_the_allowed_images(tools: Path) -> None:
    docs = objects(render(tools, SESSIONS_ON, "--set=sessions.allowedImages={busybox:1.36}"))
    policy = find(docs, "ValidatingAdmissionPolicy", "-sessions")
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert c.SESSION_USER_CHECK in [v["expression"] for v in policy["spec"]["validations"]]
    images = next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "images")
    default = container_of(find(docs, "Deployment"))["image"]
    assert json.loads(images) == [default, "busybox:1.36"]  # the default first, always allowed
    binding = find(docs, "ValidatingAdmissionPolicyBinding", "-sessions")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_the_controller_reads_only_its_own_sessions_guard(tools: Path) -> None:
    role = find(objects(render(tools, SESSIONS_ON)), "ClusterRole", "-controller-sessions")
    guard = [r for r in role["rules"] if r["apiGroups"] == ["admissionregistration.k8s.io"]]
    assert guard == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": [kind],
            "resourceNames": ["sk-sandkeep-sessions"],
            "verbs": ["get"],
        }
        for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies")
    ]


def test_sessions_need_no_namespace_of_their_own_and_the_removed_values_are_still_accepted(tools: Path) -> None:
    # An upgrade with --reuse-values still carries sessions.namespace and createNamespace: accepted, ignored.
    old = ("--set=sessions.namespace=sk-sessions", "--set=sessions.createNamespace=true")
    docs = objects(render(tools, SESSIONS_ON, *old))
    assert not [d for d in docs if d["kind"] == "Namespace"]
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding") and "sessions" in d["metadata"]["name"]]
    assert "sk-sessions" not in json.dumps(docs)
    assert "--sessions" in container_of(find(docs, "Deployment"))["args"]
    role = find(docs, "ClusterRole", "-controller-sessions")
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "delete"]} in role["rules"]
    assert not [r for r in role["rules"] if r["apiGroups"] == ["rbac.authorization.k8s.io"]]
    assert not any("exec" in res for r in role["rules"] for res in r["resources"])


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
