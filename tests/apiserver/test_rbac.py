"""The chart's RBAC proven on the real API server: the components do their whole job as the chart's
ServiceAccounts (real TokenRequest tokens, never admin), every rule is needed, and nobody gets more.

`helm template` renders the ServiceAccounts, (Cluster)Roles and bindings of a uniquely named release into
the test's namespace; they are applied to the local control plane; a real `sandkeep controller` and a
real `sandkeep agent` run with kubeconfigs holding their ServiceAccounts' tokens. The scenario: the agent
adopts directories (with its finalizer) and renews its heartbeat; the controller takes its leader Lease,
writes status, converts a `pin-for`, deletes an expired sandbox (the agent then removes it from disk and
drops its finalizer), releases a sandbox of a vanished node and marks a SandboxPolicy Active. The
rule-removal tests take one verb of one rule away at a time and show the scenario then hits a refusal.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.api.kube import Kube, KubeError, load_config
from controller.api.leases import heartbeat_name, read_lease, renew_heartbeat
from controller.cluster.settings import SEAM_ENV
from controller.node.inuse import uninspectable_pids
from controller.node.store import Root
from controller.rules import contracts as c
from controller.rules.models import NAME_MAX, bounded_name, label_value
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import (
    install_crds,
    metric_value,
    only_in,
    render_templates,
    scrape,
    wait_for,
)

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


# Verbs the scenario cannot make a component use deterministically, each with the code path that uses it;
# the test checks that path still exists (if it goes, so must the verb).
NOT_REACHED_BY_THE_SCENARIO = {
    "ClusterRole-agent:retainedsandboxes:get": (
        ("controller.agent", "Agent._finish"),
        "get_sandbox",
        "the fresh read after a 409 on finalizer removal needs a write racing that removal",
    ),
    "ClusterRole-agent:retainedsandboxes:delete": (
        ("controller.agent.relief", "Relief._release_one"),
        "delete_sandbox",
        "releasing for space needs a full disk: tests/node/test_nodes.py fills a real node's small disk",
    ),
}


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


@pytest.fixture
def install(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Callable[..., Install]]:
    made: list[Install] = []

    def make(docs: list[dict[str, Any]] | None = None, release: str | None = None) -> Install:
        release = release or f"rb{secrets.token_hex(3)}"
        rendered = docs if docs is not None else render_rbac(release, namespace)
        inst = Install(cluster, namespace, release, rendered, tmp_path)
        made.append(inst)
        inst.apply()
        return inst

    install_crds(cluster)
    yield make
    for inst in made:
        inst.remove()


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


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Callable[[Install], Scenario]]:
    made: list[Scenario] = []

    def make(inst: Install) -> Scenario:
        made.append(Scenario(inst, tmp_path))
        return made[-1]

    yield make
    for s in made:
        s.stop()


# --- the tests ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_controller_and_agent_do_their_whole_job_as_the_charts_serviceaccounts(
    install: Callable[..., Install], scenario: Callable[[Install], Scenario]
) -> None:
    run = scenario(install())
    try:
        run.run()
    except Refused as err:
        logs = "\n".join(f"----- {p.name}\n{p.log()[-3000:]}" for p in run.processes)
        raise AssertionError(f"{err}\n{logs}") from None


@pytest.mark.slow
@pytest.mark.parametrize(("role", "index", "verb"), rule_verbs(render_rbac("x", "ns"), component_role))
def test_every_verb_of_every_rule_is_needed(
    request: pytest.FixtureRequest,
    install: Callable[..., Install],
    scenario: Callable[[Install], Scenario],
    namespace: str,
    role: str,
    index: int,
    verb: str,
) -> None:
    label = request.node.callspec.id
    if label in NOT_REACHED_BY_THE_SCENARIO:
        (module, qualname), call, why = NOT_REACHED_BY_THE_SCENARIO[label]
        target = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        assert call in inspect.getsource(target), f"{qualname} no longer calls {call} ({why}): drop {label}"
        return
    release = f"rb{secrets.token_hex(3)}"
    inst = install(without(render_rbac(release, namespace), role, index, verb), release=release)
    run = scenario(inst)
    with pytest.raises(Refused) as refused:
        run.run()
    print(f"without {role} rule {index} verb {verb}: {refused.value}")


# --- the controller's session rules: the whole of a session, as its ServiceAccount ---------------------------
def render_sessions(release: str, namespace: str) -> list[dict[str, Any]]:
    """The chart's RBAC with sessions on."""
    return render_templates(
        release, namespace, (*RBAC_TEMPLATES, "sessions.yaml"), only_in(namespace), "--set=sessions.enabled=true"
    )


