"""Benchmark of the node agent: a root with N sandboxes (default 10,000).

Prints:
- the scan time without size accounting: the root listing, one /proc pass for in-use, and the
  manifest reads adoption needs (each measured alone, best of 3);
- the adoption rate: objects created per second by a real `sandkeep agent` process against the local
  control plane (hack/localcluster.py), from its start until every sandbox has an object;
- the agent's RSS once it has adopted everything and finished a further full pass.

Targets (issue 5): scan < 1 s, RSS < 150 MiB. Numbers are printed, never asserted.

    .venv/bin/python hack/bench/agent_scan.py [--sandboxes 10000] [--no-cluster] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.node.inuse import scan_usage  # noqa: E402
from controller.node.store import Root  # noqa: E402
from controller.rules.models import Manifest  # noqa: E402
from hack.bench.plane import rss_mib  # noqa: E402


def build_root(root: Path, count: int, namespaces: int = 10) -> None:
    """Lay out `count` sandboxes directly (manifest + a small workspace): fast to build, real to scan."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    created = datetime.now(UTC)
    for i in range(count):
        ns = f"bench-{i % namespaces}"
        name = f"run-{i:06d}"
        d = root / ns / name
        (d / "workspace").mkdir(parents=True)
        (d / ".commands").mkdir(mode=0o700)
        (d / "workspace" / "out.txt").write_text("x" * 100)
        m = Manifest.model_validate(
            {
                "namespace": ns,
                "name": name,
                "jobId": f"job-{i}",
                "createdAt": created.isoformat().replace("+00:00", "Z"),
                "retainUntil": (created + timedelta(days=3)).isoformat().replace("+00:00", "Z"),
            }
        )
        (d / "manifest.json").write_text(m.to_json())


def best_of(n: int, fn: object) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_scan(root: Root) -> dict[str, float]:
    listing = best_of(3, root.scan)
    entries = root.scan().sandboxes
    paths = {(e.namespace, e.name): e.path for e in entries}
    in_use = best_of(3, lambda: scan_usage(paths, (), Path("/proc"), {os.getpid()}))
    reads = best_of(3, lambda: [root.read(e.namespace, e.name) for e in entries])
    return {"listing": listing, "in_use": in_use, "reads": reads, "entries": len(entries)}


def measure_agent(root: Root, count: int, workdir: Path, kube_qps: float | None) -> dict[str, float]:
    from hack.apimetrics import writes_by_resource
    from hack.localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin

    cluster = LocalCluster(workdir / "cluster", tools_bin(CLUSTER_TOOLS))
    cluster.start()
    try:
        cluster.kubectl("apply", "-f", str(REPO / "crds" / "sandkeep.io_retainedsandboxes.yaml"))
        cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/retainedsandboxes.sandkeep.io")
        for i in range(10):
            cluster.kubectl("create", "namespace", f"bench-{i}")
        cluster.kubectl("create", "namespace", "sandkeep-system")
        cluster.create_node("bench-node")
        log = workdir / "agent.log"
        pids = [str(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and not _inspectable(p)]
        flags = {
            "--node": "bench-node",
            "--root": str(root.path),
            "--kubeconfig": str(cluster.kubeconfig),
            "--lease-namespace": "sandkeep-system",
            "--metrics-port": "0",
            "--scan-interval": "5s",
        }
        if kube_qps is not None:
            flags["--kube-qps"] = str(kube_qps)
        args = [
            sys.executable,
            "-m",
            "controller.cli.sandkeep",
            "agent",
            *(f"{flag}={value}" for flag, value in flags.items()),
        ]
        args += [f"--ignore-pid={pid}" for pid in pids]
        before = writes_by_resource(cluster.metrics_text())
        with log.open("wb") as out:
            started = time.monotonic()
            agent = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            try:
                while log.read_text().count(" adopted ") < count:
                    if agent.poll() is not None:
                        raise RuntimeError(f"agent exited: {log.read_text()[-2000:]}")
                    time.sleep(0.2)
                adopted_in = time.monotonic() - started
                after = writes_by_resource(cluster.metrics_text())
                writes = sum(after.get(r, 0) - before.get(r, 0) for r in ("retainedsandboxes", "events"))
                rss_adopted = rss_mib(agent.pid)
                time.sleep(20)  # the first status writes and size measurements of every object
                rss = max(rss_adopted, rss_mib(agent.pid))
            finally:
                agent.send_signal(signal.SIGTERM)
                try:
                    agent.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait(timeout=30)
        return {"adopted_in": adopted_in, "rate": count / adopted_in, "rss_mib": rss, "writes": writes}
    finally:
        cluster.stop()


def _inspectable(p: Path) -> bool:
    try:
        (p / "cwd").readlink()
    except PermissionError:
        return False
    except OSError:
        return True
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=10_000)
    parser.add_argument("--no-cluster", action="store_true", help="measure the scan only (no adoption, no RSS)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--kube-qps", type=float, default=None, help="the agent's --kube-qps (default: its own default, 20; -1: none)"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="sandkeep-agent-bench-"))
    try:
        t0 = time.perf_counter()
        build_root(workdir / "root", args.sandboxes)
        built = time.perf_counter() - t0
        root = Root(workdir / "root")
        scan = measure_scan(root)
        result: dict[str, object] = {"sandboxes": args.sandboxes, "built_s": round(built, 2), **scan}
        if not args.no_cluster:
            result.update(measure_agent(root, args.sandboxes, workdir, args.kube_qps))
        if args.json:
            print(json.dumps(result))
        else:
            print(f"sandboxes:            {args.sandboxes} (built in {built:.1f}s)")
            print(f"scan: root listing    {scan['listing']:.3f}s")
            print(f"scan: in-use (/proc)  {scan['in_use']:.3f}s")
            print(f"scan: manifest reads  {scan['reads']:.3f}s")
            total = scan["listing"] + scan["in_use"]
            print(f"scan without sizes:   {total:.3f}s (target < 1 s; manifests are read only to adopt)")
            if "rate" in result:
                qps = "default 20" if args.kube_qps is None else args.kube_qps
                print(
                    f"adoption:             {result['adopted_in']:.1f}s, {result['rate']:.0f} objects/s "
                    f"(--kube-qps {qps}; {result['writes']:.0f} API writes to sandboxes and Events)"
                )
                print(f"agent RSS:            {result['rss_mib']:.0f} MiB (target < 150 MiB)")
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
