"""The end-to-end test bed: the chart installed with Helm on a real node, scraped by a real Prometheus.

Two beds run the same suite (tests/node/test_e2e.py):
- `LocalBed`, what this repository's CI runs: a control plane in node mode and one real node
  (hack/localnode.py), and a real OCI registry (CNCF Distribution, hack/registry.py) where the node's
  containerd pulls from. The bed releases this tree there as a user's release is made (`make release`,
  hack/release.py: the image by digest, the packaged chart) and installs it as a user does:
  `helm install sandkeep oci://REGISTRY/charts/sandkeep --version E2E_VERSION` with the chart's image and
  pull policy; the kubelet pulls the image.
- `KindBed`, for machines with Docker (`hack/kind-e2e.sh`): a kind cluster the script made, its image
  built with `docker build` and loaded; node-side steps run with `docker exec` on the worker; it installs
  `charts/sandkeep` from the working tree with that image.
Both set only values a user would (root, intervals, monitoring on, sessions) and run
the Prometheus server built from the same pinned module as promtool, configured the way
prometheus-operator would configure it from the chart's own ServiceMonitor, PodMonitor and
PrometheusRule (`operator_config`), read back from the API server after the install.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hack.localcluster import REPO, ClusterError, LocalCluster, tools_bin
from hack.localnode import REGISTRY, LocalNode, LocalNodes
from hack.processes import Component, free_port, spawn
from hack.registry import LocalRegistry
from hack.release import RELEASE_TOOLS, Release, build_image, release

T = TypeVar("T")
RELEASE = "sandkeep"
SYSTEM_NS = "sandkeep"
UNPULLABLE_IMAGE = "registry.invalid/no-such-image:1"  # a session image no node can pull
PROMETHEUS_TOOLS = ("prometheus", "helm", "kubectl")
# The version the bed releases this tree as: the chart's own, marked as a pre-release of the end-to-end bed.
E2E_VERSION = f"{yaml.safe_load((REPO / 'charts' / 'sandkeep' / 'Chart.yaml').read_text())['version']}-e2e"


# `sandkeep retain` for many workspaces in one process (its console script's main, once per workspace): 200
# interpreter starts in a Job would take about 4 minutes on two cores.
RETAIN_MANY = """
import os, sys
from controller.cli.sandkeep import main
root, namespace, retention, files, jobs, *names = sys.argv[1:]
for name in names:
    work = os.path.join(jobs, name)
    os.makedirs(work)
    for i in range(int(files)):
        open(os.path.join(work, f"f{i}"), "w").close()
    argv = ["retain", "--root", root, "--namespace", namespace, "--name", name, "--retention", retention, work]
    if main(argv) != 0:
        sys.exit(f"sandkeep retain {name} failed")
