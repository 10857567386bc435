"""Benchmark of the CSI node plugin (issue 27, item 6), against a real `sandkeep csi-node` process on its real
unix socket, publishing with real bind mounts on a temporary root; from one run, baselines measured beside:

- publish latency p50/p99/max with `--publishes` (50) publishes at once, each from its own client thread with
  its own channel, volume and target (`--waves` such waves), against the same number one at a time; the p99
  at once over the 100 ms target. Beside each wave: the plugin's own time per call (from its log), and two
  floors of the moment: as many no-op RPCs at once (NodeGetInfo: gRPC and the CPU) and as many records written
  at once (the disk). Then the same waves beside `--mounts` (1,000) other mounts, as on a node full of Pods;
- keep of a `--files` (100,000) file workspace against a 10-file one: NodeUnpublishVolume, then `Volumes.keep`
  (what the agent's pass calls, here in-process), `--rounds` rounds in alternating order; the ratio of the
  medians, target <= 2 (keep is a rename: the file count should not matter);
- a real `sandkeep agent` process's RSS with `--volumes` (200) live volumes (published, still mounted) on its
  root, against an idle agent on an empty root started beside it, both after `--passes` passes; target: at
  most 20 MiB more. Against the local control plane (hack/localcluster.py), or a running one (`--kubeconfig`).

Targets are printed, never asserted. Needs root (bind mounts) and the built tools; everything mounted is
unmounted and the work directory removed at the end.

    .venv/bin/python hack/bench/csi.py [--publishes 50] [--waves 4] [--mounts 1000] [--files 100000] [--rounds 5]
                                       [--volumes 200] [--passes 3] [--no-agent] [--kubeconfig FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "hack"))

import grpc  # noqa: E402
from localcluster import CLUSTER_TOOLS, LocalCluster, tools_bin  # noqa: E402
from processes import spawn  # noqa: E402

from controller.csi import server as csi_server  # noqa: E402
from controller.csi.proto import csi_pb2, csi_pb2_grpc  # noqa: E402
from controller.node.capture import Kept, State, Volumes, entry_name  # noqa: E402
from controller.node.inuse import uninspectable_pids  # noqa: E402
from controller.node.nofollow import unescape_mountinfo  # noqa: E402
from controller.node.store import Root, write_atomic  # noqa: E402
from controller.rules import contracts as c  # noqa: E402
from controller.rules.contracts import Outcome  # noqa: E402
from controller.rules.models import Origin  # noqa: E402
from hack.bench.plane import rss_mib  # noqa: E402

NAMESPACE = "bench"
PUBLISH_TARGET_MS = 100.0
KEEP_TARGET_RATIO = 2.0
RSS_TARGET_MIB = 20.0
SMALL_FILES = 10
FILES_PER_DIR = 1000
RPC_TIMEOUT = 120.0
T = TypeVar("T")
MS_BIND, MNT_DETACH = 0x1000, 2
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Vol:
    """One inline ephemeral volume as the kubelet would ask for it: its id, its Pod's uid, its target path."""

    volume_id: str
    pod_uid: str
    target: Path

    @classmethod
    def new(cls, kubelet: Path) -> Vol:
        uid = str(uuid.uuid4())
        target = kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / "workspace" / "mount"
        target.parent.mkdir(parents=True)  # the kubelet makes the volume's directory, the plugin its mount point
        return cls(f"csi-{secrets.token_hex(32)}", uid, target)

    @property
    def pod_name(self) -> str:
        return f"job-{self.pod_uid[:8]}"

    def publish_request(self) -> csi_pb2.NodePublishVolumeRequest:
        pod = {
            c.POD_INFO_NAMESPACE: NAMESPACE,
            c.POD_INFO_NAME: self.pod_name,
            c.POD_INFO_UID: self.pod_uid,
            c.POD_INFO_SERVICE_ACCOUNT: "default",
            c.POD_INFO_EPHEMERAL: "true",
        }
        mode = csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        capability = csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode)
        )
        return csi_pb2.NodePublishVolumeRequest(
            volume_id=self.volume_id, target_path=str(self.target), volume_capability=capability, volume_context=pod
        )

    def unpublish_request(self) -> csi_pb2.NodeUnpublishVolumeRequest:
        return csi_pb2.NodeUnpublishVolumeRequest(volume_id=self.volume_id, target_path=str(self.target))


