"""Benchmark the controller at scale against the real local control plane (issue 4, item 3).

    python hack/bench/controller_scale.py                      # 10,000 sandboxes, 50 nodes, 20 namespaces
    python hack/bench/controller_scale.py --objects 60 --nodes 3 --namespaces 2 --spread 5 --quiet 3

Steps: create the sandboxes (retention 1h, nothing due), start `sandkeep controller` as a real process,
time until every sandbox has a status; read kube-apiserver's own `apiserver_request_total` before and
after a quiet window (write verbs on the sandkeep resources and Events; Lease renewals apart); then a
SandboxPolicy per namespace shortens the window so every deadline falls within the next `--spread`
seconds, and the expiry lag (deadline -> the DELETE seen on a watch, and the controller's own histogram)
is measured until all are deleted. Prints numbers and ratios against the targets; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.api.kube import Kube, KubeError, load_config, sandbox_path  # noqa: E402
from controller.rules import contracts as c  # noqa: E402
from controller.rules.durations import format_instant, parse_instant  # noqa: E402
from hack.apimetrics import settled_writes, writes_by_resource  # noqa: E402
from hack.bench.plane import percentile, rss_mib  # noqa: E402
from hack.localcluster import LocalCluster, tools_bin  # noqa: E402

TARGET_LAG_P99 = 2.0
TARGET_RSS_MIB = 200
TARGET_RSS_MIB_100K = 400  # issue 15: 100,000 sandboxes
TARGET_RSS_PER_OBJECT_KIB = 3.5
GROUP_LABEL = "tekton.dev/pipeline"  # what --group-size groups by (one of c.ORIGIN_LABELS)


WRITTEN = (c.SANDBOX_PLURAL, c.POLICY_PLURAL, "events")  # what the controller writes; Lease renewals are apart


def sandkeep_writes(by_resource: dict[str, float]) -> float:
    """Writes to what the controller writes (sandboxes, policies, Events)."""
    return sum(by_resource.get(r, 0.0) for r in WRITTEN)


def metric_sum(text: str, name: str, exclude: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if exclude and exclude in line:
                continue
            total += float(line.rpartition(" ")[2])
    return total


def histogram_quantile(text: str, name: str, q: float) -> float:
    """Prometheus' histogram_quantile over the exported buckets (linear within a bucket)."""
    buckets = []
    for line in text.splitlines():
        m = re.match(rf'{name}_bucket{{le="([^"]+)"}} (\S+)', line)
        if m:
            buckets.append((math.inf if m.group(1) == "+Inf" else float(m.group(1)), float(m.group(2))))
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)
        lower_bound, lower_count = bound, count
    return math.nan


class Watcher(threading.Thread):
    """Records when each sandbox's DELETED event arrives on a real watch (the lag's end, from outside)."""

    def __init__(self, kube: Kube, resource_version: str, namespaces: list[str]) -> None:
        super().__init__(daemon=True)
        self.kube = kube
        self.namespaces = set(namespaces)
        self.resource_version = resource_version
        self.deleted: dict[tuple[str, str], float] = {}
        self.stop = False

    def run(self) -> None:
        try:
            self._watch()
        except Exception as err:  # the cluster going away at the end of the run
            if not self.stop:
                print(f"watch failed: {err}", file=sys.stderr)

    def _watch(self) -> None:
        while not self.stop:
            query = {"watch": "true", "resourceVersion": self.resource_version, "timeoutSeconds": "30"}
            path = sandbox_path() + "?" + "&".join(f"{k}={v}" for k, v in query.items())
            _m, url, headers, _b, _p = self.kube.api.param_serialize("GET", path, auth_settings=["BearerToken"])
            response = self.kube.api.rest_client.pool_manager.request(
                "GET", url, headers=headers, preload_content=False, timeout=40
            )
            buffer = b""
            for chunk in response.stream(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    event = json.loads(line)
                    obj = event.get("object", {})
                    meta = obj.get("metadata", {})
                    if meta.get("resourceVersion"):
                        self.resource_version = meta["resourceVersion"]
                    if event.get("type") == "DELETED" and meta.get("namespace") in self.namespaces:
                        self.deleted[(meta["namespace"], meta["name"])] = time.time()
                if self.stop:
                    return


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def empty_rss_mib(cluster: LocalCluster, cmd: list[str], log_path: Path) -> float:
    """The peak RSS of the same controller watching a namespace with nothing in it: what N objects add to."""
    empty = f"bench-empty-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", empty)
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            [*cmd, f"--watch-namespace={empty}"], stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO
        )
    try:
        limit = time.monotonic() + 60
        while "leader_elected" not in log_path.read_text(errors="replace") and time.monotonic() < limit:
            time.sleep(0.2)
        time.sleep(3)
        return peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(20)
        cluster.kubectl("delete", "namespace", empty, "--wait=false", check=False)