def session_role(role: str) -> bool:
    """The controller's session rules: its ClusterRole (sessions, their Pods in any namespace, the guard)."""
    return role == "ClusterRole-controller-sessions"


class SessionScenario(Scenario):
    """A session's whole life as the controller's ServiceAccount sees it: watched, its Pod created in the
    sandbox's own namespace and read, its status written, Running once its Pod runs ready, and its Pod
    deleted when it is deleted. Nothing is granted. No kubelet runs here: the Pod's running state is
    written as the kubelet writes it; the controller's own calls are what is proven."""

    def start(self) -> None:
        controller_args = [
            "controller",
            f"--namespace={self.ns}",
            f"--kubeconfig={self.inst.kubeconfig('controller')}",
            "--metrics-port=0",
            "--lease-duration=5",
            "--sessions",
            "--sessions-image=sandkeep:test",
            f"--sessions-admission-binding={self.inst.release}-sandkeep-sessions",
            f"--watch-namespace={self.ns}",  # this test's sessions only: other tests' are other installs'
        ]
        self.processes.append(Process("controller", controller_args, self.tmp / "controller.log"))

    def run(self) -> None:
        self.cluster.create_node(self.node, ready=True)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        sandbox = {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": "look", "namespace": self.ns},
            "spec": {"nodeName": self.node, "createdAt": now},
        }
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(sandbox))
        self.start()
        self.step("the controller to hold its leader Lease", lambda: self._holder(c.CONTROLLER_LEASE))
        self.step("the controller's status on look", lambda: self._phase("look") == "Retained")
        me = self.cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout.strip()
        session = {
            "apiVersion": c.API_VERSION,
            "kind": c.SESSION_KIND,
            "metadata": {"name": "look-1", "namespace": self.ns},
            "spec": {"sandbox": "look", "user": me},
        }
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(session))
        pod = self.step("the session's Pod", self._session_pod)
        self._runs(pod)
        self.step("the session Running", lambda: self._session_phase() == c.SessionPhase.RUNNING)
        name = pod["metadata"]["name"]
        assert not self.get("rolebindings", name) and not self.get("roles", name), "nothing is granted"
        self.cluster.kubectl("delete", c.SESSION_PLURAL, "look-1", "-n", self.ns)
        self.step("the Pod deleted", lambda: self._torn_down(name))
        if refused := self.refusals():
            raise Refused(f"after the last step: refused: {refused[0][:400]}")

    def stop(self) -> None:
        super().stop()
        # No kubelet finishes a Pod's graceful deletion here: remove them outright, so the namespace can go.
        self.cluster.kubectl("delete", "pods", "--all", "-n", self.ns, "--grace-period=0", "--force", check=False)

    def _torn_down(self, name: str) -> bool:
        pod = self.get("pods", name)
        return pod is None or "deletionTimestamp" in pod["metadata"]

    def _session_phase(self) -> str | None:
        status = (self.get(c.SESSION_PLURAL, "look-1") or {}).get("status") or {}
        if status.get("phase") in (c.SessionPhase.REFUSED, c.SessionPhase.ENDED):
            raise Refused(f"the session {status['phase']}: {status.get('reason')}: {status.get('message')}")
        phase: str | None = status.get("phase")
        return phase

    def _session_pod(self) -> dict[str, Any] | None:
        self._session_phase()
        name = ((self.get(c.SESSION_PLURAL, "look-1") or {}).get("status") or {}).get("podName")
        return self.get("pods", name) if name else None

    def _runs(self, pod: dict[str, Any]) -> None:
        """What the kubelet reports of a started Pod whose volumes (the sandbox's, by the plugin) mounted."""
        started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        container = {
            "name": c.SESSION_CONTAINER,
            "image": "sandkeep:test",
            "imageID": "",
            "ready": True,
            "restartCount": 0,
            "containerID": f"containerd://{secrets.token_hex(32)}",
            "state": {"running": {"startedAt": started}},
        }
        status = {"status": {"phase": "Running", "containerStatuses": [container]}}
        name = pod["metadata"]["name"]
        self.cluster.kubectl(
            "patch", "pod", name, "-n", self.ns, "--subresource=status", "--type=merge", "-p", json.dumps(status)
        )


