"""The end-to-end test bed: the chart installed with Helm on a real node, scraped by a real Prometheus.

`Bed` starts a control plane in node mode and one real node (hack/localnode.py), builds the image from
the Dockerfile (`hack/image.sh`) and imports it into the node's containerd, installs
`charts/sandkeep` with only values changed (image, root, intervals, monitoring on), and runs the
Prometheus server built from the same pinned module as promtool. Prometheus is configured the way
prometheus-operator would configure it from the chart's own ServiceMonitor, PodMonitor and
PrometheusRule (`operator_config`), read back from the API server after the install.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from localcluster import REPO, Component, LocalCluster, free_port, tools_bin
from localnode import LocalNode

T = TypeVar("T")
RELEASE = "sandkeep"
SYSTEM_NS = "sandkeep"
PROMETHEUS_TOOLS = ("prometheus", "helm", "kubectl")


def eventually(check: Callable[[], T | None], what: str, timeout: float = 90.0, every: float = 1.0) -> T:
    """Call `check` until it returns something truthy; fail naming `what` and the last error otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = check()
            if result:
                return result
            last = result
        except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(every)


def build_image() -> tuple[Path, str]:
    """`hack/image.sh`: the archive and the image reference (built only when the tree changed)."""
    out = subprocess.run(["bash", str(REPO / "hack" / "image.sh")], check=True, capture_output=True, text=True)
    archive, ref = out.stdout.split()
    return Path(archive), ref


