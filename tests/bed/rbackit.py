"""The bed of the chart's RBAC on the real API server: the rendered RBAC installed, the components as its
ServiceAccounts, and the scenario that shows they do their whole job with it.

- `render_rbac(release, namespace)`: the chart's ServiceAccounts, (Cluster)Roles, bindings and admission
  policies; `rule_verbs` one pytest param per verb of every rule; `without` the same with one verb taken away.
- `Install`: those objects applied to the local control plane, with kubeconfigs holding the ServiceAccounts'
  real TokenRequest tokens (the `install` fixture, tests/apiserver/conftest.py, applies and removes them).
- `Process`: a real `sandkeep` subprocess in its own session; `Scenario`: a real `sandkeep controller` and
  `sandkeep agent` as those ServiceAccounts: the agent adopts directories and renews its heartbeat; the
  controller takes its leader Lease, writes status, converts a `pin-for`, deletes an expired sandbox,
  releases a sandbox of a vanished node and marks a SandboxPolicy Active; `Refused` when a step hits a 403.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.cluster.settings import SEAM_ENV
from controller.node.inuse import uninspectable_pids
from controller.node.store import Root
from controller.rules import contracts as c
from controller.rules.models import bounded_name, label_value
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import only_in, render_templates

REPO = Path(__file__).resolve().parents[2]
RBAC_TEMPLATES = (
    "serviceaccounts.yaml",
    "rbac-controller.yaml",
    "rbac-agent.yaml",
    "rbac-aggregate.yaml",
    "agent-node-scope.yaml",
    "pin-admission.yaml",
)
CLUSTER_SCOPED = (
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)
STEP_TIMEOUT = 30.0
# Where the kinds the scenario reads are served (by their plural, as `Scenario.get` takes them).
API_PATHS = {
    c.SANDBOX_PLURAL: f"/apis/{c.GROUP}/{c.VERSION}",
    c.POLICY_PLURAL: f"/apis/{c.GROUP}/{c.VERSION}",
    c.SESSION_PLURAL: f"/apis/{c.GROUP}/{c.VERSION}",
    "leases": "/apis/coordination.k8s.io/v1",
    "pods": "/api/v1",
    "roles": "/apis/rbac.authorization.k8s.io/v1",
    "rolebindings": "/apis/rbac.authorization.k8s.io/v1",
}
# A request refused by authorization, as the components log it (KubeError text, kopf's messages). A refusal
# for a namespace being deleted is a 403 too, but not an RBAC one (leftovers of other tests on this cluster).
_FORBIDDEN = re.compile(r"\b403\b|[Ff]orbidden")
_NOT_RBAC = re.compile(r"because it is being terminated")


# --- the chart's RBAC -----------------------------------------------------------------------------------
def render_rbac(release: str, namespace: str) -> list[dict[str, Any]]:
    """The chart's ServiceAccounts, (Cluster)Roles, bindings and admission policies for `release` installed
    in `namespace` (the pin policy bound to that namespace alone: the cluster is shared)."""
    return render_templates(release, namespace, RBAC_TEMPLATES, only_in(namespace))


def rule_verbs(docs: list[dict[str, Any]], wanted: Callable[[str], bool]) -> list[Any]:
    """One pytest param per verb of every rule of the `wanted` roles of release `x`: (role, rule index, verb)."""
    out = []
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "Role") and doc["metadata"]["name"].startswith("x-sandkeep-"):
            role = f"{doc['kind']}{doc['metadata']['name'].removeprefix('x-sandkeep')}"
            if not wanted(role):
                continue
            for i, rule in enumerate(doc["rules"]):
                for verb in rule["verbs"]:
                    label = f"{role}:{'/'.join(rule['resources'])}:{verb}"
                    out.append(pytest.param(role, i, verb, id=label))
    return out


def component_role(role: str) -> bool:
    """A component's role; the aggregated `-view`/`-edit` are for people, tested by the editor tests."""
    return not role.endswith(("-view", "-edit"))