@pytest.mark.slow
def test_the_controller_runs_a_whole_session_as_the_charts_serviceaccount(
    install: Callable[..., Install], namespace: str, tmp_path: Path
) -> None:
    release = f"rs{secrets.token_hex(3)}"
    run = SessionScenario(install(render_sessions(release, namespace), release=release), tmp_path)
    try:
        run.run()
    except Refused as err:
        raise AssertionError(f"{err}\n{run.processes[0].log()[-3000:]}") from None
    finally:
        run.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("role", "index", "verb"), rule_verbs(render_sessions("x", "ns"), session_role))
def test_every_verb_of_the_controllers_session_rules_is_needed(
    install: Callable[..., Install], namespace: str, tmp_path: Path, role: str, index: int, verb: str
) -> None:
    release = f"rs{secrets.token_hex(3)}"
    run = SessionScenario(
        install(without(render_sessions(release, namespace), role, index, verb), release=release), tmp_path
    )
    try:
        with pytest.raises(Refused) as refused:
            run.run()
    finally:
        run.stop()
    print(f"without {role} rule {index} verb {verb}: {refused.value}")


@pytest.mark.slow
def test_a_pod_the_controller_was_refused_to_delete_goes_once_it_may(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    release = f"rs{secrets.token_hex(3)}"
    full = render_sessions(release, namespace)
    name = f"{release}-sandkeep-controller-sessions"
    (role,) = [d for d in full if d["kind"] == "ClusterRole" and d["metadata"]["name"] == name]
    pods = next(i for i, rule in enumerate(role["rules"]) if rule["resources"] == ["pods"])
    inst = install(without(full, "ClusterRole-controller-sessions", pods, "delete"), release=release)
    run = SessionScenario(inst, tmp_path)
    try:
        with pytest.raises(Refused, match="pods"):
            run.run()
        assert run.get(c.SESSION_PLURAL, "look-1") is None, "the session is deleted; its Pod is what is left"

        def left() -> list[dict[str, Any]]:
            items = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", c.LABEL_SESSION_UID)["items"]
            return [p for p in items if "deletionTimestamp" not in p["metadata"]]

        assert left(), "the refused teardown left the Pod"
        cluster.apply([role])  # the verb given back: the worker's retry deletes the Pod
        wait_for("the Pod deleted", lambda: not left() or None, timeout=60)
        assert "retry_in" in run.processes[0].log()
        text = scrape(run.processes[0].log)  # the refusals counted, in controller-runtime's names and sandkeep's
        sessions = {"controller": c.Queue.SESSIONS}
        errors = metric_value(text, c.M_RECONCILE_ERRORS_TOTAL, **sessions)
        assert errors >= 1
        assert errors == metric_value(text, c.M_RECONCILE_TOTAL, **sessions, result=c.ReconcileResult.ERROR)
        assert errors == metric_value(text, c.M_RECONCILE_ERRORS, component=c.Queue.SESSIONS)
    finally:
        run.stop()


# --- what nobody may do, and what people may do -------------------------------------------------------------
def can_i(cluster: LocalCluster, kubeconfig: Path | None, *args: str, as_user: str | None = None) -> bool:
    """`kubectl auth can-i` as the holder of `kubeconfig` (a real ServiceAccount token) or as `as_user`."""
    result = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, as_user=as_user, check=False)
    return result.stdout.strip() == "yes"


