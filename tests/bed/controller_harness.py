"""Test helpers for the CRDs and the controller against the real local control plane.

- `install_crds(cluster)`: apply `crds/` and wait until the API server serves them (idempotent).
- `render_templates(...)`: some of the chart's templates, rendered by the real helm for one release.
- `only_in(namespace)`: the chart value that binds the pin admission policy to that namespace alone.
- `Controller`: a real `sandkeep controller` subprocess (stopped by pid), its log and metrics.
- `sandbox(...)`, `events_for(...)`, `wait_for(...)`: small builders and a polling wait.
- `get`, `get_policy`, `status_of`, `phase_is(...)`, `gone`: a sandbox or policy as the API server has it now,
  and waits on it. The `start` fixture (tests/apiserver/conftest.py) runs a leading `Controller` per test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import yaml

from controller.api.kube import Kube, load_config, policy_path
from controller.rules import contracts as c
from controller.rules.durations import format_instant
from hack.localcluster import kube_version, tools_bin

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"
CHART = REPO / "charts" / "sandkeep"
T = TypeVar("T")
HOUR = timedelta(hours=1)


_INSTALLED: set[str] = set()  # the clusters (by their admin kubeconfig, unique to each) with the CRDs served


def install_crds(cluster: Any) -> None:
    """Apply every CRD and wait until they are Established; once per cluster (no test removes them), since
    fixtures of every test ask for them and the server-side apply of three schemas is not free."""
    if str(cluster.kubeconfig) in _INSTALLED:
        return
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    crds = (f"crd/{plural}.{c.GROUP}" for plural in (c.SANDBOX_PLURAL, c.POLICY_PLURAL, c.SESSION_PLURAL))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
    _INSTALLED.add(str(cluster.kubeconfig))


def render_templates(release: str, namespace: str, templates: tuple[str, ...], *values: str) -> list[dict[str, Any]]:
    """The objects of some of the chart's templates (`helm template --show-only`) for `release` in `namespace`."""
    args = [str(tools_bin(("helm",)) / "helm"), "template", release, str(CHART), f"--namespace={namespace}"]
    args += [f"--kube-version={kube_version()}", *(f"--show-only=templates/{t}" for t in templates), *values]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def only_in(namespace: str) -> str:
    """`--set` binding the chart's pin policy to one namespace: the test cluster is shared, and other tests
    write malformed pins on purpose to see the controller's own checks."""
    return f"--set=admission.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name={namespace}"


def kube_for(cluster: Any) -> Kube:
    return Kube(load_config(cluster.kubeconfig), "sandkeep-test")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.1) -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def instant(delta: timedelta = timedelta(0)) -> str:
    return format_instant(datetime.now(UTC) + delta)


def sandbox(name: str, node: str = "node-a", created: timedelta = timedelta(0), **spec: Any) -> dict[str, Any]:
    """A RetainedSandbox body: created `created` from now (negative: in the past)."""
    return {
        "metadata": {"name": name},
        "spec": {"nodeName": node, "createdAt": instant(created), **spec},
    }


def events_for(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    result = kube.request(
        "GET", f"/api/v1/namespaces/{namespace}/events", query={"fieldSelector": f"involvedObject.name={name}"}
    )
    items: list[dict[str, Any]] = result.get("items", [])
    return items


def reasons_for(kube: Kube, namespace: str, name: str) -> list[str]:
    return [e["reason"] for e in events_for(kube, namespace, name)]


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            found: dict[str, Any] = cond
            return found
    return None


def scrape(log: Callable[[], str]) -> str:
    """The metrics of a sandkeep process whose log (`log()`) says where it serves them (`metrics=URL`)."""
    found = wait_for("the process's metrics address", lambda: re.search(r"metrics=(http://\S+)", log()))
    with urllib.request.urlopen(found.group(1), timeout=5) as response:
        text: str = response.read().decode()
        return text


class Controller:
    """A real `sandkeep controller` process for one test namespace; stop() ends it by pid."""

    def __init__(
        self, cluster: Any, namespace: str, log_path: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "controller.cli.sandkeep",
            "controller",
            f"--kubeconfig={cluster.kubeconfig}",
            f"--lease-namespace={namespace}",
            f"--watch-namespace={namespace}",
            "--metrics-port=0",
            *args,
        ]
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        return scrape(self.log)

    def wait_leader(self, timeout: float = 30.0) -> None:
        wait_for("the controller to lead", lambda: "leader_elected" in self.log() or self._dead(), timeout)
        assert self.proc.poll() is None, f"controller exited:\n{self.log()}"

    def _dead(self) -> bool:
        return self.proc.poll() is not None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL: only our own process group, only while it is unreaped."""
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def metric_value(text: str, name: str, /, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


def get(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get_sandbox(namespace, name)


def get_policy(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    policy: dict[str, Any] = kube.request("GET", policy_path(namespace, name))
    return policy


def status_of(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    return (get(kube, namespace, name) or {}).get("status") or {}


def phase_is(kube: Kube, namespace: str, name: str, phase: c.Phase, timeout: float = 20) -> dict[str, Any]:
    """Wait until the sandbox shows `phase`; return its status."""

    def probe() -> dict[str, Any] | None:
        status = status_of(kube, namespace, name)
        return status if status.get("phase") == phase else None

    return wait_for(f"{namespace}/{name} to be {phase}", probe, timeout)


def gone(kube: Kube, namespace: str, name: str) -> bool:
    return get(kube, namespace, name) is None
