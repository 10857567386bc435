"""Real nodes for the local control plane: containerd, runc and the kubelet, plus kube-scheduler.

Each node lives in its own PID, mount and network namespaces (made by `unshare`, led by
`hack/node/init.sh`), so everything it starts dies with it and nothing it mounts or configures is
seen by the host: containers, Pod volumes, the CNI bridge and the Pods' network namespaces all live
inside. Its /var/lib, /var/log and /run are the node directory's (under a temp dir). What crosses to
the host is one veth pair per node in TEST-NET-2, the host's ends enslaved to one host bridge
(`BRIDGE`) that carries the host's address 198.51.100.1/25; node i (1, 2, ...) is 198.51.100.(1+i) and
its Pods get the i-th /27 of 198.51.100.128/25, on a bridge inside the node, routed from the host (so
Prometheus can scrape them) and from the other nodes. The host also carries the `kubernetes` Service's
address (203.0.113.1, TEST-NET-3), where `socat` forwards to the API server on loopback, which is how
every kubelet and every Pod's in-cluster client reach it (no kube-proxy runs). Each kubelet's cgroups
live under a cgroup root of its node's own (`/sandkeep-node-<random>`), removed when it stops. One
kube-scheduler serves them all, and one set of nodes runs per machine at a time (a lock), since the
addresses are fixed.

    with LocalCluster(node_mode=True) as cluster, LocalNodes(cluster, count=3) as nodes:
        for node in nodes.nodes:
            node.import_image(archive)
        cluster.kubectl("get", "nodes")

`make node` runs this module (`python -m hack.localnode`, NODES=n for n nodes): a control plane with
Ready nodes, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from hack.localcluster import SERVICE_IP, ClusterError, LocalCluster, ToolsMissingError, tools_bin, tools_dir
from hack.nodeprep import CNI_PLUGINS, HERE, install_packages, pause_image
from hack.processes import Component, Lifecycle, signals_raise, spawn, tail

NODE_TOOLS = ("kubelet", "kube-scheduler")
# TEST-NET-2 (RFC 5737); not TEST-NET-1, which these machines' own network uses (the host is 192.0.2.2).
# The host and the nodes share 198.51.100.0/25 (node i at .1+i); the Pods get the upper half, a /27 each.
HOST_IP = "198.51.100.1"
NODES_NET = ipaddress.ip_network("198.51.100.0/25")
POD_CIDR = "198.51.100.128/25"
POD_SLICES = list(ipaddress.ip_network(POD_CIDR).subnets(new_prefix=27))
MAX_NODES = len(POD_SLICES)
NODE_IP = str(NODES_NET[2])  # the first node's
BRIDGE = "skn-bridge"  # the host's bridge for the nodes' links (one set of nodes per machine: a fixed name)
# Where the node's containerd pulls images from over plain HTTP (its `hosts.toml`): the host's end of the
# node's link, a fixed port; the bed serves a real registry there (hack/registry.py).
REGISTRY = f"{HOST_IP}:5000"
LOCK = Path("/run/lock/sandkeep-node.lock")


def ip(*args: str, check: bool = True) -> None:
    """`ip ARGS` on the host."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def node_name(index: int) -> str:
    """The index-th node's name (from 1): sandkeep-node, sandkeep-node-2, ..."""
    return "sandkeep-node" if index == 1 else f"sandkeep-node-{index}"


