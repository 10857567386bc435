"""Benchmark of releasing for space: choosing among N sandboxes (default 10,000), and releasing them.

Prints, each beside a baseline measured in the same run:
- choose: the agent's whole choice for disk pressure (candidates built from cached objects, then
  `pressure.choose`) and the controller's for a quota (`quota.choose`), against a plain `sorted()` of the
  same sandboxes by deadline, the least any "oldest first" choice costs;
- release (against the local control plane, unless --no-cluster): the agent's real release path
  (`Relief.relieve`: a fresh GET, the checks again, a fresh in-use check of /proc and the node's Pods,
  the preconditioned DELETE, the DiskPressure Event) per sandbox, against a bare GET + DELETE of as many
  other objects with the same client: the API's own cost.

Numbers and ratios are printed, never asserted.

    .venv/bin/python hack/bench/release.py [--sandboxes 10000] [--releases 200] [--no-cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.agent.decide import candidate  # noqa: E402
from controller.node.inuse import Usage  # noqa: E402
from controller.node.treesize import TreeSize  # noqa: E402
from controller.rules import contracts as c  # noqa: E402
from controller.rules.policy import Quota  # noqa: E402
from controller.rules.pressure import Disk, Watermarks, choose  # noqa: E402
from controller.rules.quota import choose as quota_choose  # noqa: E402

NODE = "bench-node"
NAMESPACES = 10
GiB = 1 << 30


def objects(count: int, now: datetime) -> list[dict[str, Any]]:
    """`count` cached objects as the agent holds them: every tenth pinned, deadlines a minute apart."""
    out = []
    for i in range(count):
        ann = {c.ANN_PIN_UNTIL: "2099-01-01T00:00:00Z"} if i % 10 == 0 else {}
        spec = {"nodeName": NODE, "createdAt": (now - timedelta(days=1)).isoformat(), "retainUntil": ""}
        spec["retainUntil"] = (now + timedelta(minutes=i)).isoformat()
        meta = {"name": f"run-{i:06d}", "namespace": f"bench-{i % NAMESPACES}", "uid": f"u{i}", "annotations": ann}
        out.append({"metadata": meta, "spec": spec, "status": {"sizeBytes": GiB // 10}})
    return out


def best_of(rounds: int, fn: Any) -> tuple[float, Any]:
    best, value = float("inf"), None
    for _ in range(rounds):
        started = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - started)
    return best, value


def measure_choice(count: int) -> dict[str, float]:
    now = datetime.now(UTC)
    objs = objects(count, now)
    disk = Disk(size=1000 * GiB, available=50 * GiB)  # 95% used: 150 GiB to free, 0.1 GiB each
    marks = Watermarks(high=85, low=80)

    def pressure() -> Any:
        found = [candidate(o, GiB // 10, Usage(i % 7 == 0), now) for i, o in enumerate(objs)]
        return choose(disk, marks, found)

    found = [candidate(o, GiB // 10, Usage(i % 7 == 0), now) for i, o in enumerate(objs)]
    baseline, _ = best_of(5, lambda: sorted(found, key=lambda f: (f.deadline, f.key)))
    chose, plan = best_of(5, pressure)
    quota, qplan = best_of(5, lambda: quota_choose(Quota(max_count=count // 2), found))
    return {
        "baseline_sort_ms": 1000 * baseline,
        "pressure_ms": 1000 * chose,
        "pressure_released": len(plan.release),
        "quota_ms": 1000 * quota,
        "quota_released": len(qplan.release),
    }


def measure_release(count: int, releases: int, workdir: Path) -> dict[str, float]:
    """The agent's release path against the local control plane, against a bare GET + DELETE."""
    from controller import agent
    from controller.api import kube
    from controller.node.inuse import uninspectable_pids
    from controller.node.store import Root
    from controller.observe import metrics
    from controller.rules.objects import key_of
    from hack.localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin

    cluster = LocalCluster(workdir / "cluster", tools_bin(CLUSTER_TOOLS))
    cluster.start()
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        for i in range(NAMESPACES):
            cluster.kubectl("create", "namespace", f"bench-{i}")
        cluster.create_node(NODE)
        client = kube.Kube(kube.load_config(cluster.kubeconfig), "sandkeep-bench")
        now = datetime.now(UTC)
        bodies = objects(count, now)
        for body in bodies:
            del body["metadata"]["uid"]

        def create(body: dict[str, Any]) -> dict[str, Any]:
            made = client.create_sandbox(body["metadata"]["namespace"], {k: body[k] for k in ("metadata", "spec")})
            return client.apply_status(made, {"sizeBytes": GiB // 10}, kube.AGENT_MANAGER)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            created = list(pool.map(create, bodies))
        made_in = time.perf_counter() - t0

        root = Root(workdir / "root")
        vfs = os.statvfs(root.path)
        disk = Disk.of(vfs)
        # Watermarks that make exactly `releases` sandboxes' measured sizes the shortfall.
        high = max(0.001, 100 * disk.used / disk.size - 0.001)
        low = high / 2
        size = (disk.used - int(low * disk.size / 100)) // releases + 1
        settings = agent.AgentSettings(
            node=NODE,
            root=root.path,
            namespace="default",
            pressure_high=high,
            pressure_low=low,
            ignore_pids=sorted(uninspectable_pids()),
        )
        bench = agent.Agent(settings, client, root, metrics.AgentMetrics(NODE))
        unpinned = [o for o in created if c.ANN_PIN_UNTIL not in (o["metadata"].get("annotations") or {})]
        spare = unpinned[-releases:]  # the newest: never chosen, deleted by the baseline instead
        for obj in created:
            key = key_of(obj)
            bench.state.objects[key] = obj
            bench.state.present.add(key)
            bench.state.usage[key] = Usage(False, ())
            bench.sizer.sizes[key] = TreeSize(size, 1)

        async def relieve() -> None:
            bench.loop = asyncio.get_running_loop()
            await bench.relief.relieve()

        t0 = time.perf_counter()
        asyncio.run(relieve())
        released_in = time.perf_counter() - t0
        released = int(bench.m.pressure_releases.labels(NODE)._value.get())

        t0 = time.perf_counter()
        for obj in spare:
            fresh = client.get_sandbox(*key_of(obj))
            if fresh is not None:
                client.delete_sandbox(fresh)
        bare_in = time.perf_counter() - t0
        client.close()
        return {
            "created_s": made_in,
            "released": released,
            "release_ms": 1000 * released_in / max(released, 1),
            "bare_ms": 1000 * bare_in / len(spare),
        }
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=10_000)
    parser.add_argument("--releases", type=int, default=200, help="how many the release part releases")
    parser.add_argument("--no-cluster", action="store_true", help="measure the choice only")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    choice = measure_choice(args.sandboxes)
    base = choice["baseline_sort_ms"]
    print(f"choose among {args.sandboxes} sandboxes (best of 5):")
    print(f"  baseline: sorted() by deadline     {base:8.1f} ms")
    print(
        f"  disk pressure (candidates+choose)  {choice['pressure_ms']:8.1f} ms  "
        f"ratio {choice['pressure_ms'] / base:.1f}x  ({choice['pressure_released']} chosen)"
    )
    print(
        f"  quota (choose)                     {choice['quota_ms']:8.1f} ms  "
        f"ratio {choice['quota_ms'] / base:.1f}x  ({choice['quota_released']} chosen)"
    )
    if args.no_cluster:
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="sandkeep-release-bench-"))
    try:
        release = measure_release(args.sandboxes, args.releases, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"release against the local control plane ({args.sandboxes} objects made in {release['created_s']:.0f}s):")
    print(f"  baseline: bare GET + DELETE        {release['bare_ms']:8.1f} ms per sandbox")
    print(
        f"  the agent's release path           {release['release_ms']:8.1f} ms per sandbox  "
        f"ratio {release['release_ms'] / release['bare_ms']:.1f}x  ({release['released']} released)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
