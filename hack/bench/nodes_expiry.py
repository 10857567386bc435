"""Benchmark of a mass expiry across real nodes (issue 30, item 3): N sandboxes on each of K real nodes
(default 1,000 on 3) due at the same instant, P of them (default 300) pinned with `kubectl annotate` just
before; the chart installed as a user installs it, the agents at their default client limits.

The bed is the end-to-end one (tests/bed/e2e_bed.py, `LocalBed(count=K)`): real kubelets, containerd, the
chart from a registry. Jobs on each node write and retain the sandboxes (`sandkeep retain`), the agents adopt
them, then every object's `retainUntil` is set to one instant T (as hack/bench/mass_expiry.py does) and the
pins land before T. Prints:
- per node, the time from T to its last expired directory gone, and the rate (sandboxes a second);
- the API writes per deleted sandbox from T to the last finalizer removed, by who, verb and resource, read
  from the API server's audit log (every write of the agents and the controller, whichever Pod made it);
- that no pinned sandbox is gone and every other one is (the one thing that makes it exit 1).

Numbers are printed, never asserted. Needs root, the built tools and the image (`make tools image`).

    .venv/bin/python hack/bench/nodes_expiry.py [--nodes 3] [--per-node 1000] [--pins 300]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.api.kube import Kube, load_config, sandbox_path  # noqa: E402
from controller.rules import contracts as c  # noqa: E402
from tests.bed import audit  # noqa: E402
from tests.bed.e2e_bed import SYSTEM_NS, LocalBed, started  # noqa: E402

NS = "wave"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--per-node", type=int, default=1000)
    parser.add_argument("--pins", type=int, default=300, help="sandboxes pinned with kubectl before the deadline")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    bed = LocalBed(Path(tempfile.mkdtemp(prefix="sandkeep-nodes-expiry-")), count=args.nodes)
    with started(bed, NS):
        nodes = bed.nodes
        names = {on.name: [f"run-{i}-{j:05d}" for j in range(args.per_node)] for i, on in enumerate(nodes)}
        began = time.monotonic()
        for i, on in enumerate(nodes):
            bed.retain_many(NS, on, f"retain-{i}", names[on.name], "3d", wait=False)
        for i in range(len(nodes)):
            bed.wait_job(NS, f"retain-{i}", timeout=1800)
        total = args.nodes * args.per_node
        kube = Kube(load_config(str(bed.kubeconfig)), "sandkeep-bench", timeout=120)

        def adopted() -> list[dict[str, Any]]:
            items = kube.list_sandboxes(NS)
            return [o for o in items if c.FINALIZER in (o["metadata"].get("finalizers") or [])]

        while len(adopted()) < total:
            time.sleep(2)
        print(f"{total} sandboxes retained and adopted on {args.nodes} nodes in {time.monotonic() - began:.0f} s")

        # Every object due at T; the pins land before T, with kubectl, ten objects a command.
        due = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=30 + total // 50)
        until = due.isoformat().replace("+00:00", "Z")
        with ThreadPoolExecutor(16) as pool:
            body = {"spec": {"retainUntil": until}}
            patch = "application/merge-patch+json"
            list(
                pool.map(
                    lambda n: kube.request("PATCH", sandbox_path(NS, n), body=body, content_type=patch),
                    [n for ns in names.values() for n in ns],
                )
            )
        everything = [n for ns in names.values() for n in ns]
        pinned = set(random.Random(30).sample(everything, args.pins))
        ordered = sorted(pinned)
        for start in range(0, len(ordered), 10):
            bed.kubectl("annotate", *(f"rsb/{n}" for n in ordered[start : start + 10]), "-n", NS, f"{c.ANN_PIN_FOR}=2h")
        lead = (due - datetime.now(UTC)).total_seconds()
        print(f"every retainUntil set to {until}; {args.pins} pinned with kubectl, the last {lead:.0f} s before it")
        if lead <= 0:
            print("the pins did not all land before the deadline: raise the margin")
            return 1
        time.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()))
        t0 = time.monotonic()

        # Per node: the time its last expired directory is gone.
        remaining = {on.name: sum(1 for n in names[on.name] if n not in pinned) for on in nodes}
        keep = {on.name: len(names[on.name]) - remaining[on.name] for on in nodes}
        drained: dict[str, float] = {}
        while len(drained) < len(nodes) and time.monotonic() - t0 < 1800:
            for on in nodes:
                if on.name in drained:
                    continue
                listed = bed.on(on, f"ls '{bed.root / NS}' | wc -l").stdout.strip()
                if int(listed or 0) <= keep[on.name]:
                    drained[on.name] = time.monotonic() - t0
            time.sleep(0.5)
        while any(o["metadata"]["name"] not in pinned for o in kube.list_sandboxes(NS)):
            time.sleep(1)
        released = time.monotonic() - t0
        time.sleep(12)  # the controller's last aggregated Event goes out at its window's end

        # What the API server says each component wrote from T on.
        writes = [
            w
            for w in audit.writes(bed.cluster.audit_log, audit.stamp(due))
            if w.user.startswith("system:serviceaccount:")
        ]
        deleted = audit.deleted(bed.cluster.audit_log, NS, audit.stamp(due))
        by: Counter[str] = Counter()
        for w in writes:
            who = w.user.rpartition(":")[2].removeprefix("sandkeep-")
            by[f"{who:10s} {w.verb.upper():6s} {w.resource}{'/' + w.subresource if w.subresource else ''}"] += 1
        apart = {k: v for k, v in by.items() if "leases" in k}
        per = {k: v for k, v in by.items() if k not in apart}
        expired = total - args.pins

        print(f"deadline -> each node's last expired directory gone ({expired // args.nodes} or so a node):")
        for on in nodes:
            took = drained.get(on.name)
            rate = f"{remaining[on.name] / took:6.1f} sandboxes/s" if took else "not drained in 30 min"
            print(f"  {on.name:18s} {took or 0:7.1f} s  {rate}")
        print(f"deadline -> last finalizer removed: {released:.1f} s ({expired / released:.1f} sandboxes/s overall)")
        print("API writes from the deadline on, per deleted sandbox (the audit log):")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {k:48s} {v:6d}  {v / expired:5.2f}")
        print(f"  {'total':48s} {sum(per.values()):6d}  {sum(per.values()) / expired:5.2f}")
        print("  apart (Lease renewals, not per deletion): " + ", ".join(f"{k.strip()} {v}" for k, v in apart.items()))

        objects = {o["metadata"]["name"]: o for o in kube.list_sandboxes(NS)}
        on_disk = {n for on in nodes for n in bed.on(on, f"ls '{bed.root / NS}'").stdout.split()}
        pins_kept = {n for n in pinned if n in objects and n in on_disk}
        gone = {n for n in everything if n not in pinned and n not in objects and n not in on_disk}
        once = sum(1 for n in gone if deleted[n] == 1)
        print(f"pinned: {len(pins_kept)} of {args.pins} kept (object and directory)")
        print(f"expired: {len(gone)} of {expired} gone, {once} of them by exactly one finalizer removal")
        agents = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"]
        restarts = sum(s["restartCount"] for p in agents for s in p["status"].get("containerStatuses", []))
        print(f"agent container restarts during the bench: {restarts}")
        result = {
            "nodes": args.nodes,
            "per_node": args.per_node,
            "seconds_by_node": drained,
            "rate_by_node": {n: remaining[n] / s for n, s in drained.items()},
            "finalizers_seconds": released,
            "writes_per_deletion": sum(per.values()) / expired,
            "pins_kept": len(pins_kept),
            "gone": len(gone),
            "deleted_once": once,
        }
        print(json.dumps(result))
        kube.close()
        return 0 if len(pins_kept) == args.pins and len(gone) == expired == once else 1


if __name__ == "__main__":
    sys.exit(main())
