"""Benchmark of a mass expiry on one node: N sandboxes (default 1,000) due at the same instant (issue 31, item 4).

A real `sandkeep agent` owns a root of N small sandboxes on a machine running P other processes (default
2,000 `sleep`s, so /proc is as big as a busy node's); a few sandboxes are in use (a process with its cwd
inside). The agent adopts them (at 500 QPS, not measured), then runs again at its DEFAULT client limits
(`--kube-qps 20 --kube-burst 40`) beside a real `sandkeep controller`; every object's `retainUntil` is set
to one instant T, and at T the controller expires them all. During the wave the bench pins a few more
(`pin-for`), as a person would; a pin that landed before the object's DELETE (its answer shows no
deletionTimestamp) must keep it. Prints, beside baselines measured in the same run:
- the time from T to the last directory gone (and to the last finalizer removed), against `rm -rf` of as
  many identical trees plus one /proc pass for all of them (the least any safe deletion must do);
- every API request from T to the last finalizer removal, counted by kube-apiserver
  (`apiserver_request_total`) by verb, resource and subresource, per deleted sandbox (the bench's own
  pins and polls subtracted; Leases and watches listed apart: they do not grow with the wave);
- how many /proc passes the agent made for them (`sandkeep_inuse_scans_total`);
- that the held and the pinned sandboxes are still there, and nothing else is.

Numbers are printed, never asserted. Needs root and the built tools.

    .venv/bin/python hack/bench/mass_expiry.py [--sandboxes 1000] [--processes 2000] [--held 5] [--pins 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.cluster.events import AGGREGATE_WINDOW  # noqa: E402
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


# What each request of a wave is for; anything else is printed as "other".
PURPOSE = {
    "DELETE retainedsandboxes": "controller: the DELETE, preconditioned on uid + resourceVersion",
    "PATCH retainedsandboxes": "agent: the finalizer's removal, guarded by resourceVersion (and pins' settling)",
    "APPLY retainedsandboxes/status": "status: agent Deleting/Held, controller phase",
    "PATCH retainedsandboxes/status": "status (patch)",
    "GET retainedsandboxes": "a fresh read after a 409",
    "POST events": "Events (past 10 of a namespace in 10 s: one aggregated Event per window)",
    "PATCH events": "Events (a repeat counted on the first)",
    "LIST pods": "agent: the Pod list of an in-use check, one per batch",
}
APART = ("leases", "WATCH ", "nodes", " /api", " /openapi")  # renewals, watches, node reads, discovery


def wait(what: str, done: Any, timeout: float, agent: Any, log: Path, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if agent is not None and agent.poll() is not None:
            raise SystemExit(f"agent exited:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(every)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=2000, help="other processes on the machine (sleeps)")
    parser.add_argument("--held", type=int, default=5, help="sandboxes kept in use by a process inside")
    parser.add_argument("--pins", type=int, default=10, help="sandboxes pinned by a person during the wave")
    args = parser.parse_args()
    from controller.api.kube import Kube, load_config
    from hack.apimetrics import requests_by
    from hack.localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin

    load = os.getloadavg()
    print(f"load average: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    workdir = Path(tempfile.mkdtemp(prefix="sandkeep-mass-"))
    sleepers: list[subprocess.Popen[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []
    cluster = LocalCluster(workdir / "cluster", tools_bin(CLUSTER_TOOLS))
    log = workdir / "agent.log"
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
        common = [f"--kubeconfig={cluster.kubeconfig}", "--lease-namespace=default", "--metrics-port=0"]
        agent_flags = [
            f"--node={NODE}",
            f"--root={workdir / 'root'}",
            *common,
            "--scan-interval=10s",
            "--pressure-high=100",
            "--pressure-low=99",
            *(f"--ignore-pid={pid}" for pid in uninspectable_pids()),
        ]

        def start(role: str, flags: list[str], out: Path) -> subprocess.Popen[bytes]:
            with out.open("ab") as sink:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "controller.cli.sandkeep", role, *flags],
                    cwd=REPO,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            procs.append(proc)
            return proc

        kube = Kube(load_config(cluster.kubeconfig), "sandkeep-bench", timeout=120)

        def adopted() -> list[dict[str, Any]]:
            items = kube.list_sandboxes(NAMESPACE)
            return [o for o in items if c.FINALIZER in (o["metadata"].get("finalizers") or [])]

        # 1. adoption at 500 QPS (not measured), then the agent again at its default client limits
        first = start("agent", [*agent_flags, "--kube-qps=500", "--kube-burst=1000"], log)
        started = time.monotonic()
        wait("adoption", lambda: len(adopted()) >= args.sandboxes, 1800, first, log, every=1)
        print(f"adopted {args.sandboxes} sandboxes in {time.monotonic() - started:.0f}s (at 500 QPS)")
        first.send_signal(signal.SIGTERM)
        first.wait(60)
        log.write_text("")
        agent = start("agent", agent_flags, log)
        controller_log = workdir / "controller.log"
        controller = start("controller", common, controller_log)
        wait("the agent's metrics", lambda: "metrics_port=" in log.read_text(), 120, agent, log)
        wait("the controller's lease", lambda: "leader_elected" in controller_log.read_text(), 120, controller, log)
        found = re.search(r"metrics_port=(\d+)", log.read_text())
        assert found is not None
        url = f"http://127.0.0.1:{found.group(1)}/metrics"

        # 2. every object due at T: its retainUntil set (at the bench's own pace, before T)
        objects = adopted()
        margin = 20 + args.sandboxes // 25
        due = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=margin)
        stamp = due.isoformat().replace("+00:00", "Z")
        with ThreadPoolExecutor(32) as pool:
            list(
                pool.map(
                    lambda o: kube.request(
                        "PATCH",
                        kube_path(o),
                        body={"spec": {"retainUntil": stamp}},
                        content_type="application/merge-patch+json",
                    ),
                    objects,
                )
            )

        def planned() -> int:
            return sum(1 for o in kube.list_sandboxes(NAMESPACE) if (o.get("status") or {}).get("deadline") == stamp)

        while planned() < args.sandboxes and time.time() < due.timestamp() - 2:
            time.sleep(1)
        print(f"controller's deadlines written for {planned()} of {args.sandboxes} before T ({margin:.0f}s after)")
        time.sleep(max(0.0, due.timestamp() - 1 - time.time()))
        # a second early, so none of the wave's requests is missed
        before, scans0 = requests_by(cluster.metrics_text(), subresource=True), scans(url)
        time.sleep(max(0.0, due.timestamp() - time.time()))
        t0 = time.monotonic()

        # 3. the wave; a person pins a few meanwhile
        pinned_in_time: list[Path] = []
        pins = polls = 0  # the bench's own requests in the window, subtracted
        time.sleep(0.3)
        for o in random.Random(31).sample(objects, min(args.pins, len(objects) - args.held)):
            if o["metadata"]["name"] in {d.name for d in dirs[: args.held]}:
                continue
            body = {"metadata": {"annotations": {c.ANN_PIN_FOR: "1h"}}}
            pins += 1
            try:
                answer = kube.request("PATCH", kube_path(o), body=body, content_type="application/merge-patch+json")
            except Exception:  # gone already
                continue
            if not answer["metadata"].get("deletionTimestamp"):
                pinned_in_time.append(workdir / "root" / NAMESPACE / o["metadata"]["name"])
        kept = set(dirs[: args.held]) | set(pinned_in_time)
        free = [d for d in dirs if d not in kept]
        wait("the free directories to go", lambda: not any(d.exists() for d in free), 1800, agent, log)
        took = time.monotonic() - t0

        def released() -> bool:
            nonlocal polls
            polls += 1
            names = {o["metadata"]["name"] for o in kube.list_sandboxes(NAMESPACE)}
            return not any(d.name in names for d in free)

        wait("the finalizers' removal", released, 600, agent, log, every=1)
        finished = time.monotonic() - t0
        time.sleep(AGGREGATE_WINDOW + 1)  # the controller's last aggregated Event goes out at its window's end
        after = requests_by(cluster.metrics_text(), subresource=True)
        passes = scans(url) - scans0
        delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}
        delta["PATCH retainedsandboxes"] = delta.get("PATCH retainedsandboxes", 0) - pins
        delta["LIST retainedsandboxes"] = delta.get("LIST retainedsandboxes", 0) - polls
        delta = {k: v for k, v in delta.items() if v > 0}
        per = {k: v for k, v in delta.items() if not any(a in k for a in APART)}
        apart = {k: v for k, v in delta.items() if any(a in k for a in APART)}
        deleted = len(free)
        held = [d for d in dirs[: args.held] if d.exists()]
        pins_kept = [d for d in pinned_in_time if d.exists()]
        print(f"/proc: {len(list(Path('/proc').glob('[0-9]*')))} processes")
        print(f"baseline: rm -rf of {args.sandboxes} trees + one /proc pass   {rm_rf:7.1f} s")
        print(
            f"sandkeep: deadline -> last free directory gone          {took:7.1f} s   ratio {took / rm_rf:.1f}x "
            f"({deleted} deleted, agent at its default 20 QPS / burst 40)"
        )
        print(f"sandkeep: deadline -> last finalizer removed            {finished:7.1f} s")
        print("API requests from the deadline to the last finalizer removed, per deleted sandbox:")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {k:34s} {v:7.0f}  {v / deleted:5.2f}  {PURPOSE.get(k, 'other')}")
        total = sum(per.values())
        print(f"  {'total':34s} {total:7.0f}  {total / deleted:5.2f}")
        print("  apart (not per deletion): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(apart.items())))
        print(f"/proc passes for the wave: {passes:.0f} (a batch needs 1)")
        print(f"held: {len(held)} of {args.held} in-use sandboxes kept, as they must be")
        print(f"pinned during the wave: {len(pins_kept)} of {len(pinned_in_time)} pinned before their DELETE kept")
        result = {
            "seconds": took,
            "finalizers_seconds": finished,
            "baseline": rm_rf,
            "scans": passes,
            "held": len(held),
            "pinned": len(pinned_in_time),
            "pins_kept": len(pins_kept),
            "deleted": deleted,
            "requests": per,
            "requests_per_deletion": total / deleted,
        }
        if os.environ.get("MASS_EXPIRY_LOGS"):
            print(controller_log.read_text()[-6000:], log.read_text()[-8000:])
        print(json.dumps(result))
        kube.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
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