def server_cost(cluster: LocalCluster) -> dict[str, float]:
    """The API server's and etcd's running totals: requests by verb, watch events sent, etcd's db size."""
    text = cluster.metrics_text()
    cost: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"apiserver_request_total\{(.*)\} (\S+)", line)
        if m and 'resource="retainedsandboxes"' in m.group(1):
            verb = re.search(r'verb="(\w+)"', m.group(1))
            if verb:
                cost[f"requests {verb.group(1)}"] = cost.get(f"requests {verb.group(1)}", 0.0) + float(m.group(2))
        m = re.match(r"apiserver_watch_events_total\{(.*)\} (\S+)", line)
        if m and 'resource="retainedsandboxes"' in m.group(1):
            cost["watch events sent"] = cost.get("watch events sent", 0.0) + float(m.group(2))
    etcd_url = getattr(cluster, "etcd_url", "")
    if etcd_url:
        with urllib.request.urlopen(f"{etcd_url}/metrics", timeout=10) as response:
            etcd = response.read().decode()
        cost["etcd db MiB"] = metric_sum(etcd, "etcd_mvcc_db_total_size_in_bytes") / 2**20
    for component in getattr(cluster, "components", []):
        if component.name in ("etcd", "kube-apiserver") and component.proc.poll() is None:
            cost[f"{component.name} RSS MiB"] = rss_mib(component.proc.pid)
    return cost