def test_the_agent_deletes_no_other_object_reads_no_secrets_and_cannot_escalate(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    inst = install()
    agent = inst.kubeconfig("agent")
    # what it needs, so the refusals below are about rights and not a broken token
    for needed in (
        ("create", "retainedsandboxes.sandkeep.io", "-n", namespace),
        ("patch", "retainedsandboxes.sandkeep.io", "-n", namespace),
        ("delete", "retainedsandboxes.sandkeep.io", "-n", namespace),  # its own node's only: the node-scope policy
        ("list", "pods", "--all-namespaces"),  # also how a captured volume's Pod ended: no get on Pods needed
        ("create", "events", "-n", namespace),  # also on a Pod whose workspace was kept or not (WorkspaceKept...)
        ("update", "leases.coordination.k8s.io", "-n", namespace),
    ):
        assert can_i(cluster, agent, *needed), f"the agent cannot {needed}"
    for refused in (
        ("deletecollection", "retainedsandboxes.sandkeep.io", "-n", namespace),
        ("delete", "pods", "-n", namespace),
        ("delete", "leases.coordination.k8s.io", "-n", namespace),
        ("delete", "namespaces"),
        ("delete", "nodes"),
        ("get", "secrets", "-n", namespace),
        ("list", "secrets", "--all-namespaces"),
        ("get", "configmaps", "-n", namespace),
        ("get", "pods", "-n", namespace),  # capture reads its node's Pods from the list, never one by one
        ("create", "pods", "-n", namespace),
        ("patch", "nodes"),
        ("create", "rolebindings.rbac.authorization.k8s.io", "-n", namespace),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("escalate", "clusterroles.rbac.authorization.k8s.io"),
        ("bind", "clusterroles.rbac.authorization.k8s.io"),
        ("impersonate", "users"),
        ("create", "serviceaccounts/token", "-n", namespace),
        ("patch", "sandboxpolicies.sandkeep.io", "-n", namespace),
    ):
        assert not can_i(cluster, agent, *refused), f"the agent can {refused}"
    # and the API server really refuses, not only the review
    cluster.kubectl("create", "configmap", "not-yours", "-n", namespace)
    result = cluster.kubectl("delete", "configmap", "not-yours", "-n", namespace, kubeconfig=agent, check=False)
    assert result.returncode != 0 and "forbidden" in result.stderr
    result = cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=agent, check=False)
    assert result.returncode != 0 and "forbidden" in result.stderr