def without(docs: list[dict[str, Any]], role: str, index: int, verb: str) -> list[dict[str, Any]]:
    """The same objects with one verb of one rule taken away (the whole rule when it was its last verb)."""
    out = json.loads(json.dumps(docs))
    for doc in out:
        if f"{doc['kind']}{doc['metadata']['name'].partition('-sandkeep')[2]}" == role:
            rule = doc["rules"][index]
            rule["verbs"].remove(verb)
            if not rule["verbs"]:
                del doc["rules"][index]
            return out
    raise AssertionError(f"no {role} in the rendered chart")


@dataclass
class Install:
    """The chart's RBAC applied for one release; cluster-scoped objects are deleted again by `remove`."""

    cluster: LocalCluster
    namespace: str
    release: str
    docs: list[dict[str, Any]]
    dir: Path

    def apply(self) -> None:
        self.cluster.apply(self.docs)

    def remove(self) -> None:
        made = [f"{doc['kind']}/{doc['metadata']['name']}" for doc in self.docs if doc["kind"] in CLUSTER_SCOPED]
        if made:  # one kubectl for them all
            self.cluster.kubectl("delete", *made, "--ignore-not-found", "--wait=false", check=False)

    def sa(self, component: str) -> str:
        return f"{self.release}-sandkeep-{component}"

    def user(self, component: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.sa(component)}"

    def kubeconfig(self, component: str) -> Path:
        """A kubeconfig with a real token of the component's ServiceAccount (TokenRequest)."""
        token = self.cluster.token_for(self.namespace, self.sa(component))
        return self.cluster.kubeconfig_for_token(token, self.dir / f"{component}.kubeconfig")

    def agent_kubeconfig(self, node: str) -> Path:
        """A kubeconfig with the token a real agent pod on `node` gets: bound to a Pod of the DaemonSet's
        ServiceAccount scheduled there, so the API server records the node in it (no kubelet runs the Pod)."""
        pod_name = bounded_name("agent-", node)  # a node name may already take all 253 characters
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": self.namespace},
            "spec": {
                "nodeName": node,
                "serviceAccountName": self.sa("agent"),
                "containers": [{"name": "agent", "image": "sandkeep:test"}],
            },
        }
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        bound = ("--bound-object-kind=Pod", f"--bound-object-name={pod_name}", "--duration=1h")
        token = self.cluster.kubectl("create", "token", self.sa("agent"), "-n", self.namespace, *bound).stdout.strip()
        return self.cluster.kubeconfig_for_token(token, self.dir / f"agent-{label_value(node)}.kubeconfig")


# --- the components, as processes -------------------------------------------------------------------------
class Process:
    """A real `sandkeep` subprocess in its own session, its output in a file; stopped by its pid."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("ab")
        self._terminated = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controller.cli.sandkeep", *args],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """SIGTERM its process group, once: `stop` then waits (signal every process first, then wait)."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


class Refused(AssertionError):
    """The scenario hit an authorization refusal (or a step did not happen): the rule was needed."""