"""


def say(message: str) -> None:
    """One narrated step (shown live by `make demo-node`, which runs the suite with -s; kept with a failure)."""
    print(f"[e2e {time.strftime('%H:%M:%S')}] {message}", flush=True)


def eventually(check: Callable[[], T | None], what: str, timeout: float = 90.0, every: float = 1.0) -> T:
    """Call `check` until it returns something truthy; fail naming `what` and the last error otherwise."""
    began = time.monotonic()
    deadline = began + timeout
    last: object = None
    while True:
        try:
            result = check()
            if result:
                say(f"ok after {time.monotonic() - began:.0f}s: {what}")
                return result
            last = result
        except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(every)


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
    """What the suite needs of a cluster whose one node runs the chart; `start()` once, `stop()` always."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.bin = tools_bin(PROMETHEUS_TOOLS)
        self.kubeconfig = Path()
        self.node_name = ""
        self.image_ref = ""
        # What `helm install` installs: the working tree's chart, or (chart_version set) a released one.
        self.chart = str(REPO / "charts" / "sandkeep")
        self.chart_version = ""
        # Jobs' directories and the sandbox root, on one filesystem and under one mount of the node, as
        # `sandkeep retain` needs (it moves by rename).
        self.disk = Path()
        self.root = Path()
        self.prometheus: Component | None = None
        self.prometheus_url = ""
        # More values a suite sets, merged key by key into each top-level section (e.g. controller.nodeGrace).
        self.values: dict[str, dict[str, Any]] = {}

    def start(self) -> None:
        raise NotImplementedError

    def on_node(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`sh -c script` as root on the node, outside any container."""
        raise NotImplementedError

    def in_node(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`sh -c script` as root in the node's own PID namespace (what the agent's hostPID sees)."""
        return self.on_node(script, check)

    def stop_kubelet(self) -> None:
        """Stop the node's kubelet as an operator would; the node and its running containers stay."""
        raise NotImplementedError

    def start_kubelet(self) -> None:
        """Start the stopped kubelet again; return once it serves the node."""
        raise NotImplementedError

    def _install(self) -> None:
        """Everything once the cluster and its node are up: the disk, the chart, Prometheus."""
        version = f" --version {self.chart_version}" if self.chart_version else ""
        say(f"helm install {RELEASE} {self.chart}{version} -n {SYSTEM_NS} (image {self.image_ref}, root {self.root})")
        self.on_node(f"mkdir -p '{self.disk}/jobs'")
        self.kubectl("apply", "--server-side", "-f", str(REPO / "tests" / "fixtures" / "prometheus-operator-crds.yaml"))
        self.install_chart()
        self.start_prometheus()

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None

    # --- the node's disk ------------------------------------------------------------------------------
    def exists(self, path: Path) -> bool:
        return self.on_node(f"test -e '{path}'", check=False).returncode == 0

    def tombstones(self) -> list[str]:
        return self.on_node(f"find '{self.root}' -maxdepth 1 -name '.reap-*'", check=False).stdout.split()

    # --- the API --------------------------------------------------------------------------------------
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def job_namespace(self, name: str) -> None:
        """Create namespace `name` for the suite's Jobs and holders, which mount the node's disk: it allows
        hostPath (Pod Security `privileged`), as a platform team's job namespace would."""
        self.kubectl("create", "namespace", name)
        self.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=privileged")

    def sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        """RetainedSandbox namespace/name, or None when there is none."""
        out = self.kubectl("get", "rsb", name, "-n", namespace, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def sandbox_names(self, namespace: str, prefix: str = "") -> set[str]:
        """The names of namespace's RetainedSandboxes that start with `prefix`."""
        names = (o["metadata"]["name"] for o in self.get("rsb", "-n", namespace)["items"])
        return {name for name in names if name.startswith(prefix)}

    def phase(self, namespace: str, name: str) -> str | None:
        obj = self.sandbox(namespace, name)
        return None if obj is None else (obj.get("status") or {}).get("phase")

    def helm(self, *args: str) -> str:
        cmd = [str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    def install_chart(self) -> None:
        self.kubectl("create", "namespace", SYSTEM_NS)
        # The agent needs hostPID and a hostPath: its namespace runs at the `privileged` level.
        self.kubectl("label", "namespace", SYSTEM_NS, "pod-security.kubernetes.io/enforce=privileged")
        self.helm("install", RELEASE, *self.chart_args(), "-n", SYSTEM_NS, "-f", str(self.user_values()))

    def chart_args(self, version: str | None = None) -> list[str]:
        """The chart as `helm install`/`upgrade` name it: a released VERSION from the registry, else the tree's."""
        version = version or self.chart_version
        return [self.chart, "--version", version, "--plain-http"] if version else [self.chart]

    def user_values(self) -> Path:
        """A values file with what a user would set here (and, installing from the tree, the bed's image)."""
        values: dict[str, Any] = {
            "agent": {"root": str(self.root), "scanInterval": "2s", "stuckAfter": "15s"},
            "monitoring": {"enabled": True, "interval": "5s"},
            # The unpullable image of test_a_session_with_an_image_that_cannot_be_pulled_ends_saying_so is
            # allowed, so that the controller, not the admission policy, is what meets it.
            "sessions": {"enabled": True, "allowedImages": [UNPULLABLE_IMAGE]},
        }
        for section, more in self.values.items():
            values[section] = {**values.get(section, {}), **more}
        if not self.chart_version:
            repo, _, tag = self.image_ref.rpartition(":")
            values["image"] = {"repository": repo, "tag": tag}
        values_file = self.workdir / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        return values_file

    # --- Prometheus -----------------------------------------------------------------------------------
    def _api_access(self) -> dict[str, Any]:
        """Prometheus' kubernetes_sd settings: the API server and the kubeconfig's credentials, as files."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        tls = {}
        for key, source, field in (
            ("ca_file", cluster, "certificate-authority-data"),
            ("cert_file", user, "client-certificate-data"),
            ("key_file", user, "client-key-data"),
        ):
            path = self.workdir / f"prometheus-{key}"
            path.write_bytes(base64.b64decode(source[field]))
            tls[key] = str(path)
        return {"api_server": cluster["server"], "tls_config": tls}

    def start_prometheus(self) -> None:
        pod_monitors = self.get("podmonitors", "-n", SYSTEM_NS)["items"]
        service_monitors = self.get("servicemonitors", "-n", SYSTEM_NS)["items"]
        rules = self.get("prometheusrules", "-n", SYSTEM_NS)["items"]
        assert pod_monitors and service_monitors and rules, "the chart installed no monitors or rules"
        rules_file = self.workdir / "rules.yaml"
        rules_file.write_text(yaml.safe_dump({"groups": [g for r in rules for g in r["spec"]["groups"]]}))
        config = {
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
            "rule_files": [str(rules_file)],
            "scrape_configs": operator_config(pod_monitors, service_monitors, self._api_access()),
        }
        config_file = self.workdir / "prometheus.yaml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        command = [
            str(self.bin / "prometheus"),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        self.prometheus = spawn("prometheus", command, self.workdir / "prometheus.log")
        say(f"Prometheus at {self.prometheus_url}, configured from the chart's PodMonitor, ServiceMonitor and rules")
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
        parts = []
        for name in ("controller", "agent"):
            with contextlib.suppress(subprocess.CalledProcessError):
                out = self.kubectl(
                    "logs", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/component={name}", "--tail=40", "--prefix"
                ).stdout
                parts.append(f"----- {name} Pods -----\n{out}")
        if self.prometheus is not None:
            parts.append(f"----- prometheus -----\n{self.prometheus.log.read_text()[-3000:]}")
        return "\n".join(parts)


class LocalBed(Bed):
    """A local control plane and `count` real nodes (hack/localnode.py); what this repository's CI runs.

    With one node its disk is a directory of the node's (`node.dir/disk`), the same path on the host. With
    several the chart's one `agent.root` must name a different disk on each node: the disk is
    `/var/lib/sandkeep-e2e`, each node's own (its /var/lib), reached from the host through `on(node, ...)`.
    """

    def __init__(self, workdir: Path, count: int = 1) -> None:
        super().__init__(workdir)
        self.cluster = LocalCluster(workdir, node_mode=True)
        self.count = count
        self.fleet: LocalNodes | None = None
        self.node: LocalNode | None = None  # the first
        self.registry: LocalRegistry | None = None

    def start(self) -> None:
        self.start_node()
        try:
            self.prepare()
            pushed = self.publish(E2E_VERSION)
            self.image_ref, self.chart, self.chart_version = pushed.image, pushed.chart, pushed.version
            self._install()
        except BaseException:
            self.cluster.failed = True
            self.stop()
            raise

    def start_node(self) -> None:
        """The control plane, the real node and the registry its containerd pulls from (nothing installed)."""
        # The registry and crane are needed: no fallback to importing the image into containerd by hand.
        tools_bin((*RELEASE_TOOLS, "registry"))
        say("building the image from the Dockerfile (make image; cached when the tree is unchanged)")
        build_image()
        try:
            self.cluster.start()
            self.kubeconfig = self.cluster.kubeconfig
            self.fleet = LocalNodes(self.cluster, self.count)
            say(f"starting {self.count} real node(s): containerd, runc, the kubelet; and kube-scheduler")
            self.fleet.start()
            self.node = self.fleet.nodes[0]
            self.node_name = self.node.name
            assert self.node.dir is not None
            self.disk = self.node.dir / "disk" if self.count == 1 else Path("/var/lib/sandkeep-e2e")
            self.root = self.disk / "sandkeep"
            # On the host's end of the node's link, which exists once the node runs.
            self.registry = LocalRegistry(self.workdir, REGISTRY)
            self.registry.start()
            say(f"a registry (CNCF Distribution) at {REGISTRY}, where the node's containerd pulls from")
        except BaseException:
            self.cluster.failed = True
            self.stop()
            raise

    def prepare(self) -> None:
        """What a suite does to its nodes before the chart is installed (e.g. give one a small disk)."""

    def publish(self, version: str, source: Path = REPO, image_cache: Path | None = None) -> Release:
        """`make release VERSION=version REGISTRY=<the bed's>` of `source` (this tree by default)."""
        say(f"make release VERSION={version} REGISTRY={REGISTRY} (source {source})")
        out = self.workdir / "release" / version
        pushed = release(version, REGISTRY, plain_http=True, source=source, image_cache=image_cache, out=out)
        for line in pushed.lines():
            say(line)
        return pushed

    def pod_spec(self, on: LocalNode, script: str, disk: str | None = None) -> dict[str, Any]:
        """A root container of the sandkeep image on node `on` running `script`, with the node's disk (or `disk`)
        mounted at the same path."""
        path = disk or str(self.disk)
        return {
            "nodeName": on.name,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": self.image_ref,
                    "command": ["sh", "-c", script],
                    "securityContext": {"runAsUser": 0},
                    "volumeMounts": [{"name": "disk", "mountPath": path}],
                }
            ],
            "volumes": [{"name": "disk", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}],
        }

    def job_on(
        self, namespace: str, on: LocalNode, job: str, script: str, timeout: int = 180, wait: bool = True
    ) -> None:
        """A Job on node `on` running `script` (with the node's disk); waits for it to complete (`wait`)."""
        body = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": job, "namespace": namespace},
            "spec": {"backoffLimit": 0, "template": {"spec": self.pod_spec(on, script)}},
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(body))
        if wait:
            self.wait_job(namespace, job, timeout)

    def retain_many(
        self,
        namespace: str,
        on: LocalNode,
        job: str,
        names: list[str],
        retention: str,
        files: int = 1,
        wait: bool = True,
    ) -> None:
        """A Job on node `on` writing a workspace of `files` empty files for each name on the node's disk and
        retaining it in `namespace` (`sandkeep retain`, in one process); waits for it (`wait`)."""
        say(f"on {on.name}: {len(names)} sandboxes of {files} file(s) retained for {retention} ({names[0]}, ...)")
        args = [str(self.root), namespace, retention, str(files), str(self.disk / "jobs"), *names]
        script = shlex.join(["python", "-c", RETAIN_MANY, *args]) + " >/dev/null"
        self.job_on(namespace, on, job, script, timeout=600, wait=wait)

    def wait_job(self, namespace: str, job: str, timeout: int = 180) -> None:
        """Until the Job completes; one that failed, or is not done in `timeout` seconds, fails the test with its
        Pod's last lines (what the command said) and the Job's conditions."""

        def ended() -> str | None:
            got = self.kubectl("get", "job", job, "-n", namespace, "-o", "json")
            status = json.loads(got.stdout).get("status") or {}
            done = [c["type"] for c in status.get("conditions") or [] if c.get("status") == "True"]
            return next((t for t in done if t in ("Complete", "Failed")), None)

        try:
            outcome = eventually(ended, f"the Job {namespace}/{job} to end", timeout=timeout, every=1.0)
        except AssertionError:
            outcome = "not done"
        if outcome != "Complete":
            logs = self.kubectl("logs", f"job/{job}", "-n", namespace, "--tail=40", check=False)
            conditions = self.kubectl("get", "job", job, "-n", namespace, "-o", "jsonpath={.status}", check=False)
            raise AssertionError(
                f"the Job {namespace}/{job}: {outcome}\n{conditions.stdout}\n{logs.stdout}{logs.stderr}"
            )

    @property
    def nodes(self) -> list[LocalNode]:
        return self.fleet.nodes if self.fleet is not None else []

    def on_node(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if self.count > 1:
            return self.in_node(script, check)
        # The one node shares the host's filesystem, so its disk is at the same path here.
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=check, timeout=120)

    def on(self, node: LocalNode, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`sh -c script` as root in `node`'s namespaces (its own disk, its own processes)."""
        return node.in_node("sh", "-c", script, check=check)

    def in_node(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.node is not None
        return self.node.in_node("sh", "-c", script, check=check)

    def stop_kubelet(self) -> None:
        assert self.node is not None
        self.node.stop_kubelet()

    def start_kubelet(self) -> None:
        assert self.node is not None
        self.node.start_kubelet()

    def stop(self) -> None:
        super().stop()
        for node in self.nodes:  # an immutable file left by a failed test would keep the tree
            with contextlib.suppress(ClusterError, subprocess.SubprocessError):
                self.on(node, f"chattr -R -i '{self.root}' 2>/dev/null; true", check=False)
        if self.fleet is not None:
            self.fleet.failed = self.fleet.failed or self.cluster.failed
            self.fleet.stop()
            self.fleet = self.node = None
        if self.registry is not None:
            self.registry.stop()
            self.registry = None
        self.cluster.stop()

    def logs(self) -> str:
        node = self.fleet.logs() if self.fleet is not None else ""
        registry = self.registry.log_tail() if self.registry is not None else ""
        return "\n".join((self.cluster.logs(), node, registry, super().logs()))


class KindBed(Bed):
    """A kind cluster that hack/kind-e2e.sh made (`SANDKEEP_E2E_KIND` names it, `SANDKEEP_E2E_IMAGE` is the image
    it loaded); the node is its worker container. Never run on this repository's machines: no Docker."""

    def __init__(self, workdir: Path, cluster: str, image: str) -> None:
        super().__init__(workdir)
        self.cluster_name = cluster
        self.image_ref = image
        self.node_name = f"{cluster}-control-plane"  # kind's one node
        self.disk = Path("/var/lib/sandkeep-e2e")
        self.root = self.disk / "sandkeep"

    def start(self) -> None:
        self.kubeconfig = self.workdir / "kubeconfig"
        cmd = ["kind", "get", "kubeconfig", "--name", self.cluster_name]
        self.kubeconfig.write_text(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        self._install()

    def on_node(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["docker", "exec", self.node_name, "sh", "-c", script]
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)

    def stop_kubelet(self) -> None:
        self.on_node("systemctl stop kubelet")  # kind's node runs systemd

    def start_kubelet(self) -> None:
        self.on_node("systemctl start kubelet")
        self.kubectl("wait", "node", self.node_name, "--for=condition=Ready", "--timeout=120s", timeout=130)

    def stop(self) -> None:
        super().stop()
        self.on_node(f"chattr -R -i '{self.root}' 2>/dev/null; true", check=False)


def rolled_to(bed: Bed, image: str) -> bool:
    """Every controller and agent Pod runs `image`, is Ready, and no old one is left."""
    deploy = bed.get("deployment", "-n", SYSTEM_NS, "sandkeep-controller")
    ds = bed.get("daemonset", "-n", SYSTEM_NS, "sandkeep-agent")
    pods = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/name=sandkeep")["items"]
    workloads = [
        p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") in ("controller", "agent")
    ]
    images = {ct["image"] for p in workloads for ct in p["spec"]["containers"]}
    ready = all(
        cond["status"] == "True"
        for p in workloads
        for cond in p.get("status", {}).get("conditions", [])
        if cond["type"] == "Ready"
    )
    return (
        images == {image}
        and ready
        and deploy["status"].get("updatedReplicas") == deploy["status"].get("readyReplicas") == 2
        and ds["status"].get("updatedNumberScheduled")
        == ds["status"].get("numberReady")
        == ds["status"].get("desiredNumberScheduled")
        and deploy["status"].get("replicas") == 2
    )


def one_node_at_a_time(bed: Bed, image: str) -> list[str]:
    """The nodes in the order the agents running `image` were created there, each created only once the one
    before was Ready (a rollout that took one node at a time)."""
    pods = [
        p
        for p in bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"]
        if p["spec"]["containers"][0]["image"] == image
    ]
    pods.sort(key=lambda p: p["metadata"]["creationTimestamp"])

    def ready_at(pod: dict[str, Any]) -> str:
        (ready,) = [x for x in pod["status"]["conditions"] if x["type"] == "Ready" and x["status"] == "True"]
        return str(ready["lastTransitionTime"])

    for before, after in itertools.pairwise(pods):
        assert after["metadata"]["creationTimestamp"] >= ready_at(before), (
            f"{after['spec']['nodeName']}'s new agent created before {before['spec']['nodeName']}'s was Ready"
        )
    return [p["spec"]["nodeName"] for p in pods]


B = TypeVar("B", bound=Bed)


@contextlib.contextmanager
def started(bed: B, namespace: str) -> Iterator[B]:
    """`bed` started, with `namespace` for the suite's Jobs (`Bed.job_namespace`); stopped after, also on an error."""
    bed.start()
    try:
        bed.job_namespace(namespace)
        yield bed
    finally:
        bed.stop()


def make_bed(workdir: Path) -> Bed:
    """The kind bed when hack/kind-e2e.sh runs the suite, the local node otherwise."""
    kind = os.environ.get("SANDKEEP_E2E_KIND")
    if kind:
        return KindBed(workdir, kind, os.environ["SANDKEEP_E2E_IMAGE"])
    return LocalBed(workdir)