def test_the_controller_cannot_create_sandboxes_read_secrets_or_escalate(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    controller = install().kubeconfig("controller")
    assert can_i(cluster, controller, "delete", "retainedsandboxes.sandkeep.io", "-n", namespace)
    for refused in (
        ("create", "retainedsandboxes.sandkeep.io", "-n", namespace),  # adoption is the agent's
        ("get", "secrets", "-n", namespace),
        ("delete", "pods", "-n", namespace),
        ("update", "leases.coordination.k8s.io/sandkeep-agent-node-a", "-n", namespace),  # not its heartbeat
        ("create", "rolebindings.rbac.authorization.k8s.io", "-n", namespace),
        ("escalate", "clusterroles.rbac.authorization.k8s.io"),
        ("patch", "sandboxpolicies.sandkeep.io", "-n", namespace),
    ):
        assert not can_i(cluster, controller, *refused), f"the controller can {refused}"


def aggregated(cluster: LocalCluster, builtin: str, ours: str) -> bool:
    """Whether kube-controller-manager's clusterrole-aggregation controller has folded every rule of
    ClusterRole `ours` into the built-in ClusterRole `builtin`."""
    rules = cluster.kubectl_json("get", "clusterrole", builtin).get("rules") or []
    return all(rule in rules for rule in cluster.kubectl_json("get", "clusterrole", ours).get("rules") or [])


@pytest.fixture
def other_namespace(cluster: LocalCluster) -> Iterator[str]:
    name = f"t-other-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_a_namespace_editor_can_pin_in_their_namespace_and_not_in_another(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str, other_namespace: str
) -> None:
    # The chart's -view and -edit ClusterRoles reach people through the built-in view/edit/admin roles,
    # aggregated by the real controller (view nests into edit, edit into admin).
    inst = install()
    for builtin, ours in (("view", "view"), ("edit", "view"), ("edit", "edit"), ("admin", "edit")):
        wait_for(
            f"the chart's -{ours} rules aggregated into {builtin}",
            lambda b=builtin, o=ours: aggregated(cluster, b, f"{inst.release}-sandkeep-{o}"),
            timeout=30,
        )
    editor, viewer = f"alice-{secrets.token_hex(2)}", f"bob-{secrets.token_hex(2)}"
    cluster.kubectl("create", "rolebinding", "alice-edits", "--clusterrole=edit", f"--user={editor}", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "bob-views", "--clusterrole=view", f"--user={viewer}", "-n", namespace)
    for ns in (namespace, other_namespace):
        body = {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": "run-42", "namespace": ns},
            "spec": {"nodeName": "node-a", "createdAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
        }
        cluster.kubectl("create", "-f", "-", input=json.dumps(body))

    def kubectl_as(user: str, *args: str) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl(*args, as_user=user, check=False)

    pin = ("annotate", "rsb", "run-42", f"{c.ANN_PIN_FOR}=72h")
    assert kubectl_as(editor, *pin, "-n", namespace).returncode == 0
    assert cluster.kubectl_json("get", "rsb", "run-42", "-n", namespace)["metadata"]["annotations"][c.ANN_PIN_FOR]
    refused = kubectl_as(editor, *pin, "-n", other_namespace)
    assert refused.returncode != 0 and "forbidden" in refused.stderr
    assert kubectl_as(editor, "annotate", "rsb", "run-42", f"{c.ANN_PIN_FOR}-", "-n", namespace).returncode == 0
    # status is the components' alone: no phase, and no record of when a pin was first seen (the maxPin cap's
    # reference), can be forged by an editor
    for forged in (
        {"phase": "Pinned"},
        {"pinSeen": {"pinUntil": "2099-01-01T00:00:00Z", "at": "2099-01-01T00:00:00Z"}},
    ):
        body = json.dumps({"status": forged})
        status = kubectl_as(
            editor, "patch", "rsb", "run-42", "-n", namespace, "--subresource=status", "--type=merge", "-p", body
        )
        assert status.returncode != 0 and "forbidden" in status.stderr, "status is the components' alone"
    # a viewer lists and reads, and cannot pin
    assert "run-42" in kubectl_as(viewer, "get", "rsb", "-n", namespace).stdout
    assert kubectl_as(viewer, "get", "sandboxpolicies", "-n", namespace).returncode == 0
    viewer_pin = kubectl_as(viewer, *pin, "-n", namespace)
    assert viewer_pin.returncode != 0 and "forbidden" in viewer_pin.stderr
    assert kubectl_as(viewer, "get", "rsb", "-n", other_namespace).returncode != 0
    # the editor may delete one now, in their namespace only
    assert kubectl_as(editor, "delete", "rsb", "run-42", "-n", other_namespace).returncode != 0
    assert kubectl_as(editor, "delete", "rsb", "run-42", "-n", namespace, "--wait=false").returncode == 0


def node_scope_in_force(cluster: LocalCluster, namespace: str, agent: Path) -> None:
    """A new admission policy takes a moment to load: wait until the node-scope policy refuses this agent a
    Lease that is not its heartbeat (deleted again each time it was still admitted)."""
    name = f"not-a-heartbeat-{secrets.token_hex(3)}"
    probe = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}, "spec": {}}
    deadline = time.monotonic() + 20
    create = ("create", "-n", namespace, "-f", "-")
    while cluster.kubectl(*create, input=json.dumps(probe), kubeconfig=agent, check=False).returncode == 0:
        cluster.kubectl("delete", "lease", name, "-n", namespace, "--wait=false")
        assert time.monotonic() < deadline, "the agent node-scope policy never took effect"
        time.sleep(0.3)