def _relabelings(relabelings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """prometheus-operator's relabeling fields (camelCase) as Prometheus' own (snake_case)."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{names.get(k, k.lower()): v for k, v in r.items()} for r in relabelings]


def _label_keep(role: str, selector: dict[str, str]) -> list[dict[str, Any]]:
    prefix = f"__meta_kubernetes_{role}_label"
    out = []
    for key, value in selector.items():
        safe = "".join(c if c.isalnum() else "_" for c in key)
        out.append(
            {
                "action": "keep",
                "source_labels": [f"{prefix}_{safe}", f"{prefix}present_{safe}"],
                "regex": f"({value});true",
            }
        )
    return out


def operator_config(
    pod_monitors: list[dict[str, Any]], service_monitors: list[dict[str, Any]], sd: dict[str, Any]
) -> list[dict[str, Any]]:
    """The scrape configs prometheus-operator generates for these monitors (the parts the chart uses:
    matchLabels selectors, namespace names, a named port, path, interval, honorLabels, relabelings)."""
    configs = []
    for kind, monitors, role, port_label, endpoints_key in (
        ("podMonitor", pod_monitors, "pod", "__meta_kubernetes_pod_container_port_name", "podMetricsEndpoints"),
        ("serviceMonitor", service_monitors, "endpoints", "__meta_kubernetes_endpoint_port_name", "endpoints"),
    ):
        for monitor in monitors:
            meta, spec = monitor["metadata"], monitor["spec"]
            namespaces = spec.get("namespaceSelector", {}).get("matchNames") or [meta["namespace"]]
            selector_role = "pod" if role == "pod" else "service"
            for i, endpoint in enumerate(spec[endpoints_key]):
                relabel = [
                    *_label_keep(selector_role, spec["selector"].get("matchLabels", {})),
                    {"action": "keep", "source_labels": [port_label], "regex": endpoint["port"]},
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                    {"target_label": "job", "replacement": meta["name"]},
                    *_relabelings(endpoint.get("relabelings", [])),
                ]
                configs.append(
                    {
                        "job_name": f"{kind}/{meta['namespace']}/{meta['name']}/{i}",
                        "honor_labels": bool(endpoint.get("honorLabels", False)),
                        "scrape_interval": endpoint.get("interval", "30s"),
                        "metrics_path": endpoint.get("path", "/metrics"),
                        "kubernetes_sd_configs": [{"role": role, "namespaces": {"names": namespaces}, **sd}],
                        "relabel_configs": relabel,
                    }
                )
    return configs


class Bed:
    """The whole test bed; `start()` once, `stop()` always (every process by pid, every mount with the node)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cluster = LocalCluster(workdir, node_mode=True)
        self.node: LocalNode | None = None
        self.prometheus: Component | None = None
        self.prometheus_url = ""
        self.image_ref = ""
        self.disk = Path()
        self.root = Path()

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        tools_bin(PROMETHEUS_TOOLS)
        archive, self.image_ref = build_image()
        self.cluster.start()
        try:
            self.node = LocalNode(self.cluster)
            self.node.start()
            self.node.import_image(archive)
            # Jobs' directories and the sandbox root on one filesystem and under one mount, as
            # `sandkeep retain` needs (it moves by rename).
            self.disk = self.node.dir / "disk" if self.node.dir else Path()
            self.root = self.disk / "sandkeep"
            (self.disk / "jobs").mkdir(parents=True)
            self.kubectl(
                "apply", "--server-side", "-f", str(REPO / "tests" / "fixtures" / "prometheus-operator-crds.yaml")
            )
            self.install_chart()
            self.start_prometheus()
        except BaseException:
            self.cluster.failed = True
            self.stop()
            raise

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None
        if self.node is not None:
            if self.root.exists():  # an immutable file left by a failed test would keep the tree
                subprocess.run(["chattr", "-R", "-i", str(self.root)], capture_output=True)
            self.node.stop()
            self.node = None
        self.cluster.stop()

    # --- helpers --------------------------------------------------------------------------------------
    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, **kwargs)

    def get(self, *args: str) -> Any:
        return self.cluster.kubectl_json("get", *args)

    def helm(self, *args: str) -> str:
        cmd = [str(self.cluster.bin / "helm"), f"--kubeconfig={self.cluster.kubeconfig}", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    def install_chart(self) -> None:
        repo, _, tag = self.image_ref.rpartition(":")
        self.kubectl("create", "namespace", SYSTEM_NS)
        # The agent needs hostPID and a hostPath: its namespace runs at the `privileged` level.
        self.kubectl("label", "namespace", SYSTEM_NS, "pod-security.kubernetes.io/enforce=privileged")
        values = {
            "image": {"repository": repo, "tag": tag},
            "agent": {"root": str(self.root), "scanInterval": "2s", "stuckAfter": "15s"},
            "monitoring": {"enabled": True, "interval": "5s"},
        }
        values_file = self.workdir / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        self.helm("install", RELEASE, str(REPO / "charts" / "sandkeep"), "-n", SYSTEM_NS, "-f", str(values_file))

    def start_prometheus(self) -> None:
        pki = self.cluster.ca_file.parent
        sd = {
            "api_server": self.cluster.server,
            "tls_config": {
                "ca_file": str(pki / "ca.crt"),
                "cert_file": str(pki / "admin.crt"),
                "key_file": str(pki / "admin.key"),
            },
        }
        pod_monitors = self.get("podmonitors", "-n", SYSTEM_NS)["items"]
        service_monitors = self.get("servicemonitors", "-n", SYSTEM_NS)["items"]
        rules = self.get("prometheusrules", "-n", SYSTEM_NS)["items"]
        assert pod_monitors and service_monitors and rules, "the chart installed no monitors or rules"
        rules_file = self.workdir / "rules.yaml"
        rules_file.write_text(yaml.safe_dump({"groups": [g for r in rules for g in r["spec"]["groups"]]}))
        config = {
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
            "rule_files": [str(rules_file)],
            "scrape_configs": operator_config(pod_monitors, service_monitors, sd),
        }
        config_file = self.workdir / "prometheus.yaml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        log = self.workdir / "prometheus.log"
        log_file = log.open("ab")
        proc = subprocess.Popen(
            [
                str(self.cluster.bin / "prometheus"),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.prometheus = Component("prometheus", proc, log, log_file)
        eventually(lambda: self.prom("/-/ready", raw=True), "Prometheus to be ready", timeout=60)

    def prom(self, path: str, raw: bool = False, **params: str) -> Any:
        url = f"{self.prometheus_url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        return body if raw else json.loads(body)["data"]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.prom("/api/v1/alerts")["alerts"] if a["labels"].get("alertname") == name]

    def targets_up(self) -> dict[str, int]:
        """Scrape targets that are up, counted by job."""
        up: dict[str, int] = {}
        for t in self.prom("/api/v1/targets")["activeTargets"]:
            if t["health"] == "up":
                up[t["labels"]["job"]] = up.get(t["labels"]["job"], 0) + 1
        return up

    def logs(self) -> str:
        parts = [self.cluster.logs()]
        if self.node is not None:
            parts.append(self.node.logs())
        for name in ("controller", "agent"):
            with contextlib.suppress(subprocess.CalledProcessError):
                out = self.kubectl(
                    "logs", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/component={name}", "--tail=40", "--prefix"
                ).stdout
                parts.append(f"----- {name} Pods -----\n{out}")
        if self.prometheus is not None:
            parts.append(f"----- prometheus -----\n{self.prometheus.log.read_text()[-3000:]}")
        return "\n".join(parts)

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
