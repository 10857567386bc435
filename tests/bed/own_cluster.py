"""A control plane of a test module's own, for questions about the whole cluster.

The shared per-worker cluster holds other tests' objects and Leases in many namespaces; a test that
asks "which namespace is the install?" or runs a documented `-A` command needs a cluster with only
its own objects. About 5 s to start; stopped by pid at the end of the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hack.localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin
from tests.bed.controller_harness import install_crds


def own_cluster(workdir: Path, *, crds: bool = True) -> Iterator[LocalCluster]:
    """Start a LocalCluster (with the CRDs installed unless `crds` is false); yield it; stop it (for a
    module-scoped fixture)."""
    local = LocalCluster(workdir, tools_bin(CLUSTER_TOOLS))
    local.start()
    try:
        if crds:
            install_crds(local)
        yield local
    finally:
        local.stop()