def run(args: argparse.Namespace, cluster: LocalCluster) -> int:
    kube = Kube(load_config(cluster.kubeconfig), "sandkeep-bench")
    run_id = secrets.token_hex(3)
    namespaces = [f"bench-{run_id}-{i:02d}" for i in range(args.namespaces)]
    nodes = [f"bench-{run_id}-node-{i:02d}" for i in range(args.nodes)]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    crds = (f"crd/{c.SANDBOX_PLURAL}.{c.GROUP}", f"crd/{c.POLICY_PLURAL}.{c.GROUP}")
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
    for ns in namespaces:
        cluster.kubectl("create", "namespace", ns)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: cluster.create_node(n, ready=True), nodes))

    # 1. the sandboxes, created before the controller starts; createdAt spread over `spread` seconds
    base = args.base = datetime.now(UTC).replace(microsecond=0)
    began = time.monotonic()

    def create(i: int) -> None:
        created = base + timedelta(seconds=args.spread * i / max(1, args.objects - 1))
        spec = {"nodeName": nodes[i % len(nodes)], "createdAt": format_instant(created), "jobId": f"job-{i}"}
        if args.group_size:  # runs of pipelines: each namespace's sandboxes in groups, half of them failed
            run = i // len(namespaces)  # the sandbox's place in its namespace (i itself is the namespace's parity)
            outcome = c.Outcome.FAILED if run % 2 else c.Outcome.SUCCEEDED
            pipeline = f"p-{run // args.group_size}"
            spec["origin"] = {"outcome": outcome, "labels": {GROUP_LABEL: pipeline}}
        body = {"metadata": {"name": f"sb-{i:05d}", "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY}}, "spec": spec}
        kube.create_sandbox(namespaces[i % len(namespaces)], body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(create, range(args.objects)))
    print(
        f"created {args.objects} sandboxes on {len(nodes)} nodes in {len(namespaces)} namespaces "
        f"in {time.monotonic() - began:.1f}s"
    )

    for ns in namespaces if args.group_size else ():  # history limits that hold every group: nothing released
        cluster.apply(policy(args, ns, {}))

    # 2. the controller, as a real process, watching the bench namespaces; first one with nothing to hold
    log_path = Path(tempfile.mkdtemp(prefix="sandkeep-bench-")) / "controller.log"
    flags = [f"--kubeconfig={cluster.kubeconfig}", f"--lease-namespace={namespaces[0]}", f"--workers={args.workers}"]
    cmd = [sys.executable, "-m", "controller.cli.sandkeep", "controller", *flags, "--metrics-port=0", "--retention=1h"]
    args.baseline_rss = empty_rss_mib(cluster, cmd, log_path.with_name("empty.log"))
    if args.per_namespace:  # one watch per namespace and resource, as `controller.watchNamespaces` makes it
        cmd += [f"--watch-namespace={ns}" for ns in namespaces]
    args.server_before = server_cost(cluster)
    with log_path.open("ab") as log_file:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        return measure(args, cluster, kube, proc, log_path, started, namespaces)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for ns in namespaces:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for start in range(0, len(nodes), 100):  # 500 at once took kubectl past its minute at 100,000 objects
            cluster.kubectl("delete", "node", *nodes[start : start + 100], "--wait=false", check=False, timeout=300)
        kube.close()


def measure(
    args: argparse.Namespace,
    cluster: LocalCluster,
    kube: Kube,
    proc: subprocess.Popen[bytes],
    log_path: Path,
    started: float,
    namespaces: list[str],
) -> int:
    def metrics() -> str:
        found = re.search(r"metrics=(http://\S+)", log_path.read_text(errors="replace"))
        if found is None:
            return ""
        with urllib.request.urlopen(found.group(1), timeout=10) as response:
            text: str = response.read().decode()
            return text

    def wait(what: str, done: Any, timeout: float) -> None:
        limit = time.monotonic() + timeout
        while not done():
            if proc.poll() is not None:
                raise SystemExit(f"controller exited:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > limit:
                raise SystemExit(f"timed out waiting for {what}\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    wait(
        "every sandbox to have a status",
        lambda: metric_sum(metrics(), c.M_SANDBOXES, exclude='phase="Unknown"') >= args.objects,
        timeout=args.timeout,
    )
    reconcile_all = time.monotonic() - started
    print(
        f"time to reconcile all {args.objects}: {reconcile_all:.1f}s (from process start, "
        f"{args.objects / reconcile_all:.0f} sandboxes/s)"
    )

    # 3. steady state: once the Events of the first pass are posted, nothing may be written
    settled_writes(cluster.metrics_text, WRITTEN, still_for=3.0, timeout=args.timeout)
    print(f"  Events of the first pass all posted {time.monotonic() - started:.1f}s after the start")
    before = writes_by_resource(cluster.metrics_text())
    time.sleep(args.quiet)
    after = writes_by_resource(cluster.metrics_text())
    delta = {r: after.get(r, 0) - before.get(r, 0) for r in set(after) | set(before)}
    quiet_writes = sandkeep_writes(delta)
    per_hour = quiet_writes * 3600 / args.quiet
    print(
        f"steady-state API writes per hour (sandboxes, policies, events): {per_hour:.0f} "
        f"over a {args.quiet:.0f}s window (target 0) -> {'OK' if quiet_writes == 0 else 'MISSED'}"
    )
    lease_rate = delta.get("leases", 0) * 3600 / args.quiet
    print(f"  leader Lease renewals per hour (inherent to leader election): {lease_rate:.0f}")

    # 4. expiry: a policy per namespace (of the first `--due-fraction` of them) moves every deadline there
    # into the next `spread` seconds
    due = namespaces[: max(1, round(len(namespaces) * args.due_fraction))]
    listing = kube.request("GET", sandbox_path(), query={"limit": "1"})
    watcher = Watcher(kube, listing["metadata"]["resourceVersion"], due)
    watcher.start()
    first = datetime.now(UTC) + timedelta(seconds=args.margin)
    retention = math.ceil((first - args.base).total_seconds())
    for ns in due:
        cluster.apply(policy(args, ns, {"retention": f"{retention}s"}))
    print(
        f"policies applied: retention {retention}s, deadlines spread over the next "
        f"{args.margin:.0f}..{args.margin + args.spread:.0f}s"
    )
    deadlines: dict[tuple[str, str], float] = {}
    for ns in due:
        for obj in kube.list_sandboxes(ns):
            created = parse_instant(obj["spec"]["createdAt"])
            deadline = created + timedelta(seconds=retention)  # type: ignore[operator]
            deadlines[(ns, obj["metadata"]["name"])] = deadline.timestamp()
    wait(
        "every due sandbox to be deleted",
        lambda: len(watcher.deleted) >= len(deadlines),
        timeout=args.margin + args.spread + args.timeout,
    )
    watcher.stop = True
    lags = [watcher.deleted[k] - deadlines[k] for k in deadlines if k in watcher.deleted]
    text = metrics()
    p50, p99 = percentile(lags, 0.5), percentile(lags, 0.99)
    h50, h99 = histogram_quantile(text, c.M_EXPIRY_LAG, 0.5), histogram_quantile(text, c.M_EXPIRY_LAG, 0.99)
    print(
        f"deleted {len(lags)}/{len(deadlines)} due ({len(due)} of {len(namespaces)} namespaces); "
        f"expiry lag (deadline -> DELETED on a watch) p50 {p50:.3f}s "
        f"p99 {p99:.3f}s max {max(lags):.3f}s (target p99 < {TARGET_LAG_P99}s -> "
        f"{'OK' if p99 < TARGET_LAG_P99 else 'MISSED'})"
    )
    print(f"  controller's own histogram (deadline -> DELETE request): p50 ~{h50:.3f}s p99 ~{h99:.3f}s")
    rss = peak_rss_mib(proc.pid)
    target = TARGET_RSS_MIB if args.objects <= 10_000 else TARGET_RSS_MIB_100K
    print(
        f"controller peak RSS: {rss:.0f} MiB (target < {target} MiB -> {'OK' if rss < target else 'MISSED'}); "
        f"the same controller with nothing to hold: {args.baseline_rss:.0f} MiB"
    )
    per_object = (rss - args.baseline_rss) * 1024 / args.objects
    print(
        f"rss_per_object_kib {per_object:.2f} (target <= {TARGET_RSS_PER_OBJECT_KIB} -> "
        f"{'OK' if per_object <= TARGET_RSS_PER_OBJECT_KIB else 'MISSED'})"
    )
    after = server_cost(cluster)
    print("API server and etcd over the run (retainedsandboxes; RSS and db size at the end):")
    for what in sorted(after):
        grown = after[what] - args.server_before.get(what, 0.0) if not what.endswith("MiB") else after[what]
        print(f"  {what}: {grown:.0f}")
    errors = metric_sum(text, c.M_RECONCILE_ERRORS)
    print(f"reconcile errors: {errors:.0f}; deletions requested: {metric_sum(text, c.M_DELETIONS_REQUESTED):.0f}")
    return 0


def policy(args: argparse.Namespace, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The bench's SandboxPolicy in `namespace`: `spec`, with history limits by pipeline under --group-size."""
    if args.group_size:
        limit = (args.group_size + 1) // 2  # each group's outcomes alternate: a limit its runs all fit in
        spec = {**spec, c.HISTORY_LIMITS: {"groupBy": GROUP_LABEL, "succeeded": limit, "failed": limit}}
    meta = {"name": "bench", "namespace": namespace}
    return {"apiVersion": c.API_VERSION, "kind": c.POLICY_KIND, "metadata": meta, "spec": spec}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--namespaces", type=int, default=20)
    parser.add_argument("--spread", type=float, default=180.0, help="seconds the deadlines are spread over")
    parser.add_argument("--margin", type=float, default=None, help="seconds before the first deadline")
    parser.add_argument(
        "--per-namespace",
        action="store_true",
        help="watch each bench namespace apart (--watch-namespace each) instead of the whole cluster (the default, "
        "but with --kubeconfig)",
    )
    parser.add_argument("--quiet", type=float, default=30.0, help="steady-state window in seconds")
    parser.add_argument(
        "--due-fraction", type=float, default=1.0, help="the share of namespaces whose sandboxes come due (0..1]"
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="give the sandboxes outcomes and pipelines, this many per pipeline in each namespace, under a policy "
        "with history limits that keep them all (issue 28, item 6)",
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--kubeconfig", help="use this running cluster (e.g. a test's) instead of starting one")
    args = parser.parse_args(argv)
    if args.margin is None:  # the policy change rewrites every status first: give it time before deadlines
        args.margin = max(5.0, args.objects * args.due_fraction / 100)
    if args.kubeconfig:
        args.per_namespace = True  # a shared cluster holds others' sandboxes too: watch only the bench's
        attached = _Attached(LocalCluster(tools_bin=tools_bin(("kubectl",))), Path(args.kubeconfig))
        return run(args, attached)  # type: ignore[arg-type]
    with LocalCluster() as cluster:
        print(f"local control plane ready in {cluster.startup_seconds:.1f}s")
        return run(args, cluster)


class _Attached:
    """A running cluster reached through its admin kubeconfig (what the tests hand over)."""

    def __init__(self, cluster: LocalCluster, kubeconfig: Path) -> None:
        self._cluster = cluster
        self.kubeconfig = kubeconfig

    def kubectl(self, *args: str, **kwargs: Any) -> Any:
        return self._cluster.kubectl(*args, kubeconfig=self.kubeconfig, **kwargs)

    def apply(self, manifest: Any, *args: str) -> str:
        items = manifest if isinstance(manifest, list) else [manifest]
        text = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        return str(self.kubectl("apply", "-f", "-", *args, input=text).stdout)

    def create_node(self, name: str, *, ready: bool = False) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        self.kubectl("create", "-f", "-", input=json.dumps(node))

    def metrics_text(self) -> str:
        return str(self.kubectl("get", "--raw", "/metrics").stdout)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KubeError as err:
        print(f"controller_scale: {err}", file=sys.stderr)
        sys.exit(1)