# --- the plugin process and its clients ------------------------------------------------------------------


@dataclass(frozen=True)
class Bed:
    """A running plugin: its socket, the root it publishes on, the kubelet directory of the targets, its log."""

    endpoint: Path
    root: Path
    kubelet: Path
    log: Path

    def said(self, since: int, event: str) -> list[float]:
        """The `ms=` of every `event` line the plugin logged after byte `since` of its log: its own time for a call,
        from its request checked to its answer (what it spends beyond is gRPC's, and the wait for a worker)."""
        text = self.log.read_bytes()[since:].decode(errors="replace")
        return [float(ms) for ms in re.findall(rf" {event} .*? ms=(\d+)", text)]


@contextmanager
def plugin(workdir: Path, node: str) -> Iterator[Bed]:
    """`sandkeep csi-node` on a fresh root, on a short socket path (a unix socket's must fit in 107 bytes);
    stopped by pid (localcluster's `spawn`)."""
    sockets = Path(tempfile.mkdtemp(prefix="skcsi-", dir="/tmp"))
    bed = Bed(sockets / c.CSI_DRIVER / "csi.sock", workdir / "root", workdir / "kubelet", workdir / "csi-node.log")
    bed.root.mkdir(mode=0o700)
    command = [sys.executable, "-m", "controller.cli.sandkeep", "csi-node", f"--node={node}", f"--root={bed.root}"]
    command += [f"--endpoint={bed.endpoint}", f"--kubelet-dir={bed.kubelet}"]
    proc = spawn("csi-node", command, bed.log, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not bed.endpoint.is_socket():
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"csi-node did not start: {bed.log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield bed
    finally:
        proc.stop(timeout=30)
        shutil.rmtree(sockets, ignore_errors=True)


def node_stub(endpoint: Path) -> tuple[grpc.Channel, csi_pb2_grpc.NodeStub]:
    """A connected channel of its own (as each kubelet worker would have), and the Node service on it."""
    chan = grpc.insecure_channel(f"unix:{endpoint}")
    grpc.channel_ready_future(chan).result(timeout=60)
    return chan, csi_pb2_grpc.NodeStub(chan)


def timed(call: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[float, T]:
    """Milliseconds `call(*args, **kwargs)` took, and what it returned."""
    t0 = time.perf_counter()
    result = call(*args, **kwargs)
    return (time.perf_counter() - t0) * 1000, result


def at_once(endpoint: Path, calls: Sequence[Callable[[csi_pb2_grpc.NodeStub], object]]) -> list[float]:
    """Each call from its own thread and channel, all let go together; the milliseconds each took."""
    ready = threading.Barrier(len(calls))
    took: list[float] = [math.nan] * len(calls)
    failed: list[BaseException] = []

    def run(i: int) -> None:
        chan, stub = node_stub(endpoint)
        try:
            ready.wait(timeout=120)
            took[i] = timed(calls[i], stub)[0]
        except BaseException as err:
            failed.append(err)
            ready.abort()
        finally:
            chan.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return took


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def spread(values: Sequence[float]) -> str:
    return f"p50 {percentile(values, 0.5):6.1f} ms, p99 {percentile(values, 0.99):6.1f} ms, max {max(values):6.1f} ms"


def mounts_under(path: Path) -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = unescape_mountinfo(line.split()[4])
        if point == str(path) or point.startswith(f"{path}/"):
            points.append(point)
    return points


def unmount_under(path: Path) -> None:
    for point in sorted(mounts_under(path), key=len, reverse=True):  # the deepest first
        _libc.umount2(os.fsencode(point), MNT_DETACH)


def bind_mounts(under: Path, count: int) -> None:
    """`count` empty directories bind-mounted onto themselves: the mount table of a node whose other Pods have
    theirs (each has several: its token, its ConfigMaps, its containers' root filesystems)."""
    for i in range(count):
        d = under / str(i)
        d.mkdir(parents=True)
        if _libc.mount(os.fsencode(d), os.fsencode(d), None, ctypes.c_ulong(MS_BIND), None) != 0:
            raise OSError(ctypes.get_errno(), "mount --bind", str(d))


def discard_all(root: Path) -> None:
    volumes = Volumes(Root(root))
    for volume in list(volumes.records()):
        volumes.discard(volume.entry)


# --- 1. publish latency -------------------------------------------------------------------------------------


def measure_publish(bed: Bed, count: int, waves: int, mounts: int) -> dict[str, list[float]]:
    """`waves` waves of `count` publishes at once, and as many one at a time, alternating. Beside each wave at
    once, two floors of the moment: as many no-op RPCs at once (NodeGetInfo: gRPC and the machine's CPU, no
    disk) and as many records written at once. Then as many waves at once again beside `mounts` other mounts."""
    out: dict[str, list[float]] = defaultdict(list)
    chan, stub = node_stub(bed.endpoint)
    try:
        for wave in range(waves):
            for mode in ("at_once", "one_by_one") if wave % 2 == 0 else ("one_by_one", "at_once"):
                if mode == "at_once":
                    out["noop"] += at_once(bed.endpoint, [_node_info] * count)
                    _wave(bed, count, out, mode)
                    out["floor"].append(record_writes(bed.root.parent, count))
                else:
                    _wave(bed, count, out, mode, stub)
    finally:
        chan.close()
    others = bed.root.parent / "other-mounts"
    try:
        bind_mounts(others, mounts)
        for _ in range(waves if mounts else 0):
            _wave(bed, count, out, "beside")
    finally:
        unmount_under(others)
    return out


def _wave(
    bed: Bed, count: int, out: dict[str, list[float]], key: str, stub: csi_pb2_grpc.NodeStub | None = None
) -> None:
    """`count` publishes, at once (or one at a time through `stub`), then their unpublishes at once, each with the
    plugin's own time (its log); then the entries are discarded, so every wave starts alike."""
    vols = [Vol.new(bed.kubelet) for _ in range(count)]
    calls = [_publish(v) for v in vols]
    since = bed.log.stat().st_size
    out[key] += at_once(bed.endpoint, calls) if stub is None else [timed(f, stub)[0] for f in calls]
    out[f"{key}_in_plugin"] += bed.said(since, "volume_published")
    since = bed.log.stat().st_size
    out[f"{key}_unpublish"] += at_once(bed.endpoint, [_unpublish(v) for v in vols])
    out[f"{key}_unpublish_in_plugin"] += bed.said(since, "volume_unpublished")
    discard_all(bed.root)


def record_writes(workdir: Path, count: int) -> float:
    """The disk's floor under a wave: `count` records written as a publish writes its one (write, fsync, rename,
    fsync the directory), each in its own directory, at once in as many threads as the plugin serves RPCs in;
    the milliseconds until the last is done."""
    base = workdir / f"floor-{secrets.token_hex(4)}"
    dirs = [base / str(i) for i in range(count)]
    for d in dirs:
        d.mkdir(parents=True)
    fds = [os.open(d, os.O_RDONLY | os.O_DIRECTORY) for d in dirs]
    record = b"x" * 700  # a publish's record is about this long
    try:
        with ThreadPoolExecutor(csi_server.WORKERS) as pool:
            took, _ = timed(lambda: list(pool.map(lambda fd: write_atomic(fd, "record.json", record, mode=0o600), fds)))
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(base)
    return took


def _publish(v: Vol) -> Callable[[csi_pb2_grpc.NodeStub], object]:
    return lambda stub: stub.NodePublishVolume(v.publish_request(), timeout=RPC_TIMEOUT)


def _node_info(stub: csi_pb2_grpc.NodeStub) -> object:
    return stub.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=RPC_TIMEOUT)


def _unpublish(v: Vol) -> Callable[[csi_pb2_grpc.NodeStub], object]:
    return lambda stub: stub.NodeUnpublishVolume(v.unpublish_request(), timeout=RPC_TIMEOUT)


# --- 2. keep: unpublish + Volumes.keep, a large workspace against a small one --------------------------------


def build_pool(pool: Path, files: int) -> None:
    """`files` empty files, FILES_PER_DIR to a directory: the workspace's contents, moved in and out by rename."""
    for d in range(math.ceil(files / FILES_PER_DIR)):
        sub = pool / f"dir-{d:04d}"
        sub.mkdir(parents=True)
        for f in range(min(FILES_PER_DIR, files - d * FILES_PER_DIR)):
            (sub / f"file-{f:04d}.o").touch()


def move_children(src: Path, dst: Path) -> None:
    for child in os.listdir(src):
        os.rename(src / child, dst / child)


@dataclass
class Keeps:
    unpublish: list[float]
    keep: list[float]

    @property
    def total(self) -> list[float]:
        return [u + k for u, k in zip(self.unpublish, self.keep, strict=True)]


def measure_keep(bed: Bed, files: int, rounds: int) -> dict[int, Keeps]:
    """Each round, per size (the order alternating): publish, fill the workspace (its files moved in from a
    pool on the same filesystem: not timed), sync, then time the unpublish (gRPC) and the keep (in-process);
    the kept sandbox's files go back to the pool and the sandbox is removed."""
    pools = {n: bed.root.parent / "pools" / str(n) for n in (files, SMALL_FILES)}
    for n, pool in pools.items():
        build_pool(pool, n)
    volumes = Volumes(Root(bed.root))
    out = {n: Keeps([], []) for n in pools}
    chan, stub = node_stub(bed.endpoint)
    try:
        for r in range(rounds):
            for n in list(pools) if r % 2 == 0 else list(pools)[::-1]:
                v = Vol.new(bed.kubelet)
                stub.NodePublishVolume(v.publish_request(), timeout=RPC_TIMEOUT)
                entry = entry_name(v.volume_id)
                move_children(pools[n], volumes.path / entry / c.WORKSPACE_DIR)
                os.sync()
                out[n].unpublish.append(timed(stub.NodeUnpublishVolume, v.unpublish_request(), timeout=60)[0])
                origin = Origin(pod=v.pod_name, pod_uid=v.pod_uid, node="bench-node", outcome=Outcome.FAILED)
                took, result = timed(volumes.keep, entry, origin, "bench")
                out[n].keep.append(took)
                if not isinstance(result, Kept):
                    raise RuntimeError(f"keep of {n} files gave {result!r}, not Kept")
                sandbox = bed.root / result.namespace / result.name
                move_children(sandbox / c.WORKSPACE_DIR, pools[n])
                shutil.rmtree(sandbox)
    finally:
        chan.close()
    return out


# --- 3. the agent's memory with live volumes ----------------------------------------------------------------


class Agent:
    """`sandkeep agent` as a real process on `root` for `node`; its log in a file; its passes read from its
    own metrics (each full pass makes one /proc pass, `sandkeep_inuse_scans_total`)."""

    def __init__(self, node: str, root: Path, kubeconfig: Path, namespace: str, log: Path) -> None:
        flags = {
            "--node": node,
            "--root": str(root),
            "--kubeconfig": str(kubeconfig),
            "--lease-namespace": namespace,
            "--metrics-port": "0",
            "--scan-interval": "1s",
            "--pressure-high": "100",  # the root shares the machine's disk: no release for space
            "--pressure-low": "99",
        }
        args = [sys.executable, "-m", "controller.cli.sandkeep", "agent", *(f"{k}={v}" for k, v in flags.items())]
        args += [f"--ignore-pid={pid}" for pid in uninspectable_pids()]
        self.log = log
        self.component = spawn(f"agent {node}", args, log, cwd=REPO)
        self.proc = self.component.proc
        self.port: int | None = None

    def passes(self) -> int:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the agent exited: {self.log.read_text()[-2000:]}")
        if self.port is None:
            found = re.search(r"metrics_port=(\d+)", self.log.read_text())
            if found is None:
                return 0
            self.port = int(found.group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(int(float(x)) for x in re.findall(rf"^{c.M_INUSE_SCANS}\{{[^}}]*\}} (\S+)$", text, re.M))

    def stop(self) -> None:
        self.component.stop(timeout=30)


def measure_agent(bed: Bed, cluster: LocalCluster, kubeconfig: Path, count: int, passes: int) -> dict[str, float]:
    """Publish `count` volumes (left mounted), then start two agents at once, one on this root and one on an
    empty root; once each has made `passes` passes, sample both RSS five times, a second apart (the largest
    of each counts). Then check every volume is still published and mounted, and unpublish them."""

    def kubectl(*args: str, **kwargs: Any) -> None:
        cluster.kubectl(*args, kubeconfig=kubeconfig, **kwargs)

    tag = secrets.token_hex(3)
    namespace, nodes = f"csi-bench-{tag}", {"live": f"csi-bench-live-{tag}", "idle": f"csi-bench-idle-{tag}"}
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    kubectl("create", "namespace", namespace)
    for node in nodes.values():
        kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}))
    vols = [Vol.new(bed.kubelet) for _ in range(count)]
    chan, stub = node_stub(bed.endpoint)
    roots = {"live": bed.root, "idle": bed.root.parent / "idle-root"}
    roots["idle"].mkdir(mode=0o700)
    agents: dict[str, Agent] = {}
    try:
        for v in vols:
            stub.NodePublishVolume(v.publish_request(), timeout=RPC_TIMEOUT)
        for what in ("live", "idle"):
            agents[what] = Agent(nodes[what], roots[what], kubeconfig, namespace, bed.root.parent / f"agent-{what}.log")
        deadline = time.monotonic() + 60 + 10 * passes
        made = dict.fromkeys(agents, 0)
        while min(made.values()) < passes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agents made {made} passes of {passes} in time")
            time.sleep(0.5)
            made = {what: a.passes() for what, a in agents.items()}
        rss = {what: 0.0 for what in agents}
        for _ in range(5):
            for what, a in agents.items():
                rss[what] = max(rss[what], rss_mib(a.proc.pid))
            time.sleep(1)
        made = {what: a.passes() for what, a in agents.items()}
        records = [v.record for v in Volumes(Root(bed.root)).records()]
        published = sum(1 for r in records if r is not None and r.state is State.PUBLISHED)
        mounted = sum(1 for v in vols if mounts_under(v.target))
    finally:
        for a in agents.values():
            a.stop()
        for v in vols:
            stub.NodeUnpublishVolume(v.unpublish_request(), timeout=RPC_TIMEOUT)
        chan.close()
        discard_all(bed.root)
        kubectl("delete", "namespace", namespace, "--wait=false")
        kubectl("delete", "node", *nodes.values(), "--wait=false")
    return {
        "rss_live": rss["live"],
        "rss_idle": rss["idle"],
        "passes_live": made["live"],
        "passes_idle": made["idle"],
        "published": published,
        "mounted": mounted,
    }


