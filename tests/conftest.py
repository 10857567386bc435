"""What every test folder shares: the built Go tools on PATH, and the hypothesis profile.

The folders say what their tests need (docs/development.md, "The tests"): `unit/` nothing, `disk/` this
machine's directories and processes, `chart/` helm and promtool, `apiserver/` the real local control plane
(its fixtures are in `apiserver/conftest.py`), `node/` a real node. The test bed they share is `tests/bed/`
and `hack/` (the local control plane and node), imported as packages from the repository root.

- `tools`: the built tools' bin dir; fails (never skips) with the reason when they are not built.

The tools' bin dir is put first on PATH for the whole session, so subprocesses find the real kubectl,
helm and promtool rather than whatever else is installed (/usr/bin/kubectl here is a stub).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from hack.localcluster import REPO, tools_bin, tools_dir

# Property tests run beside control planes and real nodes on 2 shared cores: slow input generation there is
# the machine's load, not a defect of the strategy (CI once failed on it at load 25), so it is no failure.
settings.register_profile("sandkeep", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("sandkeep")


def pytest_configure(config: pytest.Config) -> None:
    # Only the path is put on PATH here: whether the tools exist is checked by the fixtures, so the
    # unit tests still run (and the cluster tests fail with the reason) on a machine without them.
    os.environ["PATH"] = f"{tools_dir()}{os.pathsep}{os.environ.get('PATH', '')}"
    # The tests start hundreds of `sandkeep` processes. Where PYTHONDONTWRITEBYTECODE is set, each compiled
    # the package's modules again: 0.2 s of its 1.1 s of CPU (measured). Their bytecode goes to a cache
    # outside the tree instead (.cache/ is ignored, like the tools' cache), so the tree stays as it was.
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        os.environ.setdefault("PYTHONPYCACHEPREFIX", str(REPO / ".cache" / "pycache"))


@pytest.fixture(scope="session")
def tools() -> Path:
    """The bin dir of the built Go tools (kube-apiserver, kube-controller-manager, kubectl, etcd, helm, promtool)."""
    return tools_bin()