@dataclass
class Scenario:
    """The whole job of both components, run as the chart's ServiceAccounts, step by step."""

    inst: Install
    tmp: Path
    processes: list[Process] = field(default_factory=list)
    node: str = field(default_factory=lambda: f"rbac-node-{secrets.token_hex(3)}")
    ghost: str = field(default_factory=lambda: f"gone-node-{secrets.token_hex(3)}")

    @property
    def cluster(self) -> LocalCluster:
        return self.inst.cluster

    @property
    def ns(self) -> str:
        return self.inst.namespace

    # the steps' plumbing
    def refusals(self) -> list[str]:
        lines = [f"{p.name}: {line}" for p in self.processes for line in p.log().splitlines()]
        return [line for line in lines if _FORBIDDEN.search(line) and not _NOT_RBAC.search(line)]

    def step(self, what: str, probe: Callable[[], Any], timeout: float = STEP_TIMEOUT) -> Any:
        """Poll `probe` until truthy; raise Refused at once when a component logs an authorization refusal."""
        deadline = time.monotonic() + timeout
        while True:
            if refused := self.refusals():
                raise Refused(f"while waiting for {what}: refused: {refused[0][:400]}")
            for p in self.processes:
                if p.proc.poll() is not None:
                    raise Refused(f"while waiting for {what}: {p.name} exited {p.proc.returncode}:\n{p.log()[-2000:]}")
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise Refused(f"{what} did not happen within {timeout}s")
            time.sleep(0.2)

    def get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object as the API server has it now, None when it is not there (an HTTP GET: the steps poll this)."""
        found: dict[str, Any] | None = self.cluster.read(
            f"{API_PATHS[plural]}/namespaces/{namespace or self.ns}/{plural}/{name}"
        )
        return found

    # the scenario
    def prepare(self) -> Root:
        self.cluster.create_node(self.node, ready=True)
        root = Root(self.tmp / "root")
        for name, created in (("keep", timedelta(0)), ("expire", -timedelta(hours=2))):
            src = self.tmp / f"job-{name}"
            (src / "out").mkdir(parents=True)
            (src / "out" / "result.txt").write_text(f"the results of {name}\n")
            root.retain(
                src,
                self.ns,
                name,
                job_id=f"job-{name}",
                created_at=datetime.now(UTC) + created,
                retention=timedelta(hours=1),
                node=self.node,
            )
        # A manifest's pin as the agent finds it, malformed: adoption copies it as it is (the controller then
        # reports it invalid), so the chart's pin policy must not refuse the agent's create for it.
        manifest = root.path / self.ns / "keep" / "manifest.json"
        manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"keepUntil": "next-tuesday"}))
        return root

    def start(self) -> None:
        agent_args = [
            "agent",
            f"--node={self.node}",
            f"--root={self.tmp / 'root'}",
            f"--namespace={self.ns}",
            f"--kubeconfig={self.inst.agent_kubeconfig(self.node)}",
            "--metrics-port=0",
            "--scan-interval=1s",
            "--orphan-timeout=2s",
            *(f"--ignore-pid={pid}" for pid in uninspectable_pids()),
        ]
        controller_args = [
            "controller",
            f"--namespace={self.ns}",
            f"--kubeconfig={self.inst.kubeconfig('controller')}",
            "--metrics-port=0",
            "--node-grace=1s",
            "--lease-duration=5",
        ]
        self.seam.mkdir(exist_ok=True)
        self.processes.append(Process("agent", agent_args, self.tmp / "agent.log"))
        env = {SEAM_ENV: str(self.seam)}
        self.processes.append(Process("controller", controller_args, self.tmp / "controller.log", env))

    @property
    def seam(self) -> Path:
        """Where the controller announces a DELETE it is about to send, and waits to be let go (SEAM_ENV)."""
        return self.tmp / "seam"

    def stop(self) -> None:
        for p in self.processes:  # each shuts down while the next is told to
            p.terminate()
        for p in self.processes:
            p.stop()

    def run(self) -> None:
        root = self.prepare()
        self.start()
        self.step("the controller to hold its leader Lease", lambda: self._holder(c.CONTROLLER_LEASE))
        acquired = self.step("the controller's Lease renewTime", lambda: self._renewed(c.CONTROLLER_LEASE))
        first = self.step("the agent's heartbeat", lambda: self._renewed(f"{c.AGENT_LEASE_PREFIX}{self.node}"))
        self.step(
            "the agent to adopt keep with its finalizer",
            lambda: (
                c.FINALIZER in ((self.get(c.SANDBOX_PLURAL, "keep") or {}).get("metadata", {}).get("finalizers") or [])
            ),
        )
        self.step(
            "the manifest's pin copied as it is",
            lambda: self._annotations("keep").get(c.ANN_PIN_UNTIL) == "next-tuesday",
        )
        self.step("the controller's status on keep", lambda: self._phase("keep") == "Retained")
        self.step("the agent's observed status on keep", lambda: "sizeBytes" in self._status("keep"))
        # A change that lands between the controller's decision and its DELETE: the preconditioned DELETE is
        # refused (409), and the controller reads the sandbox fresh (get) and decides again.
        self.step("the controller's DELETE of expire", lambda: (self.seam / f"{self.ns}.expire.reached").exists())
        self.cluster.kubectl("annotate", "rsb", "expire", "-n", self.ns, "example.com/touched=after-the-decision")
        (self.seam / f"{self.ns}.expire.go").touch()
        self.step("the 409 of the DELETE on the older version", lambda: "delete_conflict" in self._log("controller"))
        self.step(
            "expire to be deleted (controller) and its finalizer dropped (agent)",
            lambda: not self.get(c.SANDBOX_PLURAL, "expire"),
        )
        assert not (root.path / self.ns / "expire").exists(), "expire is gone from the API but not from disk"
        assert (root.path / self.ns / "keep" / "workspace").is_dir()
        self.cluster.kubectl("annotate", "rsb", "keep", "-n", self.ns, f"{c.ANN_PIN_FOR}=2h")
        self.step("the pin-for to be converted into pin-until", lambda: self._pinned("keep"))
        self.step("keep to be Pinned", lambda: self._phase("keep") == "Pinned")
        self.step("the heartbeat to be renewed", lambda: self._renewed(f"{c.AGENT_LEASE_PREFIX}{self.node}", first))
        # a renewal is an update, which the scenario may otherwise outrun (the first comes a retry period in)
        self.step("the controller to renew its Lease", lambda: self._renewed(c.CONTROLLER_LEASE, acquired))
        self._ghost_sandbox_is_released()
        self._policy_is_marked_active()
        self.step("Events from both components", self._events_from_both)
        if refused := self.refusals():
            raise Refused(f"after the last step: refused: {refused[0][:400]}")

    def _ghost_sandbox_is_released(self) -> None:
        """A sandbox of a vanished node: Lost, and on delete its disk finalizer is dropped by the controller."""
        body = {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": "ghost", "namespace": self.ns, "finalizers": [c.FINALIZER]},
            "spec": {"nodeName": self.ghost, "createdAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
        }
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(body))
        self.step("the sandbox of a vanished node to be Lost", lambda: self._phase("ghost") == "Lost")
        self.cluster.kubectl("delete", "rsb", "ghost", "-n", self.ns, "--wait=false")
        self.step("the controller to release the lost sandbox", lambda: not self.get(c.SANDBOX_PLURAL, "ghost"))

    def _policy_is_marked_active(self) -> None:
        """A SandboxPolicy (with the controller's default retention, so nothing else changes): the leader
        writes its status, Active as the one that applies to the namespace."""
        meta = {"name": "team-policy", "namespace": self.ns}
        body = {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": meta, "spec": {"retention": "72h"}}
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(body))
        self.step("the controller to mark the policy Active", lambda: self._active("team-policy"))

    def _active(self, policy: str) -> bool:
        conditions = ((self.get(c.POLICY_PLURAL, policy) or {}).get("status") or {}).get("conditions") or []
        return any(cd["type"] == c.PolicyCondition.ACTIVE and cd["status"] == "True" for cd in conditions)

    def _log(self, name: str) -> str:
        return next(p.log() for p in self.processes if p.name == name)

    def _status(self, name: str) -> dict[str, Any]:
        status: dict[str, Any] = (self.get(c.SANDBOX_PLURAL, name) or {}).get("status") or {}
        return status

    def _phase(self, name: str) -> str | None:
        return self._status(name).get("phase")

    def _annotations(self, name: str) -> dict[str, str]:
        annotations: dict[str, str] = ((self.get(c.SANDBOX_PLURAL, name) or {}).get("metadata") or {}).get(
            "annotations"
        ) or {}
        return annotations

    def _pinned(self, name: str) -> bool:
        annotations = self._annotations(name)
        return c.ANN_PIN_UNTIL in annotations and c.ANN_PIN_FOR not in annotations

    def _holder(self, lease: str) -> str | None:
        return ((self.get("leases", lease) or {}).get("spec") or {}).get("holderIdentity")

    def _renewed(self, lease: str, after: str | None = None) -> str | None:
        renew = ((self.get("leases", lease) or {}).get("spec") or {}).get("renewTime")
        return renew if renew and renew != after else None

    def _events_from_both(self) -> bool:
        events = (self.cluster.read(f"/api/v1/namespaces/{self.ns}/events") or {}).get("items") or []
        sources = {(e.get("source") or {}).get("component") for e in events}
        return {"sandkeep-controller", "sandkeep-agent"} <= sources
