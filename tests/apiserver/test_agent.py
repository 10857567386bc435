"""The node agent deleting, against the real local control plane, real directories, real processes and signals.

Two simulated nodes with separate roots; agents run as real `sandkeep agent` processes (stopped by
pid), or in-process where a test needs the kill seam. Mostly no controller runs: deleting an object is
the delete request (`kubectl delete --wait=false`); where expiry is the point, a real `sandkeep
controller` makes that request. What holds a deletion (a process, an open file, orphans, a Pod's hostPath,
a survivor) is here; adoption and quarantine are in test_agent_adoption.py, stuck tombstones and crashes in
test_agent_recovery.py, hostile input, the lock and the probes in test_agent_trust.py. The bed is
tests/bed/agentkit.py, its fixtures (`crd`, `nodes`, `agents`, `procs`) in this folder's conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from controller import agent as agent_mod
from controller.api import kube
from controller.node import orphans
from controller.observe import metrics
from controller.rules import contracts as c
from tests.bed.agentkit import Node, adopted, cond, delete, get, orphans_of_a_killed_exec, tombstones, wait_for
from tests.bed.controller_harness import Controller, install_crds
from tests.bed.procs import IGNORE
from tests.bed.procs import alive as _running

# --- deletion ------------------------------------------------------------------------------------------


def test_kubectl_delete_removes_the_directory_and_then_the_object(cluster, namespace, nodes, agents):
    n1, _ = nodes
    path = n1.retain(namespace, "run-del")
    a = agents(n1)
    adopted(cluster, namespace, "run-del")
    delete(cluster, namespace, "run-del")
    wait_for(lambda: get(cluster, namespace, "run-del") is None, what="object gone")
    assert not path.exists()
    assert tombstones(n1) == []

    # its queue's controller-runtime series (issue 26 item 7): the watch's events were queued and worked on
    def sample(name: str) -> re.Match[str] | None:
        return re.search(rf'{name}\{{[^}}]*name="{c.Queue.AGENT}"[^}}]*\}} (\d+)', a.metrics())

    worked = wait_for(lambda: sample(c.M_WORKQUEUE_WORK_DURATION + "_count"))
    added = sample(c.M_WORKQUEUE_ADDS)
    assert added is not None and int(added.group(1)) >= int(worked.group(1)) >= 1


def test_deleting_a_namespace_deletes_its_sandboxes_from_disk_and_the_namespace_goes_away(
    cluster, namespace, nodes, agents, procs
):
    # The real namespace controller (kube-controller-manager) deletes what the namespace holds; the agent's
    # finalizer makes each disk go first. A sandbox in use is held, which keeps the namespace Terminating:
    # a directory retained into it meanwhile cannot be adopted, and stays on disk.
    n1, _ = nodes
    doomed = f"{namespace[:50]}-doomed"
    cluster.kubectl("create", "namespace", doomed)
    paths = [n1.retain(doomed, name) for name in ("run-a", "run-b")]
    busy = n1.retain(doomed, "run-busy")
    holder = subprocess.Popen(["sleep", "120"], cwd=busy / "workspace")
    procs.append(holder)
    kept = n1.retain(namespace, "run-kept")
    a = agents(n1)
    for name in ("run-a", "run-b", "run-busy"):
        adopted(cluster, doomed, name)
    wait_for(lambda: get(cluster, namespace, "run-kept"), what="run-kept adopted")
    cluster.kubectl("delete", "namespace", doomed, "--wait=false")
    wait_for(lambda: all(get(cluster, doomed, n) is None for n in ("run-a", "run-b")), 90, "the idle ones deleted")
    assert not any(p.exists() for p in paths)
    wait_for(lambda: ((get(cluster, doomed, "run-busy") or {}).get("status") or {}).get("phase") == "Held", what="held")
    late = n1.retain(doomed, "run-late")
    refused = wait_for(lambda: re.search(r"adoption_failed .*being terminated.*", a.log()), what="the refused adoption")
    assert f"namespace {doomed} is being deleted: the directory is kept" in refused.group(0)
    assert busy.is_dir() and (late / "workspace").is_dir(), "nothing in use or unadopted is deleted"
    holder.kill()
    holder.wait()
    gone = cluster.kubectl("wait", "--for=delete", f"namespace/{doomed}", "--timeout=90s", check=False)
    assert gone.returncode == 0, gone.stderr
    assert not busy.exists() and tombstones(n1) == []
    wait_for(lambda: "cause=NamespaceMissing" in a.log(), what="the late directory quarantined")
    assert (late / "workspace").is_dir() and (kept / "workspace").is_dir()
    assert get(cluster, namespace, "run-kept") is not None


def test_a_process_with_its_cwd_inside_holds_deletion_until_it_exits(cluster, namespace, nodes, agents, procs):
    n1, _ = nodes
    path = n1.retain(namespace, "busy")
    p = subprocess.Popen(["sleep", "120"], cwd=path / "workspace")
    procs.append(p)
    agents(n1)
    adopted(cluster, namespace, "busy")
    delete(cluster, namespace, "busy")

    held = wait_for(lambda: (o := get(cluster, namespace, "busy")) and o.get("status", {}).get("phase") == "Held" and o)
    assert held["status"]["inUse"] is True
    assert f"pid {p.pid} (sleep) cwd" in held["status"]["heldBy"]
    assert (cond(held, "InUse") or {}).get("reason") == "InUse"
    events = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    assert "deletion held" in events
    time.sleep(2)
    assert path.is_dir() and tombstones(n1) == []  # held: never renamed

    p.kill()
    p.wait()
    wait_for(lambda: get(cluster, namespace, "busy") is None, what="deleted after the holder exited")
    assert not path.exists()


def test_an_open_file_descriptor_holds_deletion(cluster, namespace, nodes, agents, procs):
    n1, _ = nodes
    path = n1.retain(namespace, "open-fd")
    code = "import sys,time; f=open(sys.argv[1]); print('ready', flush=True); time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", code, str(path / "workspace" / "README")], stdout=subprocess.PIPE)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    agents(n1)
    adopted(cluster, namespace, "open-fd")
    delete(cluster, namespace, "open-fd")
    held = wait_for(lambda: (o := get(cluster, namespace, "open-fd")) and o["status"].get("phase") == "Held" and o)
    assert any(h.startswith(f"pid {p.pid} ") and " fd " in h for h in held["status"]["heldBy"])
    p.kill()
    p.wait()
    wait_for(lambda: get(cluster, namespace, "open-fd") is None)
    assert not path.exists()


def test_a_recorded_orphan_process_group_is_killed_before_deletion(cluster, namespace, nodes, agents):
    n1, _ = nodes
    path = n1.retain(namespace, "orphans")
    pids = orphans_of_a_killed_exec(n1, namespace, "orphans", "sleep 200 & sleep 201 & echo ready; exec sleep 202")
    try:
        agents(n1)
        adopted(cluster, namespace, "orphans")
        delete(cluster, namespace, "orphans")
        wait_for(lambda: get(cluster, namespace, "orphans") is None, what="deleted after reaping")
        assert not path.exists()
        assert not any(Path(f"/proc/{pid}").exists() and _running(pid) for pid in pids)
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_orphans_alone_do_not_hold_an_expired_sandbox_they_are_reaped_and_it_is_deleted(
    cluster, namespace, nodes, agents, tmp_path
):
    install_crds(cluster)  # the controller also watches SandboxPolicies
    n1, _ = nodes
    src = tmp_path / "job-leftover"
    src.mkdir()
    n1.root.retain(
        src, namespace, "leftover", job_id="job-leftover", created_at=datetime.now(UTC), retention=timedelta(seconds=20)
    )
    path = n1.root.path / namespace / "leftover"
    pids = orphans_of_a_killed_exec(n1, namespace, "leftover", "sleep 204 & sleep 205 & echo ready; exec sleep 206")
    try:
        a = agents(n1)

        def reported() -> dict[str, Any] | None:
            o = get(cluster, namespace, "leftover")
            return o if (cond(o, "InUse") or {}).get("reason") == str(c.Reason.ORPHANS_PENDING) else None

        obj = wait_for(reported, what="the orphans reported as pending, not as users")
        in_use = cond(obj, "InUse") or {}
        assert obj["status"]["inUse"] is False
        assert in_use["status"] == "False"
        assert f"pids {','.join(str(p) for p in sorted(pids))}," in in_use["message"]
        assert obj["status"]["heldBy"] == [in_use["message"]]
        assert all(_running(pid) for pid in pids)  # reported, not signalled: only a deletion reaps
        assert obj["status"].get("phase") != "Held"

        controller = Controller(cluster, namespace, tmp_path / "controller.log")
        try:
            controller.wait_leader()
            wait_for(lambda: get(cluster, namespace, "leftover") is None, 60, "deleted at expiry, by the controller")
        finally:
            controller.stop()
        assert not path.exists() and tombstones(n1) == []
        assert not any(_running(pid) for pid in pids)
        lines = [line for line in a.log().splitlines() if f"{namespace}/leftover" in line]
        reaped = next(i for i, line in enumerate(lines) if "orphans_reaped" in line)
        assert reaped < next(i for i, line in enumerate(lines) if "tombstoned" in line)  # killed, then renamed
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


class InProcessAgent:
    """The agent in a thread of the test process, for seams only a constructor can take (`kill`)."""

    def __init__(self, cluster: Any, node: Node, namespace: str, kill: orphans.Kill) -> None:
        settings = agent_mod.AgentSettings(
            node=node.name,
            root=node.root.path,
            namespace=namespace,
            scan_interval="1s",
            stuck_after="2s",
            orphan_timeout="1s",
            ignore_pids=IGNORE,
            pressure_high=100,
            pressure_low=99,
        )
        client = kube.Kube(kube.load_config(cluster.kubeconfig), component="sandkeep-agent")
        self.agent = agent_mod.Agent(settings, client, node.root, metrics.AgentMetrics(node.name), kill=kill)
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        async def main() -> None:
            self.stop_event = asyncio.Event()
            await self.agent.run(self.stop_event)

        self.loop.run_until_complete(main())

    def stop(self) -> None:
        wait_for(lambda: self.stop_event is not None)
        assert self.stop_event is not None
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout=30)


def test_a_pod_on_the_node_with_a_hostpath_inside_holds_deletion(cluster, namespace, nodes, agents):
    n1, n2 = nodes
    path = n1.retain(namespace, "mounted")
    other = n2.retain(namespace, "elsewhere-mounted")

    def pod(name: str, node: Node, host_path: Path) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeName": node.name,
                "automountServiceAccountToken": False,
                "containers": [{"name": "c", "image": "busybox", "volumeMounts": [{"name": "w", "mountPath": "/w"}]}],
                "volumes": [{"name": "w", "hostPath": {"path": str(host_path)}}],
            },
        }

    cluster.apply(pod("runner", n1, path / "workspace"))
    cluster.apply(pod("not-here", n2, path))  # another node's Pod: the same path there is another disk
    agents(n1)
    adopted(cluster, namespace, "mounted")
    delete(cluster, namespace, "mounted")
    held = wait_for(lambda: (o := get(cluster, namespace, "mounted")) and o["status"].get("phase") == "Held" and o)
    assert held["status"]["heldBy"] == [f"pod {namespace}/runner hostPath {path / 'workspace'}"]
    assert (cond(held, "InUse") or {}).get("reason") == "PodMount"
    assert path.is_dir()
    cluster.kubectl("delete", "pod", "runner", "-n", namespace, "--grace-period=0", "--force")
    wait_for(lambda: get(cluster, namespace, "mounted") is None, what="deleted once the Pod is gone")
    assert other.is_dir()


def test_an_agent_that_cannot_list_pods_holds_deletion_as_unknown(cluster, namespace, nodes, agents, tmp_path):
    # Everything the agent needs except Pods: without the Pod list a hostPath mount cannot be ruled out.
    n1, _ = nodes
    path = n1.retain(namespace, "blind")
    rules = [
        {"apiGroups": [c.GROUP], "resources": [c.SANDBOX_PLURAL], "verbs": ["get", "list", "watch", "create", "patch"]},
        {"apiGroups": [c.GROUP], "resources": [f"{c.SANDBOX_PLURAL}/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update", "patch"]},
    ]
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "agent", "namespace": namespace}}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": namespace},
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": namespace},
        "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": namespace}],
    }
    cluster.apply([sa, role, binding])
    try:
        kubeconfig = cluster.kubeconfig_for_token(cluster.token_for(namespace, "agent"), tmp_path / "agent.kubeconfig")
        a = agents(n1, kubeconfig=kubeconfig)
        adopted(cluster, namespace, "blind")
        delete(cluster, namespace, "blind")
        held = wait_for(lambda: (o := get(cluster, namespace, "blind")) and o["status"].get("phase") == "Held" and o)
        in_use = cond(held, "InUse")
        assert in_use["status"] == "Unknown" and in_use["reason"] == "InUseUnknown"
        assert "could not be listed" in in_use["message"]
        assert "pods_unlisted" in a.log()
        time.sleep(2)
        assert path.is_dir() and tombstones(n1) == []
    finally:
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", namespace, "--ignore-not-found", check=False)


def test_a_survivor_holds_deletion_with_a_clear_condition(cluster, namespace, nodes, procs):
    n1, _ = nodes
    path = n1.retain(namespace, "survivor")
    victim = subprocess.Popen(["sleep", "203"], cwd=path / "workspace", start_new_session=True)  # a proven orphan
    procs.append(victim)
    stat = Path(f"/proc/{victim.pid}/stat").read_text()
    start = int(stat[stat.rfind(")") + 2 :].split()[19])
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (path / ".commands" / f"{victim.pid}-{start}.json").write_text(
        json.dumps({"boot": boot, "leader": {"pid": victim.pid, "start": start}, "members": []})
    )
    a = InProcessAgent(cluster, n1, namespace, kill=lambda handle, sig: None)  # SIGKILL that does not kill
    try:
        adopted(cluster, namespace, "survivor")
        delete(cluster, namespace, "survivor")
        held = wait_for(
            lambda: (o := get(cluster, namespace, "survivor")) and cond(o, "OrphansSurvived") and o, what="survivor"
        )
        survived = cond(held, "OrphansSurvived")
        assert held["status"]["phase"] == "Held"
        assert survived["status"] == "True" and survived["reason"] == "OrphanSurvivor"
        assert f"pid {victim.pid} (sleep 203)" in survived["message"]
        assert f"kill -9 {victim.pid}" in survived["message"]
        assert path.is_dir() and tombstones(n1) == []
    finally:
        a.stop()
    victim.kill()
    victim.wait()
