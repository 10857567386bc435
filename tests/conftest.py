"""pytest integration of the real local control plane (hack/localcluster.py).

- `cluster`: one LocalCluster per xdist worker, started the first time a test asks for it and stopped
  at the end of the session; a test that uses it is marked `cluster` automatically, and when it fails
  the components' log tails are attached to its report.
- `namespace`: a fresh namespace per test (isolation on the shared cluster), deleted without waiting.
- `kubectl`: the cluster's `kubectl(*args, check=True, input=None, as_user=None, kubeconfig=None)`.
- `tools`: the built tools' bin dir; fails (never skips) with the reason when they are not built.

The tools' bin dir is put first on PATH for the whole session, so subprocesses find the real kubectl,
helm and promtool rather than whatever else is installed (/usr/bin/kubectl here is a stub).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack"))

from controller_harness import install_crds, kube_for
from localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin, tools_dir
from procs import alive

from controller.api.kube import Kube

_CLUSTER_KEY = pytest.StashKey[LocalCluster]()

# Property tests run beside control planes and real nodes on 2 shared cores: slow input generation there is
# the machine's load, not a defect of the strategy (CI once failed on it at load 25), so it is no failure.
settings.register_profile("sandkeep", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("sandkeep")


def pytest_configure(config: pytest.Config) -> None:
    # Only the path is put on PATH here: whether the tools exist is checked by the fixtures, so the
    # unit tests still run (and the cluster tests fail with the reason) on a machine without them.
    os.environ["PATH"] = f"{tools_dir()}{os.pathsep}{os.environ.get('PATH', '')}"


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
    bed = getattr(item, "funcargs", {}).get("bed")
    if report.failed and bed is not None:  # the end-to-end bed (tests/e2e_bed.py): every component's logs
        report.sections.append(("end-to-end bed logs", bed.logs()))
    cluster = item.session.stash.get(_CLUSTER_KEY, None)
    if report.failed and cluster is not None and "cluster" in getattr(item, "fixturenames", ()):
        cluster.failed = True
        report.sections.append(("local control plane logs", cluster.logs()))
    return report


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Pids a test saw started; any still alive at the end are SIGKILLed by pid."""
    seen: list[int] = []
    yield seen
    for pid in seen:
        if pid > 1 and pid != os.getpid() and alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def tools() -> Path:
    """The bin dir of the built Go tools (kube-apiserver, kube-controller-manager, kubectl, etcd, helm, promtool)."""
    return tools_bin()


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
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


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
