"""The node agent against the real local control plane, real directories, real processes and signals.

Two simulated nodes with separate roots; agents run as real `sandkeep agent` processes (stopped by
pid), or in-process where a test needs the kill seam. Mostly no controller runs: deleting an object is
the delete request (`kubectl delete --wait=false`); where expiry is the point, a real `sandkeep
controller` makes that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from controller import agent as agent_mod
from controller.agent import watch as agent_watch
from controller.api import kube
from controller.api.leases import lease_path
from controller.cli.standalone import Replacer
from controller.cli.sweep import in_use_checker
from controller.node import orphans
from controller.node.reaper import Reaper
from controller.node.store import Root
from controller.observe import metrics
from controller.rules import contracts as c
from controller.rules import objects
from controller.rules.sizes import human_size
from tests.bed.controller_harness import Controller, install_crds
from tests.bed.procs import IGNORE

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "sandkeep.io_retainedsandboxes.yaml"
T = TypeVar("T")


DOCTOR = [sys.executable, "-m", "controller.cli.sandkeep", "doctor"]


def wait_for(check: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{c.SANDBOX_PLURAL}.{c.GROUP}")


class Node:
    def __init__(self, cluster: Any, tmp: Path, label: str, name: str | None = None) -> None:
        self.name = name or f"{label}-{secrets.token_hex(3)}"
        cluster.create_node(self.name)
        self.root = Root(tmp / f"root-{label}")
        self.cluster = cluster

    def retain(self, namespace: str, name: str, files: dict[str, str] | None = None) -> Path:
        src = self.root.path.parent / f"job-{self.name}-{name}"
        src.mkdir()
        for rel, text in (files or {"README": "hello"}).items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text(text)
        self.root.retain(
            src, namespace, name, job_id=f"job-{name}", created_at=datetime.now(UTC), retention=timedelta(hours=1)
        )
        return self.root.path / namespace / name


@pytest.fixture
def nodes(cluster: Any, crd: None, tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    n1, n2 = Node(cluster, tmp_path, "n1"), Node(cluster, tmp_path, "n2")
    yield n1, n2
    for n in (n1, n2):
        subprocess.run(["chattr", "-R", "-i", str(n.root.path)], capture_output=True, check=False)


class AgentProcess:
    """`sandkeep agent` as a real process; its log in a file; stopped by pid."""

    def __init__(
        self,
        cluster: Any,
        node: Node,
        namespace: str,
        log: Path,
        env: dict[str, str] | None = None,
        kubeconfig: Path | None = None,
        extra: list[str] | None = None,
        wrap: list[str] | None = None,
    ):
        flags = {
            "--node": node.name,
            "--root": str(node.root.path),
            "--kubeconfig": str(kubeconfig or cluster.kubeconfig),
            "--lease-namespace": namespace,
            "--metrics-port": "0",
            "--scan-interval": "1s",
            "--stuck-after": "2s",
            "--orphan-timeout": "2s",
            "--lock-wait": "0",
            # Releasing for space off unless a test turns it on: these roots share the host's disk, and a
            # host above 85% used must not make the agent release the sandboxes a test is about.
            "--pressure-high": "100",
            "--pressure-low": "99",
        }
        cli = [*(wrap or []), sys.executable, "-m", "controller.cli.sandkeep"]  # wrap: e.g. strace, to record its calls
        args = [*cli, "agent", *(part for kv in flags.items() for part in kv)]
        for pid in IGNORE:
            args += ["--ignore-pid", str(pid)]
        args += extra or []  # a flag given again wins (argparse keeps the last)
        self.log_path = log
        self.log_file = log.open("ab")
        self.proc = subprocess.Popen(
            args, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics_port(self) -> int:
        found = wait_for(lambda: re.search(r"metrics_port=(\d+)", self.log()), 30, "agent start")
        return int(found.group(1))

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port()}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log_file.close()


@pytest.fixture
def agents(cluster: Any, namespace: str, tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(
        node: Node, env: dict[str, str] | None = None, kubeconfig: Path | None = None, extra: list[str] | None = None
    ) -> AgentProcess:
        log = tmp_path / f"agent-{node.name[:60]}-{len(started)}.log"
        a = AgentProcess(cluster, node, namespace, log, env, kubeconfig, extra)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    started: list[subprocess.Popen[Any]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def get(cluster: Any, namespace: str, name: str) -> dict[str, Any] | None:
    """The sandbox as the API server has it now, None when it is gone (an HTTP GET: the waits poll this)."""
    found: dict[str, Any] | None = cluster.read(kube.sandbox_path(namespace, name))
    return found


def adopted(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    """Wait until the agent has adopted `name`: the object exists and carries its finalizer."""
    return wait_for(
        lambda: (o := get(cluster, namespace, name)) and o["metadata"].get("finalizers") and o, what=f"{name} adopted"
    )


def cond(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return None if obj is None else objects.condition_of(obj, type_)


def make_object(cluster: Any, namespace: str, name: str, node: str, workspace: str | None = None) -> None:
    body: dict[str, Any] = {
        "apiVersion": c.API_VERSION,
        "kind": c.SANDBOX_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeName": node, "createdAt": "2026-01-01T00:00:00Z"},
    }
    if workspace is not None:
        body["spec"]["workspace"] = {"path": workspace}
    cluster.kubectl("create", "-f", "-", input=json.dumps(body))


def delete(cluster: Any, namespace: str, name: str) -> None:
    cluster.kubectl("delete", "rsb", name, "-n", namespace, "--wait=false")


def tombstones(node: Node) -> list[str]:
    return sorted(p.name for p in node.root.path.iterdir() if p.name.startswith(c.TOMBSTONE_PREFIX))


# --- adoption and observed state -------------------------------------------------------------------------


def test_a_retained_directory_is_adopted_and_the_agent_sees_only_its_node(cluster, namespace, nodes, agents):
    n1, n2 = nodes
    n1.retain(namespace, "run-1", {"a.txt": "x" * 10000, "sub/b.txt": "y"})
    n2.retain(namespace, "run-2")
    make_object(cluster, namespace, "elsewhere", n2.name)  # another node's object: never touched by n1's agent
    agents(n1)

    obj = wait_for(lambda: get(cluster, namespace, "run-1"), what="adoption")
    assert obj["metadata"]["finalizers"] == [c.FINALIZER]
    assert obj["metadata"]["labels"] == {c.LABEL_NODE: n1.name, c.LABEL_MANAGED_BY: c.MANAGED_BY}
    assert obj["spec"]["nodeName"] == n1.name
    assert obj["spec"]["jobId"] == "job-run-1"
    assert obj["spec"]["workspace"]["path"] == str(n1.root.path / namespace / "run-1" / "workspace")
    manifest = json.loads((n1.root.path / namespace / "run-1" / "manifest.json").read_text())
    assert obj["spec"]["createdAt"] == manifest["createdAt"]
    assert obj["spec"]["retainUntil"] == manifest["retainUntil"]

    def observed() -> dict[str, Any] | None:
        o = get(cluster, namespace, "run-1")
        ok = o and o.get("status", {}).get("fileCount") == 3 and (cond(o, "DiskPresent") or {}).get("status") == "True"
        return o if ok else None

    o = wait_for(observed, what="status sizes")
    assert o["status"]["sizeBytes"] >= 10000
    assert o["status"]["inUse"] is False
    assert (cond(o, "InUse") or {}).get("status") == "False"

    lease = wait_for(lambda: cluster.read(lease_path(namespace, f"{c.AGENT_LEASE_PREFIX}{n1.name}")), what="heartbeat")
    assert lease["spec"]["renewTime"]
    time.sleep(2.5)  # two more passes: n2's directory and object stay untouched by n1's agent
    assert get(cluster, namespace, "run-2") is None
    other = get(cluster, namespace, "elsewhere")
    assert other is not None
    assert not other["metadata"].get("finalizers") and not other.get("status")


def test_the_size_column_shows_the_agents_human_size_beside_the_exact_bytes(cluster, namespace, nodes, agents):
    n1, _ = nodes
    n1.retain(namespace, "big", {"blob.bin": "z" * (1024 * 1024)})
    agents(n1)

    def sized() -> dict[str, Any] | None:
        o = get(cluster, namespace, "big")
        return o if o and o.get("status", {}).get("size") else None

    o = wait_for(sized, what="status.size")
    assert o["status"]["sizeBytes"] >= 1024 * 1024
    assert o["status"]["size"] == human_size(o["status"]["sizeBytes"]) == "1.0M"
    # What a person sees: kubectl prints the CRD's SIZE column from status.size.
    # Columns are aligned under their headers (an empty column prints nothing), so cut by position.
    header, row = cluster.kubectl("get", "rsb", "big", "-n", namespace).stdout.splitlines()[:2]
    start = header.index("SIZE")
    end = header.index("AGE")
    assert row[start:end].strip() == "1.0M"


def test_writes_only_when_something_changed(cluster, namespace, nodes, agents):
    n1, _ = nodes
    n1.retain(namespace, "quiet")
    agents(n1)
    wait_for(lambda: (get(cluster, namespace, "quiet") or {}).get("status", {}).get("fileCount") == 2)
    rv = get(cluster, namespace, "quiet")["metadata"]["resourceVersion"]
    time.sleep(3)  # three passes of nothing new
    assert get(cluster, namespace, "quiet")["metadata"]["resourceVersion"] == rv


def test_untrusted_manifests_are_refused_and_a_missing_directory_is_reported(cluster, namespace, nodes, agents):
    n1, _ = nodes
    liar = n1.retain(namespace, "liar")
    body = json.loads((liar / "manifest.json").read_text())
    body["name"] = "victim"  # claims another sandbox than the path it sits under
    (liar / "manifest.json").write_text(json.dumps(body))
    n1.retain("no-such-namespace", "orphan")
    make_object(cluster, namespace, "ghost", n1.name)  # an object whose directory does not exist
    outside = n1.root.path.parent / "outside-the-root"
    outside.mkdir()
    (outside / "data").write_text("not the agent's")
    make_object(cluster, namespace, "pointer", n1.name, workspace=str(outside))  # spec points out of the root
    a = agents(n1)

    ghost = wait_for(
        lambda: (
            (o := get(cluster, namespace, "ghost")) and (cond(o, "DiskPresent") or {}).get("status") == "False" and o
        )
    )
    assert ghost["metadata"]["finalizers"] == [c.FINALIZER]
    wait_for(lambda: "cause=ManifestMismatch" in a.log() and "cause=NamespaceMissing" in a.log())
    wait_for(lambda: quarantined(a) == {"ManifestMismatch": 1, "NamespaceMissing": 1}, what="quarantined by cause")
    assert get(cluster, namespace, "liar") is None and get(cluster, namespace, "victim") is None
    assert "victim" not in cluster.kubectl("get", "rsb", "-A", "-o", "name").stdout

    delete(cluster, namespace, "ghost")  # nothing on disk: the finalizer simply goes
    wait_for(lambda: get(cluster, namespace, "ghost") is None, what="ghost deleted")
    wait_for(lambda: "spec_path_refused" in a.log() and "reason=PathOutsideRoot" in a.log())
    delete(cluster, namespace, "pointer")  # the agent works on <root>/<ns>/pointer only, never on the spec's path
    wait_for(lambda: get(cluster, namespace, "pointer") is None, what="pointer deleted")
    assert (outside / "data").read_text() == "not the agent's"


def quarantined(a: AgentProcess) -> dict[str, int]:
    """The agent's sandkeep_quarantined_entries by reason, as Prometheus would scrape it."""
    found = re.findall(rf'{c.M_QUARANTINED}\{{[^}}]*reason="([^"]+)"[^}}]*\}} ([0-9.]+)', a.metrics())
    return {reason: int(float(n)) for reason, n in found if float(n)}


