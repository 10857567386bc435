"""Benchmark of a mass expiry on one node: N sandboxes (default 1,000) deleted in the same second.

A real `sandkeep agent` process owns a root of N small sandboxes (adopted against the local control
plane), on a machine running P other processes (default 2,000 `sleep`s, so /proc is as big as a busy
node's); a few sandboxes are in use (a process with its cwd inside). Then every object is deleted at once,
as the controller's DELETEs of a retention change would arrive. Prints, beside baselines measured in the
same run:
- the time from the deletes to the last directory gone, against `rm -rf` of as many identical trees plus
  one /proc pass for all of them (the least any safe deletion of them must do);
- how many /proc passes the agent made for them (`sandkeep_inuse_scans_total`), against the one a batch
  needs;
- that the held sandboxes are still there, and nothing else is.

Numbers are printed, never asserted. Needs root and the built tools.

    .venv/bin/python hack/bench/mass_expiry.py [--sandboxes 1000] [--processes 2000] [--held 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.node.inuse import scan_usage, uninspectable_pids  # noqa: E402
from controller.rules import contracts as c  # noqa: E402
from controller.rules.models import Manifest  # noqa: E402

NODE = "mass-node"
NAMESPACE = "mass"


def build(root: Path, count: int) -> list[Path]:
    """`count` sandboxes of a few files each, laid out as `sandkeep retain` leaves them."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    created = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    until = (datetime.now(UTC) + timedelta(days=3)).isoformat().replace("+00:00", "Z")
    out = []
    for i in range(count):
        d = root / NAMESPACE / f"run-{i:05d}"
        (d / "workspace" / "logs").mkdir(parents=True)
        (d / ".commands").mkdir(mode=0o700)
        for j in range(5):
            (d / "workspace" / "logs" / f"step-{j}.log").write_text("ok\n" * 50)
        m = {"namespace": NAMESPACE, "name": d.name, "jobId": f"job-{i}", "createdAt": created, "retainUntil": until}
        (d / "manifest.json").write_text(Manifest.model_validate(m).to_json())
        out.append(d)
    return out


def baseline(workdir: Path, count: int) -> float:
    """`rm -rf` of `count` identical trees, plus one /proc pass answering for all of them."""
    trees = build(workdir / "baseline-root", count)
    os.sync()
    started = time.monotonic()
    scan_usage({i: p for i, p in enumerate(trees)}, (), Path("/proc"), {os.getpid()})
    subprocess.run(["rm", "-rf", str(workdir / "baseline-root" / NAMESPACE)], check=True)
    return time.monotonic() - started


def scans(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(c.M_INUSE_SCANS):
            return float(line.rpartition(" ")[2])
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=2000, help="other processes on the machine (sleeps)")
    parser.add_argument("--held", type=int, default=5, help="sandboxes kept in use by a process inside")
    args = parser.parse_args()
    from controller.api.kube import Kube, load_config
    from hack.localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin

    load = os.getloadavg()
    print(f"load average: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    workdir = Path(tempfile.mkdtemp(prefix="sandkeep-mass-"))
    sleepers: list[subprocess.Popen[bytes]] = []
    agent: subprocess.Popen[bytes] | None = None
    cluster = LocalCluster(workdir / "cluster", tools_bin(CLUSTER_TOOLS))
    try:
        rm_rf = baseline(workdir, args.sandboxes)
        for _ in range(args.processes):
            sleepers.append(subprocess.Popen(["sleep", "3600"], cwd="/", start_new_session=True))
        dirs = build(workdir / "root", args.sandboxes)
        for d in dirs[: args.held]:
            sleepers.append(subprocess.Popen(["sleep", "3600"], cwd=d / "workspace", start_new_session=True))
        cluster.start()
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        cluster.kubectl("create", "namespace", NAMESPACE)
        cluster.create_node(NODE, ready=True)
        log = workdir / "agent.log"
        flags = [
            f"--node={NODE}",
            f"--root={workdir / 'root'}",
            f"--kubeconfig={cluster.kubeconfig}",
            "--namespace=default",
            "--metrics-port=0",
            "--scan-interval=10s",
            "--pressure-high=100",
            "--pressure-low=99",
            "--kube-qps=500",
            "--kube-burst=1000",
            *(f"--ignore-pid={pid}" for pid in uninspectable_pids()),
        ]
        with log.open("wb") as out:
            agent = subprocess.Popen(
                [sys.executable, "-m", "controller.cli.sandkeep", "agent", *flags],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        kube = Kube(load_config(cluster.kubeconfig), "sandkeep-bench", timeout=120)

        def adopted() -> list[dict[str, object]]:
            items = kube.list_sandboxes(NAMESPACE)
            return [o for o in items if c.FINALIZER in (o["metadata"].get("finalizers") or [])]  # type: ignore[index]

        started = time.monotonic()
        while len(adopted()) < args.sandboxes:
            if agent.poll() is not None:
                raise SystemExit(f"agent exited:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        print(f"adopted {args.sandboxes} sandboxes in {time.monotonic() - started:.0f}s (rate-limited at 500 qps)")
        found = re.search(r"metrics_port=(\d+)", log.read_text())
        assert found is not None
        url = f"http://127.0.0.1:{found.group(1)}/metrics"
        time.sleep(12)  # a full pass after adoption, so its scan is not counted below
        before = scans(url)
        objects = kube.list_sandboxes(NAMESPACE)
        began = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda o: kube.request("DELETE", f"{kube_path(o)}"), objects))
        free = dirs[args.held :]
        while any(d.exists() for d in free):
            if agent.poll() is not None:
                raise SystemExit(f"agent exited:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        took = time.monotonic() - began
        passes = scans(url) - before
        held = [d for d in dirs[: args.held] if d.exists()]
        print(f"/proc: {len(list(Path('/proc').glob('[0-9]*')))} processes")
        print(f"baseline: rm -rf of {args.sandboxes} trees + one /proc pass   {rm_rf:7.1f} s")
        print(
            f"sandkeep: deletes sent -> last free directory gone      {took:7.1f} s   ratio {took / rm_rf:.1f}x "
            f"({args.sandboxes - args.held} deleted)"
        )
        print(f"/proc passes for the wave: {passes:.0f} (a batch needs 1)")
        print(f"held: {len(held)} of {args.held} in-use sandboxes kept, as they must be")
        print(json.dumps({"seconds": took, "baseline": rm_rf, "scans": passes, "held": len(held)}))
        kube.close()
    finally:
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(10)
        for proc in sleepers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def kube_path(obj: dict[str, object]) -> str:
    from controller.api.kube import sandbox_path

    meta = obj["metadata"]
    assert isinstance(meta, dict)
    return sandbox_path(meta["namespace"], meta["name"])


if __name__ == "__main__":
    sys.exit(main())
