"""The chart's monitoring, checked by the real tools: the ServiceMonitor, PodMonitor, PrometheusRule and
dashboard switches, alert labels and overrides, the alerts and their runbooks, the dashboard's queries.

The alert rules run through `promtool check rules` and `promtool test rules`; the metric names in the
rules and the dashboard are checked against the names the code's registries export.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.observe.metrics import series_names
from controller.rules import contracts as c
from hack.localcluster import REPO
from tests.bed.chart import CHART, find, objects, render

ALERTS = CHART / "files" / "alerts.yaml"
DASHBOARD = CHART / "files" / "dashboard.json"
RUNBOOKS = REPO / "docs" / "runbooks.md"
PROMTOOL_TESTS = Path(__file__).resolve().parent / "promtool"
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