def test_an_agent_writes_only_its_own_nodes_sandboxes_and_heartbeat(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    # RBAC lets the agent write any RetainedSandbox and any Lease of the lease namespace; the chart's
    # ValidatingAdmissionPolicy narrows that to its own node, read from its pod-bound token.
    inst = install()
    mine, other = f"scope-a-{secrets.token_hex(3)}", f"scope-b-{secrets.token_hex(3)}"
    for node in (mine, other):
        cluster.create_node(node)
    agent = inst.agent_kubeconfig(mine)

    def sandbox(name: str, node: str) -> dict[str, Any]:
        return {
            "apiVersion": c.API_VERSION,
            "kind": c.SANDBOX_KIND,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodeName": node, "createdAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
        }

    def lease(name: str, node: str = mine) -> dict[str, Any]:
        meta = {"name": name, "namespace": namespace, "annotations": {c.LABEL_NODE: node}}
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": {}}

    def create(obj: dict[str, Any], kubeconfig: Path | None = agent) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl("create", "-f", "-", input=json.dumps(obj), kubeconfig=kubeconfig, check=False)

    node_scope_in_force(cluster, namespace, agent)
    result = create(sandbox("theirs", other))
    assert result.returncode != 0
    assert f"may only write RetainedSandboxes of its own node; theirs is on node {other}" in result.stderr
    assert create(sandbox("ours", mine)).returncode == 0
    assert create(lease(f"{c.AGENT_LEASE_PREFIX}{mine}")).returncode == 0
    for name in (f"{c.AGENT_LEASE_PREFIX}{other}", c.CONTROLLER_LEASE):
        refused = create(lease(name))
        assert refused.returncode != 0 and "may only write its own heartbeat Lease" in refused.stderr, name
    # its own Lease's name, but saying it is another node's heartbeat: refused
    own = f"{c.AGENT_LEASE_PREFIX}{mine}"
    refused = create(lease(own, node=other))
    assert f'sandkeep.io/node annotation names that node; {own} names "{other}"' in refused.stderr
    # a token not bound to a pod names no node: refused, however the object looks
    unbound = create(sandbox("unbound", mine), kubeconfig=inst.kubeconfig("agent"))
    assert unbound.returncode != 0 and "names no node" in unbound.stderr
    # the policy is about the agent only: others (here admin) still create sandboxes anywhere
    assert create(sandbox("admins", other), kubeconfig=None).returncode == 0
    # a release for space deletes its own node's sandbox, never another node's
    delete = ("delete", c.SANDBOX_PLURAL, "-n", namespace, "--wait=false")
    refused = cluster.kubectl(*delete, "admins", kubeconfig=agent, check=False)
    assert f"may only write RetainedSandboxes of its own node; admins is on node {other}" in refused.stderr
    assert cluster.kubectl(*delete, "ours", kubeconfig=agent, check=False).returncode == 0


def test_the_agent_of_a_node_with_a_253_character_name_keeps_its_own_heartbeat_and_no_other(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    # `sandkeep-agent-` + a node name over 238 characters is no object name: that heartbeat is named after
    # the node alone, a name the node-scope policy computes too (it used to admit only prefix + node).
    inst = install()
    part = secrets.token_hex(32)[:63]
    node = ".".join([part, part[::-1], part, part[:61]])
    assert len(node) == NAME_MAX and heartbeat_name(node) == node
    cluster.create_node(node, ready=True)
    agent = inst.agent_kubeconfig(node)
    Root(tmp_path / "root")
    args = ["agent", f"--node={node}", f"--root={tmp_path / 'root'}", f"--namespace={namespace}"]
    args += [f"--kubeconfig={agent}", "--metrics-port=0", "--scan-interval=1s"]
    process = Process("agent", [*args, *(f"--ignore-pid={pid}" for pid in uninspectable_pids())], tmp_path / "a.log")

    def lease(name: str) -> dict[str, Any]:
        found = cluster.kubectl("get", "lease", name, "-n", namespace, "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else {"metadata": {}, "spec": {}}

    def renewed_with_report() -> bool:  # the create, a renewal (PUT) and the report (PATCH) all admitted
        got = lease(node)
        return c.ANN_ORPHAN_TOMBSTONES in (got["metadata"].get("annotations") or {}) and got["spec"].get(
            "renewTime"
        ) != got["spec"].get("acquireTime")

    try:
        wait_for("the agent's heartbeat, renewed, with its report", renewed_with_report, timeout=40)
        assert lease(node)["metadata"]["annotations"][c.LABEL_NODE] == node
        assert not _FORBIDDEN.search(process.log()), process.log()[-2000:]
    finally:
        process.stop()
    # the name the chart used to admit (cut to fit), the hashed one leases.py used to make: both refused
    for name in (f"{c.AGENT_LEASE_PREFIX}{node}"[:NAME_MAX], bounded_name(c.AGENT_LEASE_PREFIX, node)):
        meta = {"name": name, "namespace": namespace, "annotations": {c.LABEL_NODE: node}}
        body = json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": {}})
        refused = cluster.kubectl("create", "-f", "-", input=body, kubeconfig=agent, check=False).stderr
        assert f"may only write its own heartbeat Lease {node}, not {name}" in refused, refused


def test_two_nodes_sharing_a_heartbeat_name_cannot_renew_each_others(
    install: Callable[..., Install], cluster: LocalCluster, namespace: str
) -> None:
    # The one collision of the name scheme: node X (238 characters or fewer) and a node named
    # `sandkeep-agent-X`. The first heartbeat's node annotation says whose the Lease is.
    inst = install()
    short = f"{secrets.token_hex(3)}.{'s' * (NAME_MAX - len(c.AGENT_LEASE_PREFIX) - 7)}"
    long = f"{c.AGENT_LEASE_PREFIX}{short}"
    assert len(long) == NAME_MAX and heartbeat_name(short) == heartbeat_name(long) == long
    kubeconfigs = {}
    for n in (short, long):
        cluster.create_node(n, ready=True)
        kubeconfigs[n] = inst.agent_kubeconfig(n)
    node_scope_in_force(cluster, namespace, kubeconfigs[short])
    clients = {n: Kube(load_config(kubeconfig), "sandkeep-test") for n, kubeconfig in kubeconfigs.items()}
    try:
        renew_heartbeat(clients[short], namespace, short, "agent-short")
        with pytest.raises(KubeError) as refused:
            renew_heartbeat(clients[long], namespace, long, "agent-long")
        assert refused.value.status == 403
        assert f'sandkeep.io/node annotation names that node; {long} names "{short}"' in refused.value.message
        renew_heartbeat(clients[short], namespace, short, "agent-short")  # still its own to renew
        state = read_lease(clients[short], namespace, long)
        assert state is not None and state.holder == "agent-short"
    finally:
        for client in clients.values():
            client.close()