class LocalNode:
    """The index-th real Node (from 1) of a LocalNodes, joined to its started LocalCluster (in node_mode)."""

    def __init__(self, cluster: LocalCluster, index: int = 1) -> None:
        if not 1 <= index <= MAX_NODES:
            raise ClusterError(f"a local node's index is 1 to {MAX_NODES}, not {index}")
        self.cluster = cluster
        self.index = index
        self.name = node_name(index)
        self.ip = str(NODES_NET[1 + index])
        self.pod_cidr = str(POD_SLICES[index - 1])
        self.dir: Path | None = None
        self.sockets: Path | None = None
        self.init: Component | None = None
        self.init_pid: int | None = None
        self.cgroup_root = ""
        self.link = ""  # the host's end of its veth
        self.failed = False
        self._stop_lock = threading.Lock()

    @property
    def root(self) -> Path:
        """A directory on the node's disk for sandkeep's root (the chart's `agent.root`)."""
        return self._dir("sandkeep")

    @property
    def containerd_socket(self) -> Path:
        # A unix socket's path is limited to about 100 bytes, which a pytest temp dir can exceed: the
        # socket lives in a short directory of its own (on the host's /tmp, which the node shares).
        if self.sockets is None:
            raise ClusterError("the node is not started")
        return self.sockets / "containerd.sock"

    def _dir(self, name: str) -> Path:
        if self.dir is None:
            raise ClusterError("the node is not started")
        return self.dir / name

    # --- start (by LocalNodes, in two steps, so that the nodes come up side by side) -------------------
    def launch(self, bin_dir: Path, pause_ref: str) -> None:
        """Its directories, configuration and cgroups, its namespaces (init.sh starts containerd) and its link
        on the host's bridge. Spawns a process: call it on the main thread (its death signal is per thread)."""
        self.dir = Path(tempfile.mkdtemp(prefix="sandkeep-node-", dir=self.cluster.dir))
        self.cgroup_root = f"/{self.dir.name}"  # unique: named like the node's temp dir
        self.sockets = Path(tempfile.mkdtemp(prefix="skn-", dir="/tmp"))
        for sub in ("var-lib", "var-log", "cni", "sandkeep"):
            self._dir(sub).mkdir()
        self._write_config(bin_dir, pause_ref)
        self._make_cgroups()
        self._start_namespaces()
        self._connect_network()

    def join(self, pause_archive: Path, deadline: float) -> None:
        """Once its containerd runs: import the Pod sandbox image, then let its kubelet start."""
        self._wait(lambda: self._dir("containerd.ready").exists(), f"containerd of {self.name} to start", deadline)
        self.import_image(pause_archive)
        self._dir("kubelet.go").touch()

    def power_off(self) -> None:
        """Power the node off: its init killed, so at once everything in its PID namespace (kubelet, containerd,
        every container) and its mounts and network with the namespaces. Its directory (its disk, containerd's
        state) stays for `power_on`; the Node object stays as the kubelet left it."""
        with self._stop_lock:
            if self.init is None or self.init_pid is None:
                raise ClusterError(f"{self.name} is not running")
            if self.init.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.init_pid, signal.SIGKILL)  # still unshare's unreaped child: the pid is its
            self.init.stop()
            self.init = self.init_pid = None
            self._disconnect()

    def power_on(self, pause_archive: Path, deadline: float) -> None:
        """Boot a powered-off node again on the same directory (a reboot: /run is empty, /var/lib as it was);
        returns once its kubelet has been told to start. LocalNodes.power_on waits for the Node."""
        for stale in ("containerd.ready", "kubelet.go", "kubelet.pid", "kubelet.paused"):
            self._dir(stale).unlink(missing_ok=True)
        if self.sockets is not None:
            for entry in self.sockets.iterdir():  # containerd's socket file outlives its process
                entry.unlink()
        self._start_namespaces()
        self._connect_network()
        self.join(pause_archive, deadline)

    def route_to(self, other: LocalNode) -> None:
        """Its Pods reach `other`'s over the bridge (the host does not forward)."""
        self.in_node("ip", "route", "add", other.pod_cidr, "via", other.ip)

    def _write_config(self, bin_dir: Path, pause_ref: str) -> None:
        d = self._dir
        pki = self.cluster.ca_file.parent
        kubeconfig = self.cluster.client_kubeconfig(
            self.name, f"/O=system:nodes/CN=system:node:{self.name}", d("kubelet.kubeconfig"), f"https://{SERVICE_IP}"
        )
        d("containerd.toml").write_text(
            f"""version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.containerd_socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_ref}"
  # Without CAP_SYS_RESOURCE (these machines' VMs) a container may not lower its oom_score_adj below
  # its parent's: without this every sandbox fails with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_PLUGINS}"
    conf_dir = "{d("cni")}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{d("certs.d")}"
"""
        )
        # containerd's documented configuration of a plain-HTTP registry: a directory named host:port holding
        # hosts.toml (https://github.com/containerd/containerd/blob/main/docs/hosts.md).
        hosts = d("certs.d") / REGISTRY
        hosts.mkdir(parents=True)
        (hosts / "hosts.toml").write_text(
            f"""server = "http://{REGISTRY}"

[host."http://{REGISTRY}"]
  capabilities = ["pull", "resolve"]
"""
        )
        bridge = {
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": True,
            "ipMasq": False,  # the host routes the Pod range back to the node: no NAT, no iptables
            "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]},
        }
        conflist = {"cniVersion": "0.4.0", "name": "sandkeep-node", "plugins": [bridge]}
        d("cni/10-sandkeep.conflist").write_text(json.dumps(conflist, indent=2))
        d("resolv.conf").write_text("")  # Pods resolve nothing: no DNS server here, and no name is needed
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.ip,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            # These machines' kernels run cgroup v1 (hybrid); the kubelet refuses it unless told.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failSwapOn": False,
            "makeIPTablesUtilChains": False,
            "resolvConf": str(d("resolv.conf")),
            # A shared build machine's disk: evict only when it is truly full, never collect the images
            # imported by hand (they cannot be pulled back).
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "4s",
        }
        d("kubelet.yaml").write_text(json.dumps(config, indent=2))
        command = [
            str(bin_dir / "kubelet"),
            f"--config={d('kubelet.yaml')}",
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.ip}",
            "--v=1",
        ]
        d("kubelet.cmd").write_text("\n".join(command) + "\n")

    def _start_namespaces(self) -> None:
        namespaces = ["--pid", "--mount", "--net", "--fork", "--mount-proc", "--propagation=private"]
        address = f"{self.ip}/{NODES_NET.prefixlen}"
        init = ["bash", str(HERE / "init.sh"), str(self.dir), str(self.sockets), address, HOST_IP]
        component = spawn("init", ["unshare", *namespaces, "--kill-child=SIGTERM", "--", *init], self._dir("init.log"))
        self.init = component
        children = Path(f"/proc/{self.init.proc.pid}/task/{self.init.proc.pid}/children")
        self._wait(lambda: bool(children.read_text().split()), "the node's init process", time.monotonic() + 10)
        self.init_pid = int(children.read_text().split()[0])

    def _connect_network(self) -> None:
        self.link = link = f"skn{self.init_pid}"[:15]
        ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", str(self.init_pid))
        ip("link", "set", link, "master", BRIDGE)
        ip("link", "set", link, "up")
        ip("route", "replace", self.pod_cidr, "via", self.ip, "dev", BRIDGE)  # replace: also on power_on

    def _disconnect(self) -> None:
        """Delete the node's veth (both ends) once its processes are gone. A network namespace whose last process
        died lingers while the kernel closes its orphaned TCP connections (a minute or more), and its veth with
        it: deleted here, nothing of the node stays on the host meanwhile."""
        if self.link:
            ip("link", "del", self.link, check=False)
            self.link = ""

    def _wait(self, ready: Callable[[], bool], what: str, deadline: float) -> None:
        while True:
            if self.init is not None and (code := self.init.proc.poll()) is not None:
                raise ClusterError(f"the node exited ({code}) while waiting for {what}\n{self.logs()}")
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        node = self.cluster.kubectl_json("get", "node", self.name)
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", [])
        )
        return ready and not node.get("spec", {}).get("taints")

    # --- using it -------------------------------------------------------------------------------------
    def import_image(self, archive: Path | str) -> str:
        """`ctr images import` an OCI or docker archive into the node's containerd (namespace k8s.io)."""
        result = subprocess.run(
            ["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", "images", "import", str(archive)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise ClusterError(f"ctr images import {archive} failed: {result.stderr.strip()}")
        return result.stdout

    def stop_kubelet(self, timeout: float = 60.0) -> None:
        """Stop the kubelet as an operator would (`systemctl stop kubelet`): the node, containerd and the running
        containers stay. It starts again with `start_kubelet`."""
        (self._dir("kubelet.paused")).touch()
        pid = self._dir("kubelet.pid").read_text().strip()  # in the node's PID namespace: signalled from inside
        self.in_node("kill", "-TERM", pid, check=False)
        gone = lambda: self.in_node("kill", "-0", pid, check=False).returncode != 0  # noqa: E731
        self._wait(gone, "the kubelet to stop", time.monotonic() + timeout)

    def start_kubelet(self, timeout: float = 120.0) -> None:
        """Start the stopped kubelet again (the node's init restarts it); return once it renewed the node's
        Lease (the Node may still read Ready from before: a short stop is within the node monitor's grace)."""
        stopped = self._dir("kubelet.pid").read_text().strip()
        since = datetime.now(UTC)
        self._dir("kubelet.paused").unlink(missing_ok=True)
        deadline = time.monotonic() + timeout
        self._wait(lambda: self._dir("kubelet.pid").read_text().strip() != stopped, "the kubelet to start", deadline)

        def renewed() -> bool:
            lease = self.cluster.kubectl_json("get", "lease", "-n", "kube-node-lease", self.name)
            return datetime.fromisoformat(lease["spec"]["renewTime"]) > since

        self._wait(renewed, f"the kubelet of {self.name} to renew its Lease", deadline)
        self._wait(self._ready, f"Node {self.name} to be Ready", deadline)

    def in_node(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command in the node's namespaces (as a process of the node, outside any container)."""
        if self.init_pid is None:
            raise ClusterError("the node is not started")
        return subprocess.run(
            ["nsenter", f"--target={self.init_pid}", "--pid", "--mount", "--net", "--", *command],
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def logs(self, lines: int = 40) -> str:
        if self.dir is None:
            return "(node not started: no logs)"
        names = ["init", "containerd", "kubelet"]
        return "\n".join(
            f"----- {n} ({self.dir / f'{n}.log'}), last {lines} lines -----\n{tail(self.dir / f'{n}.log', lines)}"
            for n in names
        )

    # --- stop -----------------------------------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node (kubelet, then containerd; anything left in its PID namespace is killed with it),
        remove its cgroups and its directory. Safe to call twice."""
        with self._stop_lock:
            if self.init is not None:
                # unshare ignores SIGTERM while it waits: signal the node's init, by its host pid, which
                # is still its child until unshare has been reaped (so the pid cannot have been reused).
                if self.init.proc.poll() is None and self.init_pid is not None:
                    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL of init ends the PID namespace
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(self.init_pid, sig)
                        try:
                            self.init.proc.wait(timeout)
                            break
                        except subprocess.TimeoutExpired:
                            continue
                self.init.stop(timeout)  # what is left of unshare, by its process group; closes the log
                self.init = None
            self._disconnect()
            if self.cgroup_root:
                self._remove_cgroups()
            if self.dir is not None and self.dir.exists():
                if self.failed and os.environ.get("SANDKEEP_KEEP_CLUSTER_DIR"):
                    print(f"localnode: kept {self.dir}", file=sys.stderr)
                else:
                    shutil.rmtree(self.dir, ignore_errors=True)
            if self.sockets is not None:
                shutil.rmtree(self.sockets, ignore_errors=True)
                self.sockets = None

    def _cgroup_dirs(self) -> list[Path]:
        return [h / self.cgroup_root.lstrip("/") for h in sorted(Path("/sys/fs/cgroup").iterdir()) if h.is_dir()]

    def _make_cgroups(self) -> None:
        """The kubelet wants its cgroup root to exist in every hierarchy; a new cpuset starts empty."""
        for path in self._cgroup_dirs():
            path.mkdir()
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (path / name).exists():
                    (path / name).write_text((path.parent / name).read_text())

    def _remove_cgroups(self, timeout: float = 20.0) -> None:
        """rmdir the node's cgroup tree in every hierarchy, deepest first; the processes in it are gone,
        but the kernel may take a moment to let go of an exited task's cgroup."""
        deadline = time.monotonic() + timeout
        tops = self._cgroup_dirs()
        while True:
            left = []
            for top in tops:
                if not top.is_dir():
                    continue
                for path in sorted((p for p, _, _ in os.walk(top)), key=len, reverse=True):
                    with contextlib.suppress(FileNotFoundError):
                        try:
                            os.rmdir(path)
                        except OSError:
                            left.append(path)
            if not left:
                return
            if time.monotonic() > deadline:
                print(f"localnode: cgroups left behind: {left}", file=sys.stderr)
                return
            time.sleep(0.2)


class LocalNodes(Lifecycle):
    """`count` real nodes joined to a started LocalCluster (in node_mode), with what they share: the host's
    bridge and the machine's lock, the forwarder to the API server and one kube-scheduler."""

    def __init__(self, cluster: LocalCluster, count: int = 1, tools: Path | None = None) -> None:
        if not cluster.node_mode:
            raise ClusterError("a real node needs LocalCluster(node_mode=True): ServiceAccount admission and more")
        if not 1 <= count <= MAX_NODES:
            raise ClusterError(f"1 to {MAX_NODES} local nodes, not {count}")
        self.cluster = cluster
        self.nodes = [LocalNode(cluster, i) for i in range(1, count + 1)]
        self._tools = tools
        self.components: list[Component] = []
        self._lock_file: IO[bytes] | None = None
        self._bridge = False
        self._pause_archive = Path()

    def start(self, timeout: float = 180.0) -> None:
        """Start the nodes side by side and kube-scheduler; return once every Node is Ready and schedulable."""
        install_packages()
        bin_dir = self._tools or tools_bin(NODE_TOOLS)
        self._lock_file = LOCK.open("wb")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise ClusterError(f"other local nodes run on this machine (they hold {LOCK})") from None
        deadline = time.monotonic() + timeout
        try:
            archive, pause_ref = pause_image(tools_dir().parent / "node")
            self._pause_archive = archive
            self._make_bridge()
            self._spawn("socat", ["socat", f"TCP-LISTEN:443,bind={SERVICE_IP},reuseaddr,fork", self._api_target()])
            for node in self.nodes:
                node.launch(bin_dir, pause_ref)
            for node in self.nodes:
                node.join(archive, deadline)
                for other in self.nodes:
                    if other is not node:
                        node.route_to(other)
            command = [f"--kubeconfig={self.cluster.kubeconfig}", "--leader-elect=false", "--secure-port=0", "--v=1"]
            self._spawn("kube-scheduler", [str(bin_dir / "kube-scheduler"), *command])
            for node in self.nodes:
                node._wait(node._ready, f"Node {node.name} to be Ready and untainted", deadline)
        except BaseException:
            self.failed = True
            self.stop()
            raise

    def power_on(self, node: LocalNode, timeout: float = 120.0) -> None:
        """Boot a node `power_off` stopped; return once its Node is Ready again (registered anew if deleted)."""
        deadline = time.monotonic() + timeout
        node.power_on(self._pause_archive, deadline)
        for other in self.nodes:
            if other is not node:
                node.route_to(other)
        node._wait(node._ready, f"Node {node.name} to be Ready again", deadline)

    def _make_bridge(self) -> None:
        # Under the lock, a bridge of this name is a crashed run's: it goes (its veths went with their nodes).
        ip("link", "del", BRIDGE, check=False)
        ip("link", "add", BRIDGE, "type", "bridge")
        self._bridge = True
        ip("addr", "add", f"{HOST_IP}/{NODES_NET.prefixlen}", "dev", BRIDGE)
        ip("addr", "add", f"{SERVICE_IP}/32", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")

    def _api_target(self) -> str:
        host, _, port = self.cluster.server.removeprefix("https://").rpartition(":")
        return f"TCP:{host}:{port}"

    def _spawn(self, name: str, command: list[str]) -> None:
        if self.cluster.dir is None:
            raise ClusterError("the cluster is not started")
        self.components.append(spawn(name, command, self.cluster.dir / f"{name}.log"))

    def logs(self, lines: int = 40) -> str:
        ours = "\n".join(
            f"----- {c.name} ({c.log}), last {lines} lines -----\n{tail(c.log, lines)}" for c in self.components
        )
        return "\n".join([*(n.logs(lines) for n in self.nodes), ours])

    def stop(self) -> None:
        """Stop the nodes, kube-scheduler and the forwarder, remove the bridge, release the lock. Safe to call
        twice."""
        for component in reversed(self.components):
            component.stop()
        self.components.clear()
        for node in self.nodes:
            node.failed = node.failed or self.failed
            node.stop()
        if self._bridge:
            ip("link", "del", BRIDGE, check=False)
            self._bridge = False
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


def main(argv: Sequence[str] | None = None) -> int:
    """`make node`: a control plane with real, Ready nodes until Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workdir", type=Path, help="parent of the cluster's temp dir (default: system temp)")
    parser.add_argument("--nodes", type=int, default=1, help=f"how many nodes (1 to {MAX_NODES}; default 1)")
    parser.add_argument("--image", action="append", default=[], help="an image archive to import (repeatable)")
    args = parser.parse_args(argv)
    try:
        tools_bin(NODE_TOOLS)
    except ToolsMissingError as e:
        print(f"localnode: {e}", file=sys.stderr)
        return 2
    with signals_raise():
        try:
            began = time.monotonic()
            with LocalCluster(args.workdir, node_mode=True) as cluster, LocalNodes(cluster, args.nodes) as nodes:
                for node in nodes.nodes:
                    for archive in args.image:
                        node.import_image(archive)
                names = ", ".join(n.name for n in nodes.nodes)
                print(f"# control plane and nodes {names} Ready in {time.monotonic() - began:.1f}s")
                for node in nodes.nodes:
                    print(f"# {node.name}: {node.ip}, Pods {node.pod_cidr}, dir {node.dir}, sandkeep root {node.root}")
                print(f"export KUBECONFIG={cluster.kubeconfig}")
                print(f'export PATH="{cluster.bin}:$PATH"')
                print("# Ctrl-C stops the nodes and the control plane and removes everything.", flush=True)
                while all(n.init is not None and n.init.proc.poll() is None for n in nodes.nodes):
                    time.sleep(0.5)
                nodes.failed = True
                print(f"localnode: a node exited\n{nodes.logs()}", file=sys.stderr)
                return 1
        except KeyboardInterrupt:
            print("\nlocalnode: stopped", file=sys.stderr)
            return 130
        except ClusterError as e:
            print(f"localnode: {e}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
