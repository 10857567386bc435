"""pytest integration of the real local control plane (hack/localcluster.py), for the tests in this folder.

- `cluster`: one LocalCluster per xdist worker, started the first time a test asks for it and stopped
  at the end of the session; a test that uses it is marked `cluster` automatically, and when it fails
  the components' log tails are attached to its report.
- `namespace`: a fresh namespace per test (isolation on the shared cluster), deleted without waiting.
- `kubectl`: the cluster's `kubectl(*args, check=True, input=None, as_user=None, kubeconfig=None)`.
- `kube`: the sandkeep API client as admin, with the CRDs installed.
- `crd`, `nodes`, `agents`, `procs`: the node agent's bed (tests/bed/agentkit.py): the sandbox CRD applied
  once per module, two simulated nodes with roots of their own, `sandkeep agent` processes started for a
  node and stopped by pid after the test, and processes a test starts, killed after it.
- `start`: `start(*flags, env=..., lead=True)` runs a real `sandkeep controller` for the test's namespace
  (tests/bed/controller_harness.py), waits until it leads, and stops it after the test.
- `install`: `install(docs=None, release=None)` applies the chart's rendered RBAC (tests/bed/rbackit.py) for a
  new release in the test's namespace, and removes it after the test.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest

from controller.api.kube import Kube
from controller.rules import contracts as c
from hack.localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin
from tests.bed.agentkit import CRD, AgentProcess, Node
from tests.bed.controller_harness import Controller, install_crds, kube_for
from tests.bed.rbackit import Install, render_rbac

_CLUSTER_KEY = pytest.StashKey[LocalCluster]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `fixturenames` is the transitive closure, so a test that only asks for `namespace` is marked too.
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    # A failing test that used the control plane gets its components' log tails in its report (shown
    # with the failure, carried back from xdist workers), and the cluster dir is kept at the end of the
    # session when SANDKEEP_KEEP_CLUSTER_DIR is set.
    report: pytest.TestReport = yield
    cluster = item.session.stash.get(_CLUSTER_KEY, None)
    if report.failed and cluster is not None and "cluster" in getattr(item, "fixturenames", ()):
        cluster.failed = True
        report.sections.append(("local control plane logs", cluster.logs()))
    return report


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A running etcd + kube-apiserver for this worker; stopped (by pid) at the end of the session."""
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), tools_bin(CLUSTER_TOOLS))
    local.start()
    request.session.stash[_CLUSTER_KEY] = local
    print(f"\nlocal control plane {local.server} ready in {local.startup_seconds:.1f}s", file=sys.stderr)
    try:
        yield local
    finally:
        del request.session.stash[_CLUSTER_KEY]
        local.stop()


def _namespace_name(test_name: str) -> str:
    short = re.sub(r"[^a-z0-9]+", "-", test_name.lower().removeprefix("test_"))[:40].strip("-")
    return f"t-{short}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[str]:
    """A new namespace `t-<test name>-<random>`, deleted (without waiting) after the test.

    kube-controller-manager empties and removes it in the background; one that holds a sandbox with the
    agent's finalizer stays Terminating. The name is unique per test, so nothing ever waits for it.
    """
    name = _namespace_name(request.node.name)
    cluster.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    cluster.request("DELETE", f"/api/v1/namespaces/{name}")  # answers at once; the namespace goes in the background


@pytest.fixture
def kubectl(cluster: LocalCluster) -> Callable[..., CompletedProcess[str]]:
    """The cluster's kubectl runner: `kubectl("get", "pods", "-n", ns)` as admin."""
    return cluster.kubectl


@pytest.fixture
def kube(cluster: LocalCluster) -> Iterator[Kube]:
    """The sandkeep API client as admin, with the CRDs installed."""
    install_crds(cluster)
    client = kube_for(cluster)
    yield client
    client.close()


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{c.SANDBOX_PLURAL}.{c.GROUP}")


@pytest.fixture
def nodes(cluster: Any, crd: None, tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    n1, n2 = Node(cluster, tmp_path, "n1"), Node(cluster, tmp_path, "n2")
    yield n1, n2
    for n in (n1, n2):
        subprocess.run(["chattr", "-R", "-i", str(n.root.path)], capture_output=True, check=False)


@pytest.fixture
def agents(cluster: Any, namespace: str, tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(
        node: Node, env: dict[str, str] | None = None, kubeconfig: Path | None = None, extra: list[str] | None = None
    ) -> AgentProcess:
        log = tmp_path / f"agent-{node.name[:60]}-{len(started)}.log"
        a = AgentProcess(cluster, node, namespace, log, env, kubeconfig, extra)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    started: list[subprocess.Popen[Any]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


@pytest.fixture
def start(cluster: LocalCluster, namespace: str, tmp_path: Path) -> Iterator[Any]:
    """start(*flags, env=...) -> a leading Controller for this test's namespace; all stopped at the end."""
    started: list[Controller] = []

    def run(*flags: str, env: dict[str, str] | None = None, lead: bool = True) -> Controller:
        log = tmp_path / f"controller-{len(started)}.log"
        ctl = Controller(cluster, namespace, log, *flags, env=env)
        started.append(ctl)
        if lead:
            ctl.wait_leader()
        return ctl

    yield run
    for ctl in started:
        ctl.stop()
        print(f"----- {ctl.log_path.name} (last 80 lines) -----\n" + "\n".join(ctl.log().splitlines()[-80:]))


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