def quarantine_file(node: Node) -> dict[str, Any]:
    path = node.root.path / c.QUARANTINE_FILE
    return json.loads(path.read_text())["entries"] if path.exists() else {}


def test_unadoptable_entries_are_quarantined_deleted_after_the_grace_held_in_use_or_adopted_once_fixed(
    cluster, namespace, nodes, agents, procs, tmp_path
):
    n1, _ = nodes
    ns_dir = n1.retain(namespace, "fine").parent  # an ordinary sandbox: adopted, never quarantined
    (ns_dir / "bare" / "workspace").mkdir(parents=True)  # no manifest
    (ns_dir / "bare" / "workspace" / "f").write_text("x")
    (ns_dir / "garbage").mkdir()
    (ns_dir / "garbage" / c.MANIFEST_NAME).write_text("{not json")
    undated = n1.retain(namespace, "undated")
    body = json.loads((undated / c.MANIFEST_NAME).read_text())
    del body["createdAt"], body["retainUntil"]
    (undated / c.MANIFEST_NAME).write_text(json.dumps(body))
    gone_ns = f"{namespace[:40]}-none"
    n1.retain(gone_ns, "lost")  # a namespace that does not exist
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("not the agent's")
    (ns_dir / "link").symlink_to(victim)
    (ns_dir / "busy").mkdir()
    holder = subprocess.Popen(["sleep", "120"], cwd=ns_dir / "busy")
    procs.append(holder)
    fixable = n1.retain(namespace, "fixable")
    good = (fixable / c.MANIFEST_NAME).read_text()
    (fixable / c.MANIFEST_NAME).write_text("garbage")
    late_ns = f"{namespace[:40]}-late"
    n1.retain(late_ns, "run")
    a = agents(n1, extra=["--quarantine-grace", "8s"])

    want = {"ManifestAbsent": 2, "ManifestUnparsed": 2, "NoCreatedAt": 1, "NamespaceMissing": 2, "Symlink": 1}
    wait_for(lambda: quarantined(a) == want, what="every unadoptable entry quarantined by its cause")
    for entry in ("bare", "garbage", "undated", "link", "busy", "fixable"):
        assert re.search(rf"quarantined reason=Quarantined cause=\S+ entry={namespace}/{entry} ", a.log()), entry
    lease = cluster.kubectl("get", "lease", f"{c.AGENT_LEASE_PREFIX}{n1.name}", "-n", namespace, "-o", "json")
    published = json.loads(json.loads(lease.stdout)["metadata"]["annotations"][c.ANN_QUARANTINE])
    assert published["total"] == 8 and published["grace"] == 8
    only = ["--install-namespace", namespace, "--sandbox-namespace", namespace]
    doctor = subprocess.run(
        [*DOCTOR, "--kubeconfig", str(cluster.kubeconfig), *only],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    table = doctor.stdout.split("Quarantined entries")[1].split("\n\n")[0]
    for entry, cause in (("garbage", "ManifestUnparsed"), ("undated", "NoCreatedAt"), ("link", "Symlink")):
        assert re.search(rf"{n1.name}\s+{namespace}/{entry}\s+{cause}\s", table), table
    assert re.search(rf"{gone_ns}/lost\s+NamespaceMissing", table), table

    # Within the grace a person fixes one manifest and creates the other namespace: both are adopted.
    (fixable / c.MANIFEST_NAME).write_text(good)
    cluster.kubectl("create", "namespace", late_ns)
    try:
        adopted(cluster, namespace, "fixable")
        adopted(cluster, late_ns, "run")
        gone = ("bare", "garbage", "undated", "link")
        wait_for(lambda: not any(os.path.lexists(ns_dir / e) for e in gone), 60, "the rest deleted after the grace")
        assert not (n1.root.path / gone_ns / "lost").exists()
        assert (victim / "data").read_text() == "not the agent's", "the link went as a name, never followed"
        assert (ns_dir / "fine" / "workspace").is_dir() and (fixable / "workspace").is_dir()
        assert (n1.root.path / late_ns / "run" / "workspace").is_dir()
        wait_for(lambda: "quarantine_held reason=InUse" in a.log(), what="the busy one held")
        wait_for(lambda: quarantined(a) == {"ManifestAbsent": 1}, what="only the busy one left")
        assert (ns_dir / "busy").is_dir()
        deleted = a.metrics()
        for cause, n in (("ManifestAbsent", 1), ("ManifestUnparsed", 1), ("NamespaceMissing", 1), ("Symlink", 1)):
            assert re.search(rf'{c.M_QUARANTINE_DELETIONS}\{{[^}}]*reason="{cause}"[^}}]*\}} {n}\.0', deleted), cause
        assert re.search(r"quarantine_deleted reason=QuarantineExpired cause=NoCreatedAt", a.log())

        holder.kill()
        holder.wait()
        wait_for(lambda: not (ns_dir / "busy").exists(), 30, "the busy one deleted once its holder exited")
        wait_for(lambda: quarantined(a) == {} and quarantine_file(n1) == {}, what="quarantine empty")
        assert tombstones(n1) == []
    finally:
        cluster.kubectl("delete", "namespace", late_ns, "--timeout=60s")  # the agent does its disk work


def test_the_quarantine_clock_survives_a_restart_and_a_zero_grace_never_deletes(cluster, namespace, nodes, agents):
    n1, _ = nodes
    n1.retain(namespace, "fine")
    bare = n1.root.path / namespace / "bare"
    bare.mkdir()
    first = agents(n1, extra=["--quarantine-grace", "0"])
    rel = f"{namespace}/bare"
    wait_for(lambda: quarantine_file(n1).get(rel, {}).get("watched", 0) >= 4, 30, "four seconds watched")
    assert bare.is_dir() and "delete_after=never" in first.log()
    first.stop()
    watched = quarantine_file(n1)[rel]["watched"]

    second = agents(n1, extra=["--quarantine-grace", "4s"])  # already watched for as long: due at once
    wait_for(lambda: not bare.exists(), 15, "deleted by the restarted agent")
    said = f"quarantine_deleted reason=QuarantineExpired cause=ManifestAbsent entry={rel}"
    wait_for(lambda: said in second.log(), 15, "the deletion said")  # the rename comes before the delete's line
    assert watched >= 4
    wait_for(lambda: rel not in quarantine_file(n1), what="its record dropped")


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


def orphans_of_a_killed_exec(node: Node, namespace: str, name: str, script: str) -> list[int]:
    """Run `script` (which prints "ready" and leaves two children) with `sandkeep exec` in the sandbox,
    wait until its leader and both children are recorded, SIGKILL the recorder; the recorded pids."""
    flags = getattr(node, "exec_flags", ())  # a caller whose sandbox is already expired opens it under its own window
    argv = ["exec", f"{namespace}/{name}", "--root", str(node.root.path), *flags, "--", "sh", "-c", script]
    cli = [sys.executable, "-m", "controller.cli.sandkeep"]
    recorder = subprocess.Popen([*cli, *argv], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert recorder.stdout is not None and recorder.stdout.readline().strip() == "ready"
    records = node.root.path / namespace / name / c.COMMANDS_DIR
    wait_for(lambda: any(len(json.loads(f.read_text())["members"]) >= 2 for f in records.glob("*.json")))
    record = json.loads(next(records.glob("*.json")).read_text())
    recorder.kill()  # the recorder dies; its command group runs on, cwd inside the sandbox
    recorder.wait()
    return [record["leader"]["pid"], *(m["pid"] for m in record["members"])]


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


def _running(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] not in "ZX"


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


# --- stuck tombstones ----------------------------------------------------------------------------------


def test_an_undeletable_file_makes_the_tombstone_stuck_and_it_recovers(cluster, namespace, nodes, agents):
    n1, _ = nodes
    path = n1.retain(namespace, "stuck", {"keep/immutable": "x", "other": "y"})
    subprocess.run(["chattr", "+i", str(path / "workspace" / "keep" / "immutable")], check=True)
    a = agents(n1)
    adopted(cluster, namespace, "stuck")
    delete(cluster, namespace, "stuck")

    obj = wait_for(lambda: (o := get(cluster, namespace, "stuck")) and o["status"].get("phase") == "Stuck" and o)
    stuck = cond(obj, "TombstoneStuck")
    tomb = obj["status"]["tombstone"]
    assert stuck["status"] == "True"
    assert "EPERM" in stuck["message"] and f"{tomb}/workspace/keep/immutable" in stuck["message"]
    assert tombstones(n1) == [tomb] and not path.exists()
    text = wait_for(lambda: (m := a.metrics()) and re.search(r"sandkeep_tombstones_stuck\{[^}]*\} 1\.0", m) and m)
    assert re.search(r"sandkeep_tombstones\{[^}]*\} 1\.0", text)
    oldest = re.search(r"sandkeep_tombstone_stuck_oldest_seconds\{[^}]*\} ([0-9.e+]+)", text)
    assert oldest and float(oldest.group(1)) >= 2
    time.sleep(2)  # more failing passes: still one log line
    assert a.log().count("tombstone_stuck") == 1
    assert "TombstoneStuck" in cluster.kubectl("get", "events", "-n", namespace).stdout

    subprocess.run(["chattr", "-i", str(n1.root.path / tomb / "workspace" / "keep" / "immutable")], check=True)
    wait_for(lambda: get(cluster, namespace, "stuck") is None, what="recovered")
    assert tombstones(n1) == []
    wait_for(lambda: re.search(r"sandkeep_tombstones_stuck\{[^}]*\} 0\.0", a.metrics()))


# --- crashes -------------------------------------------------------------------------------------------


def test_an_agent_killed_after_the_rename_and_mid_delete_is_finished_by_the_next(cluster, namespace, nodes, agents):
    n1, _ = nodes
    files = {f"d{i // 500}/f{i}": "z" for i in range(20000)}
    path = n1.retain(namespace, "crashy", files)
    first = agents(n1, env={agent_mod.SEAM_KILL_AFTER_RENAME: "1"})
    adopted(cluster, namespace, "crashy")
    delete(cluster, namespace, "crashy")
    assert first.proc.wait(timeout=30) == -signal.SIGKILL
    (tomb,) = tombstones(n1)
    assert not path.exists() and get(cluster, namespace, "crashy") is not None

    second = agents(n1, env={agent_mod.SEAM_KILL_DURING_DELETE: "0.01"})
    assert second.proc.wait(timeout=30) == -signal.SIGKILL
    assert tombstones(n1) == [tomb]  # the delete was cut short
    assert get(cluster, namespace, "crashy") is not None

    agents(n1)
    wait_for(lambda: get(cluster, namespace, "crashy") is None, what="finished by the third agent")
    assert tombstones(n1) == []


def test_an_orphan_tombstone_is_cleared(cluster, namespace, nodes, agents):
    n1, _ = nodes
    n1.retain(namespace, "gone")
    n1.root.tombstone(namespace, "gone", id="0a1b2c3d-0000-4000-8000-000000000000", now=datetime.now(UTC))
    a = agents(n1)
    wait_for(lambda: tombstones(n1) == [], what="orphan cleared")
    wait_for(lambda: re.search(r'sandkeep_deletions_total\{[^}]*reason="TombstoneLeftover"\} 1\.0', a.metrics()))


def test_a_run_retained_again_under_the_same_name_is_not_deleted_with_the_old_object(cluster, namespace, nodes, agents):
    n1, _ = nodes
    path = n1.retain(namespace, "again", {"v": "first run"})
    first = agents(n1)
    old = adopted(cluster, namespace, "again")
    first.stop()
    # The job ran again: its new workspace replaces the old one under the same name (a new createdAt).
    time.sleep(0.01)
    src = n1.root.path.parent / "job-again-2"
    src.mkdir()
    (src / "v").write_text("second run")
    with contextlib.ExitStack() as stack:  # as `sandkeep retain` replaces: the pipeline, under the root lock
        replace = Replacer(Reaper(n1.root, in_use_checker(IGNORE)), stack)
        n1.root.retain(
            src, namespace, "again", job_id="job-again", created_at=datetime.now(UTC), retention=None, replace=replace
        )
    a = agents(n1)
    delete(cluster, namespace, "again")  # the request was about the first run

    def readopted() -> dict[str, Any] | None:
        o = get(cluster, namespace, "again")
        return o if o and o["metadata"]["uid"] != old["metadata"]["uid"] else None

    new = wait_for(readopted, what="the second run adopted as its own object")
    assert (path / "workspace" / "v").read_text() == "second run"
    assert new["spec"]["createdAt"] != old["spec"]["createdAt"]
    assert "deletion_skipped" in a.log() and "reason=ManifestChanged" in a.log()
    assert tombstones(n1) == []


def test_a_tombstone_of_a_live_object_is_put_back_never_deleted(cluster, namespace, nodes, agents):
    n1, _ = nodes
    path = n1.retain(namespace, "back", {"work.txt": "precious"})
    first = agents(n1)
    obj = adopted(cluster, namespace, "back")
    first.stop()
    # Renamed aside with no delete request (nothing the agent does leaves this; a person or a bug could).
    n1.root.tombstone(namespace, "back", id=obj["metadata"]["uid"], now=datetime.now(UTC))
    second = agents(n1)
    wait_for(lambda: path.is_dir() and tombstones(n1) == [], what="restored")
    assert (path / "workspace" / "work.txt").read_text() == "precious"
    wait_for(lambda: "tombstone_restored" in second.log(), what="the restore logged")  # logged after the rename
    assert not get(cluster, namespace, "back")["metadata"].get("deletionTimestamp")


def test_the_benchmark_runs_small():
    out = subprocess.run(
        [sys.executable, str(REPO / "hack" / "bench" / "agent_scan.py"), "--sandboxes", "30", "--no-cluster", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result = json.loads(out.stdout)
    assert result["entries"] == 30
    assert result["listing"] > 0 and result["in_use"] > 0


# --- trust nothing -------------------------------------------------------------------------------------


def test_a_symlink_inside_a_sandbox_pointing_outside_the_root_is_never_followed(
    cluster, namespace, nodes, agents, tmp_path
):
    n1, _ = nodes
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep me")
    path = n1.retain(namespace, "linky")
    (path / "workspace" / "escape").symlink_to(outside)
    (path / "workspace" / "escape-file").symlink_to(outside / "keep.txt")
    (n1.root.path / namespace / "evil").symlink_to(outside)  # a sandbox name that is a link out of the root
    make_object(cluster, namespace, "evil", n1.name)
    agents(n1)
    adopted(cluster, namespace, "linky")
    adopted(cluster, namespace, "evil")
    delete(cluster, namespace, "linky")
    delete(cluster, namespace, "evil")
    wait_for(lambda: get(cluster, namespace, "linky") is None and get(cluster, namespace, "evil") is None)
    assert (outside / "keep.txt").read_text() == "keep me"
    assert not path.exists()
    assert (n1.root.path / namespace / "evil").is_symlink()  # never followed, never renamed: only reported


def test_a_mount_inside_a_sandbox_holds_deletion_and_its_files_survive(cluster, namespace, nodes, agents, tmp_path):
    n1, _ = nodes
    other_fs = tmp_path / "other-filesystem"
    other_fs.mkdir()
    (other_fs / "data").write_text("not the sandbox's")
    path = n1.retain(namespace, "mounted-in", {"sub/.keep": ""})
    point = path / "workspace" / "sub"
    subprocess.run(["mount", "--bind", str(other_fs), str(point)], check=True)
    try:
        agents(n1)
        adopted(cluster, namespace, "mounted-in")
        delete(cluster, namespace, "mounted-in")
        held = wait_for(
            lambda: (o := get(cluster, namespace, "mounted-in")) and o["status"].get("phase") == "Held" and o
        )
        assert f"mount at {point}" in held["status"]["heldBy"]
        assert (other_fs / "data").read_text() == "not the sandbox's"
    finally:
        subprocess.run(["umount", str(point)], check=False)
    wait_for(lambda: get(cluster, namespace, "mounted-in") is None, what="deleted once unmounted")
    assert (other_fs / "data").read_text() == "not the sandbox's"


def test_sigterm_stops_the_agent_cleanly_once_its_watch_runs(cluster, namespace, nodes, agents):
    # Once its watch runs, the agent must still stop on SIGTERM, not linger until a SIGKILL (the kubelet's
    # grace period) with a watch request open.
    n1, _ = nodes
    make_object(cluster, namespace, "seen", n1.name)
    agent = agents(n1)
    agent.metrics_port()
    wait_for(lambda: "watch_listed" in agent.log(), what="the watch's listing done")
    wait_for(
        lambda: (
            get(cluster, namespace, "seen")
            and c.FINALIZER in get(cluster, namespace, "seen")["metadata"].get("finalizers", [])
        ),
        what="the object seen",
    )
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=30) == 0, agent.log()[-3000:]
    assert "agent_stopped" in agent.log()


def probe(port: int, path: str) -> int:
    """The HTTP status of a kubelet's probe of `path`."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_a_second_agent_on_the_same_root_waits_for_the_lock(cluster, namespace, nodes, agents):
    n1, _ = nodes
    first = agents(n1)
    first.metrics_port()
    second = agents(n1)
    wait_for(lambda: "root_locked_waiting" in second.log(), what="second agent waiting")
    assert "agent_started" not in second.log()
    # Alive while it waits (a kubelet's liveness probe leaves it be), not Ready: it does nothing yet.
    assert probe(second.metrics_port(), "/healthz") == 200
    assert probe(second.metrics_port(), "/readyz") == 503
    first.stop()
    wait_for(lambda: "agent_started" in second.log(), what="second agent took over")
    assert "root_lock_acquired" in second.log()


def test_the_agents_watch_gets_only_its_nodes_objects_from_the_api_server(cluster, namespace, nodes):
    # The agent's watch carries the field selector spec.nodeName=<node>: the API server filters, so other
    # nodes' objects never cross the wire (the handler here has no client-side filter of its own).
    n1, n2 = nodes
    make_object(cluster, namespace, "mine", n1.name)
    make_object(cluster, namespace, "theirs", n2.name)
    client = kube.Kube(kube.load_config(str(cluster.kubeconfig)), component="test-watch")
    seen: list[tuple[str | None, str]] = []

    def record(event_type: str | None, obj: dict[str, Any]) -> None:
        if obj["metadata"]["namespace"] == namespace:
            seen.append((event_type, obj["metadata"]["name"]))

    async def watch_until_later_create() -> None:
        lister = agent_watch.sandboxes(client, n1.name, record, lambda _seen: None)
        task = asyncio.create_task(lister.run())
        await lister.synced.wait()
        assert (None, "mine") in seen, "the listing"
        await asyncio.to_thread(make_object, cluster, namespace, "theirs-later", n2.name)
        await asyncio.to_thread(make_object, cluster, namespace, "mine-later", n1.name)
        while ("ADDED", "mine-later") not in seen:
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(asyncio.wait_for(watch_until_later_create(), timeout=60))
    finally:
        client.close()
    assert {name for _, name in seen} == {"mine", "mine-later"}


def test_the_longest_names_are_retained_adopted_opened_pinned_and_deleted(cluster, crd, namespace, tmp_path, agents):
    """Every valid Kubernetes name works end to end (issue 12, item 11): a 253-character sandbox in a
    63-character namespace on a 253-character node is retained on disk, adopted by the real agent (its node
    label bounded), opened with `sandkeep exec`, pinned with kubectl, and deleted from disk on request."""
    seed = secrets.token_hex(3)
    sandkeep_exec = [sys.executable, "-m", "controller.cli.sandkeep", "exec"]

    def longest(prefix: str) -> str:  # a 253-character DNS-1123 subdomain
        part = (prefix + seed + "x" * 63)[:63]
        return ".".join([part, part, part, part[:61]])

    long_ns = (f"l{seed}" + "n" * 63)[:63]
    name, node_name = longest("s"), longest("o")
    cluster.kubectl("create", "namespace", long_ns)
    node = Node(cluster, tmp_path, "long", name=node_name)
    try:
        src = tmp_path / "job-long"  # Node.retain names the source after both names: too long for one component
        src.mkdir()
        (src / "data.txt").write_text("payload")
        node.root.retain(
            src, long_ns, name, job_id="job-long", created_at=datetime.now(UTC), retention=timedelta(hours=1)
        )
        path = node.root.path / long_ns / name
        a = agents(node)
        obj = adopted(cluster, long_ns, name)
        label = obj["metadata"]["labels"][c.LABEL_NODE]
        assert len(label) <= 63 and obj["spec"]["nodeName"] == node_name
        opened = subprocess.run(
            [*sandkeep_exec, f"{long_ns}/{name}", "--root", str(node.root.path), "--", "cat", "data.txt"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert opened.returncode == 0 and opened.stdout == "payload", opened.stderr
        cluster.kubectl("annotate", "rsb", name, "-n", long_ns, f"{c.ANN_PIN_FOR}=72h")
        assert get(cluster, long_ns, name)["metadata"]["annotations"][c.ANN_PIN_FOR] == "72h"  # type: ignore[index]
        delete(cluster, long_ns, name)
        wait_for(lambda: get(cluster, long_ns, name) is None and not path.exists(), what="deleted from disk")
        assert tombstones(node) == []
        assert not re.search(r"(?<![.\d])422(?!\d)|Unprocessable", a.log())
    finally:
        cluster.kubectl("delete", "namespace", long_ns, "--wait=false", "--ignore-not-found", check=False)
        cluster.kubectl("delete", "node", node_name, "--wait=false", "--ignore-not-found", check=False)