# --- the run ------------------------------------------------------------------------------------------------


def report(
    publish: dict[str, list[float]], keeps: dict[int, Keeps], agent: dict[str, float] | None, n: int, mounts: int
) -> None:
    once, alone, beside = publish["at_once"], publish["one_by_one"], publish["beside"]
    p99 = percentile(once, 0.99)

    def row(label: str, key: str, note: str = "") -> None:
        print(f"{label:<48} {spread(publish[key])}{note}")

    own = "  the plugin's own time (its log)"
    row(f"publish, {n} at once ({len(once)} in all)", "at_once")
    row(own, "at_once_in_plugin")
    row(f"  floor: NodeGetInfo, {n} at once", "noop", " (gRPC and the CPU, no disk)")
    print(
        f"  floor: {n} records written at once in {csi_server.WORKERS} threads, 2 fsyncs each as a publish's: "
        f"median {statistics.median(publish['floor']):.1f} ms for all (the disk)"
    )
    row(f"publish, 1 at a time ({len(alone)} in all)", "one_by_one")
    row(own, "one_by_one_in_plugin")
    row(f"unpublish, {n} at once", "at_once_unpublish")
    row(own, "at_once_unpublish_in_plugin")
    if beside:
        row(f"publish, {n} at once beside {mounts:,} other mounts", "beside")
        row(own, "beside_in_plugin")
        row(f"unpublish, {n} at once beside {mounts:,} other mounts", "beside_unpublish")
    print(f"publish p99 at once / 1 at a time: {p99 / percentile(alone, 0.99):.2f}x")
    print(f"publish p99 at once / {PUBLISH_TARGET_MS:.0f} ms target: {p99 / PUBLISH_TARGET_MS:.2f} (target <= 1)")
    if beside:
        print(f"publish p99 at once beside {mounts:,} other mounts / without: {percentile(beside, 0.99) / p99:.2f}x")
    (large, big), (small, little) = sorted(keeps.items(), reverse=True)
    for files, k in ((large, big), (small, little)):
        print(
            f"keep of {files:,} files: median {statistics.median(k.total):.1f} ms (unpublish "
            f"{statistics.median(k.unpublish):.1f} ms + Volumes.keep {statistics.median(k.keep):.1f} ms), "
            f"max {max(k.total):.1f} ms over {len(k.total)} rounds"
        )
    ratio = statistics.median(big.total) / statistics.median(little.total)
    print(f"keep ratio {large:,} / {small:,} files: {ratio:.2f}x (target <= {KEEP_TARGET_RATIO:.0f}x)")
    if agent is not None:
        print(
            f"agent RSS: idle {agent['rss_idle']:.1f} MiB ({agent['passes_idle']:.0f} passes), "
            f"with {agent['count']:.0f} live volumes {agent['rss_live']:.1f} MiB ({agent['passes_live']:.0f} passes): "
            "difference "
            f"{agent['rss_live'] - agent['rss_idle']:+.1f} MiB (target <= {RSS_TARGET_MIB:.0f} MiB)"
        )
        print(
            f"live volumes after the agent's passes: {agent['published']:.0f}/{agent['count']:.0f} published, "
            f"{agent['mounted']:.0f}/{agent['count']:.0f} mounted"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--publishes", type=int, default=50, help="publishes at once (each its own thread)")
    parser.add_argument("--waves", type=int, default=4, help="waves of publishes at once (and one at a time)")
    parser.add_argument(
        "--mounts", type=int, default=1000, help="other mounts on the node for the last waves (0: no such waves)"
    )
    parser.add_argument("--files", type=int, default=100_000, help="files of the large workspace kept")
    parser.add_argument("--rounds", type=int, default=5, help="keeps of each size")
    parser.add_argument("--volumes", type=int, default=200, help="live volumes on the agent's root")
    parser.add_argument("--passes", type=int, default=3, help="agent passes before its RSS is read")
    parser.add_argument("--no-agent", action="store_true", help="skip the agent (no control plane needed)")
    parser.add_argument("--dir", help="make the work directory here (default: the system's temp directory)")
    parser.add_argument("--kubeconfig", help="use this running cluster (e.g. a test's) instead of starting one")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    workdir = Path(tempfile.mkdtemp(prefix="sandkeep-csi-bench-", dir=args.dir))
    agent = None
    try:
        with plugin(workdir, "bench-node") as bed:
            publish = measure_publish(bed, args.publishes, args.waves, args.mounts)
            keeps = measure_keep(bed, args.files, args.rounds)
            if not args.no_agent:
                if args.kubeconfig:
                    attached = LocalCluster(tools_bin=tools_bin(("kubectl",)))
                    agent = measure_agent(bed, attached, Path(args.kubeconfig), args.volumes, args.passes)
                else:
                    with LocalCluster(workdir / "cluster", tools_bin(CLUSTER_TOOLS)) as cluster:
                        agent = measure_agent(bed, cluster, cluster.kubeconfig, args.volumes, args.passes)
                agent["count"] = args.volumes
    finally:
        unmount_under(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
    report(publish, keeps, agent, args.publishes, args.mounts)
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
