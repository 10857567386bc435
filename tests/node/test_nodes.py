"""End to end on four real nodes: each node's agent looks after its own disk and nothing else, a drain, a full
disk on one node, a lost node, an agent killed mid-adoption and mid-delete, two agents on one node, a rollout
across the nodes and the controller leader's node lost, asserted sandbox by sandbox. `make e2e-nodes` runs this
file alone (marker `nodes`); it is not in `make test` (CI runs it after).

The bed (tests/bed/e2e_bed.py, `LocalBed(count=4)`) is started once for this module; the tests run in file
order. The disk is `/var/lib/sandkeep-e2e` on every node, each node's own; the fourth node's is a small tmpfs
(`SmallDiskBed`). The controller's two replicas run on the first and the fourth node, which no test drains;
the last story loses the fourth.
Every story asserts that no pinned, held or unexpired sandbox is deleted and that every expired one is
deleted exactly once: one `finalizer_removed` line in its node's agent log and none in any other's, or, where
agents are replaced or killed (their logs go with them), one successful finalizer removal in the API server's
audit log (tests/bed/audit.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from controller.rules import contracts as c
from controller.rules.objects import is_session_holder
from hack.localcluster import tools_bin
from hack.localnode import LocalNode
from tests.bed import audit
from tests.bed.e2e_bed import (
    RELEASE,
    SYSTEM_NS,
    LocalBed,
    eventually,
    one_node_at_a_time,
    rolled_to,
    say,
    started,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.nodes,
    pytest.mark.slow,
    pytest.mark.xdist_group("e2e"),
    pytest.mark.timeout(900),
]
NS = "nodes"
NODE_GRACE = 40  # seconds: controller.nodeGrace here (10m by default)
SMALL_DISK_MIB = 100  # the fourth node's disk (a tmpfs): releasing for space starts above 85 % used
CONTROLLER_LABEL = "sandkeep.test/controller"  # on the first and the fourth node: where the controllers run


class SmallDiskBed(LocalBed):
    """The fourth node's disk is a small tmpfs, mounted in its namespace before the chart's agent starts there."""

    def prepare(self) -> None:
        small = self.nodes[3]
        self.on(small, f"mkdir -p '{self.disk}' && mount -t tmpfs -o size={SMALL_DISK_MIB}m small '{self.disk}'")
        # The controller's two replicas: one on the first node, one on the fourth (a hard anti-affinity).
        self.kubectl("label", "node", self.nodes[0].name, small.name, f"{CONTROLLER_LABEL}=yes")


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBed]:
    bed = SmallDiskBed(tmp_path_factory.mktemp("nodes"), count=4)
    bed.values = {
        "controller": {"nodeGrace": f"{NODE_GRACE}s", "nodeSelector": {CONTROLLER_LABEL: "yes"}, "antiAffinity": "hard"}
    }
    with started(bed, NS):
        yield bed


# --- helpers -------------------------------------------------------------------------------------------
def retain_on(bed: LocalBed, on: LocalNode, sandboxes: dict[str, str], mib: int = 0, adopted: bool = True) -> None:
    """One Job on node `on` that writes a workspace per name (`mib` MiB more in each) and retains it for its
    retention; waits for it, and (`adopted`) for every sandbox's object."""
    lines = ["set -e"]
    for name, retention in sandboxes.items():
        work = bed.disk / "jobs" / name
        lines.append(f"mkdir -p {work}; echo {name} > {work}/result.txt")
        if mib:
            lines.append(f"head -c {mib}M /dev/zero > {work}/blob")
        lines.append(f"sandkeep retain --root {bed.root} --namespace {NS} --name {name} --retention {retention} {work}")
    say(f"on {on.name}: sandkeep retain {', '.join(f'{n} ({r})' for n, r in sandboxes.items())}")
    bed.job_on(NS, on, f"retain-{next(iter(sandboxes))}", "\n".join(lines))
    if adopted:
        eventually(lambda: all(rsb(bed, n) for n in sandboxes), "adopted", timeout=60)


def holder(bed: LocalBed, on: LocalNode, name: str, sandbox: str) -> dict[str, Any]:
    """A bare Pod on `on` that sleeps with the sandbox's workspace mounted (what holds it from deletion)."""
    workspace = str(bed.root / NS / sandbox / c.WORKSPACE_DIR)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": bed.pod_spec(on, "sleep 3600", disk=workspace),
    }


def rsb(bed: LocalBed, name: str) -> dict[str, Any] | None:
    return bed.sandbox(NS, name)


def phase(bed: LocalBed, name: str) -> str | None:
    return bed.phase(NS, name)


def on_disk(bed: LocalBed, on: LocalNode, name: str) -> bool:
    return bed.on(on, f"test -d '{bed.root / NS / name}'", check=False).returncode == 0


def tombstones(bed: LocalBed, on: LocalNode) -> list[str]:
    return bed.on(on, f"find '{bed.root}' -maxdepth 1 -name '.reap-*'", check=False).stdout.split()


def agents(bed: LocalBed) -> dict[str, str]:
    """The agent Pods, by node."""
    pods = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=agent")["items"]
    live = [p for p in pods if p["metadata"].get("deletionTimestamp") is None]
    return {p["spec"]["nodeName"]: p["metadata"]["name"] for p in live}


def agent_status(bed: LocalBed, on: LocalNode) -> dict[str, Any]:
    """The status of the agent container of the agent Pod on `on`."""
    pod = bed.get("pod", "-n", SYSTEM_NS, agents(bed)[on.name])
    (status,) = [s for s in pod["status"].get("containerStatuses", []) if s["name"] == "agent"]
    return status


def agent_started(bed: LocalBed, on: LocalNode, since: datetime) -> bool:
    """The agent on `on` is Ready in a container started after `since` (a node back from power-off)."""
    status = agent_status(bed, on)
    began = (status.get("state", {}).get("running") or {}).get("startedAt")
    return bool(status["ready"] and began and datetime.fromisoformat(began) >= since)


def deletions(bed: LocalBed, names: set[str]) -> dict[str, list[str]]:
    """The sandboxes among `names` each node's agent deleted (its `finalizer_removed` log lines), by node."""
    out: dict[str, list[str]] = {}
    for node_name, pod in agents(bed).items():
        log = bed.kubectl("logs", "-n", SYSTEM_NS, pod, "-c", "agent").stdout
        removed = [ln for ln in log.splitlines() if "finalizer_removed" in ln]
        out[node_name] = sorted(n for ln in removed for n in names if f"object={NS}/{n} " in f"{ln} ")
    return out


def only(bed: LocalBed, on: LocalNode, deleted: list[str]) -> dict[str, list[str]]:
    """What `deletions` must be: `deleted` by `on`'s agent, nothing by any other."""
    return {n.name: deleted if n is on else [] for n in bed.nodes}


def kept(bed: LocalBed, where: dict[str, LocalNode], phases: dict[str, str] | None = None) -> None:
    """Each sandbox is still there, object and directory on its node, in its phase when given."""
    for name, on in where.items():
        obj = rsb(bed, name)
        assert obj is not None, f"{name}: its object is gone"
        assert obj["spec"]["nodeName"] == on.name
        assert on_disk(bed, on, name), f"{name}: its directory is gone from {on.name}"
        if phases and name in phases:
            assert obj["status"]["phase"] == phases[name], (name, obj["status"])


# --- the stories ---------------------------------------------------------------------------------------
def test_the_agent_runs_on_every_node_and_each_deletes_only_its_own(bed: LocalBed) -> None:
    names = {n.name for n in bed.nodes}

    def ready() -> bool:
        ds = bed.get("daemonset", "-n", SYSTEM_NS, "sandkeep-agent")
        return ds["status"].get("numberReady") == len(names) and set(agents(bed)) == names

    eventually(ready, f"one agent Ready on each of the {len(names)} nodes", timeout=240)
    one, two, three, _ = bed.nodes
    retain_on(bed, one, {"keep-1": "1h"})
    retain_on(bed, three, {"keep-3": "1h"})
    retain_on(bed, two, {"due-2": "30s", "keep-2": "1h", "pinned-2": "30s"})
    bed.kubectl("annotate", "rsb/pinned-2", "-n", NS, f"{c.ANN_PIN_FOR}=1h")
    eventually(lambda: phase(bed, "pinned-2") == "Pinned", "pinned-2 pinned")
    assert rsb(bed, "due-2")["spec"]["nodeName"] == two.name  # type: ignore[index]

    eventually(lambda: rsb(bed, "due-2") is None, "due-2 expired and deleted", timeout=120)
    assert not on_disk(bed, two, "due-2") and not tombstones(bed, two)
    kept(bed, {"keep-1": one, "keep-2": two, "keep-3": three, "pinned-2": two}, {"pinned-2": "Pinned"})
    deleted = deletions(bed, {"due-2", "keep-1", "keep-2", "keep-3", "pinned-2"})
    assert deleted == only(bed, two, ["due-2"]), "deleted once, by node 2's agent alone"


def session(bed: LocalBed, sandbox: str) -> dict[str, Any]:
    """The status of SandboxSession `look-<sandbox>`."""
    status: dict[str, Any] = bed.get(c.SESSION_PLURAL, f"look-{sandbox}", "-n", NS).get("status") or {}
    return status


def in_session(bed: LocalBed, sandbox: str) -> bool:
    """A SandboxSession's Pod holds the sandbox, as its node's agent last reported (`status.heldBy`)."""
    holders = ((rsb(bed, sandbox) or {}).get("status") or {}).get("heldBy") or []
    return any(is_session_holder(h, NS) for h in holders)


def test_a_drain_evicts_the_holder_and_the_session_not_the_agent_and_leaves_the_disk_as_it_was(
    bed: LocalBed,
) -> None:
    one, two, three, _ = bed.nodes
    retain_on(bed, two, {"held-2": "30s", "kept-2": "1h", "open-2": "1h", "deleting-2": "1h"})
    bed.kubectl("apply", "-f", "-", input=json.dumps(holder(bed, two, "holder-2", "held-2")))
    # A SandboxSession open on open-2 (its Pod runs on node 2, where the sandbox is).
    user = bed.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout
    body = {
        "apiVersion": c.API_VERSION,
        "kind": c.SESSION_KIND,
        "metadata": {"name": "look-open-2", "namespace": NS},
        "spec": {"sandbox": "open-2", "user": user},
    }
    bed.kubectl("create", "-f", "-", input=json.dumps(body))
    # deleting-2 is being deleted and cannot finish (an immutable file): a tombstone on node 2.
    bed.on(two, f"chattr +i '{bed.root / NS / 'deleting-2' / c.WORKSPACE_DIR / 'result.txt'}'")
    bed.kubectl("delete", "rsb", "deleting-2", "-n", NS, "--wait=false")
    bed.kubectl("wait", "-n", NS, "pod/holder-2", "--for=condition=Ready", "--timeout=120s", timeout=130)
    eventually(lambda: session(bed, "open-2").get("phase") == c.SessionPhase.RUNNING, "look-open-2 Running")
    # What holds open-2 while the session runs: its Pod's reopen volume, as node 2's agent reports it.
    eventually(lambda: in_session(bed, "open-2"), "open-2 held by the session's reopen volume", timeout=60)
    eventually(lambda: phase(bed, "open-2") == "Open", "open-2 Open", timeout=30)
    eventually(lambda: tombstones(bed, two), "deleting-2's delete under way (a tombstone)", timeout=60)
    eventually(lambda: phase(bed, "held-2") == "Held", "held-2 expired and held by its Pod", timeout=90)
    agent = agents(bed)[two.name]
    session_pod = session(bed, "open-2")["podName"]

    say(f"kubectl drain {two.name} --ignore-daemonsets (no --force): refused, a bare Pod is on it")
    refused = bed.kubectl("drain", two.name, "--ignore-daemonsets", "--timeout=60s", check=False, timeout=90)
    assert refused.returncode != 0 and "holder-2" in refused.stderr, refused.stderr
    assert bed.get("node", two.name)["spec"].get("unschedulable") is True, "drain cordons first"
    assert phase(bed, "held-2") == "Held" and session(bed, "open-2")["phase"] == c.SessionPhase.RUNNING
    try:
        say(f"kubectl drain {two.name} --ignore-daemonsets --delete-emptydir-data --force: the agent stays")
        drain = ("drain", two.name, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=120s")
        drained = bed.kubectl(*drain, check=False, timeout=150)
        assert drained.returncode == 0, drained.stderr
        assert bed.kubectl("get", "pod", "holder-2", "-n", NS, check=False).returncode != 0
        assert bed.kubectl("get", "pod", session_pod, "-n", NS, check=False).returncode != 0
        eventually(lambda: rsb(bed, "held-2") is None, "held-2 released and deleted", timeout=120)
        ended = eventually(
            lambda: (s := session(bed, "open-2")).get("phase") == c.SessionPhase.ENDED and s, "the session Ended"
        )
        say(f"the session: {ended['phase']} ({ended.get('reason')}: {ended.get('message')})")
        assert ended.get("reason") == c.Reason.POD_ENDED
        eventually(lambda: not in_session(bed, "open-2"), "open-2 no longer held by the ended session", timeout=60)
        eventually(lambda: phase(bed, "open-2") == "Retained", "open-2 Retained again", timeout=30)
        assert agents(bed)[two.name] == agent, "a DaemonSet Pod: drain leaves the agent running"
        assert not on_disk(bed, two, "held-2")
        assert rsb(bed, "deleting-2") is not None and tombstones(bed, two), "the stuck delete left as it was"
        kept(bed, {"open-2": two, "kept-2": two, "keep-2": two, "pinned-2": two, "keep-1": one, "keep-3": three})
    finally:
        bed.kubectl("uncordon", two.name)
        bed.on(two, f"chattr -R -i '{bed.root}'")
    eventually(lambda: rsb(bed, "deleting-2") is None, "deleting-2's delete finished once unblocked", timeout=90)
    assert not tombstones(bed, two)
    names = {"held-2", "kept-2", "open-2", "deleting-2"}
    assert deletions(bed, names) == only(bed, two, ["deleting-2", "held-2"])


def test_a_full_disk_on_one_node_releases_its_oldest_unpinned_sandbox_there_only(bed: LocalBed) -> None:
    one, two, three, small = bed.nodes
    mib = SMALL_DISK_MIB * 3 // 10  # three of them: 90 % used, over the 85 % high watermark; two: 60 %
    retain_on(bed, small, {"full-pinned": "30m"}, mib=mib)
    bed.kubectl("annotate", "rsb/full-pinned", "-n", NS, f"{c.ANN_PIN_FOR}=2h")
    eventually(lambda: phase(bed, "full-pinned") == "Pinned", "full-pinned pinned (the oldest deadline)")
    retain_on(bed, small, {"full-old": "1h", "full-new": "2h"}, mib=mib, adopted=False)  # full-old may go at once
    eventually(lambda: rsb(bed, "full-new"), "full-new adopted")
    say(f"{small.name}'s {SMALL_DISK_MIB} MiB disk: {bed.on(small, f'df -m {bed.disk} | tail -1').stdout.strip()}")
    eventually(
        lambda: rsb(bed, "full-old") is None and not on_disk(bed, small, "full-old"),
        "full-old (the oldest unpinned) released for space",
        timeout=120,
    )
    events = bed.get("events", "-n", NS, "--field-selector", "involvedObject.name=full-old")["items"]
    assert [e["reason"] for e in events if e["reason"] == c.Reason.DISK_PRESSURE] == [c.Reason.DISK_PRESSURE]
    time.sleep(10)  # a few more passes: under the low watermark now, nothing more goes
    kept(bed, {"full-new": small, "full-pinned": small}, {"full-new": "Retained", "full-pinned": "Pinned"})
    kept(bed, {"keep-1": one, "keep-2": two, "kept-2": two, "pinned-2": two, "keep-3": three})
    assert not tombstones(bed, small)
    assert deletions(bed, {"full-old", "full-new", "full-pinned"}) == only(bed, small, ["full-old"])


def wait_gone_node(bed: LocalBed, on: LocalNode) -> float:
    """Power `on` off and delete its Node, as a cloud's node controller does for a VM that is gone; when."""
    say(f"{on.name} powered off (kubelet, containerd, containers killed; its disk kept), its Node deleted")
    on.power_off()
    bed.kubectl("delete", "node", on.name, "--wait=true", timeout=60)
    return time.monotonic()


def test_a_lost_node_back_before_grace_changes_nothing_and_after_grace_its_sandboxes_are_lost(
    bed: LocalBed,
) -> None:
    one, two, three, _ = bed.nodes
    assert bed.fleet is not None
    retain_on(bed, three, {"lost-keep": "1h"})
    others = {"keep-1": one, "keep-2": two, "kept-2": two, "pinned-2": two}

    # Back before the grace: nothing changes.
    gone_at = wait_gone_node(bed, three)
    time.sleep(10)
    assert phase(bed, "lost-keep") == "Retained", "gone for less than nodeGrace: not Lost"
    booted = datetime.now(UTC).replace(microsecond=0)
    bed.fleet.power_on(three)
    say(f"{three.name} back after {time.monotonic() - gone_at:.0f}s (nodeGrace {NODE_GRACE}s)")
    eventually(lambda: agent_started(bed, three, booted), "the agent running again on the returned node", timeout=180)
    time.sleep(max(0.0, gone_at + NODE_GRACE + 10 - time.monotonic()))
    kept(bed, {"lost-keep": three, "keep-3": three, **others}, {"lost-keep": "Retained", "keep-3": "Retained"})

    # Gone past the grace: its sandboxes are Lost; one deleted meanwhile is released by the controller.
    retain_on(bed, three, {"lost-due": "20s"})
    gone_at = wait_gone_node(bed, three)
    eventually(lambda: phase(bed, "lost-keep") == "Lost", "lost-keep Lost after nodeGrace", timeout=NODE_GRACE + 60)
    assert time.monotonic() - gone_at >= NODE_GRACE - 2, "Lost before the grace ended"
    eventually(lambda: rsb(bed, "lost-due") is None, "lost-due (expired) released by the controller", timeout=90)
    events = bed.get("events", "-n", NS, "--field-selector", "involvedObject.name=lost-due")["items"]
    released = [e for e in events if e["reason"] == c.Reason.FINALIZER_REMOVED]
    assert len(released) == 1 and released[0].get("count", 1) == 1, released
    lost = rsb(bed, "lost-keep")
    assert lost is not None and any(x["reason"] == c.Reason.NODE_GONE for x in lost["status"]["conditions"])
    assert phase(bed, "keep-3") == "Lost"
    # The disk of the powered-off node is still there: nothing deleted it.
    assert three.dir is not None
    host_root = three.dir / "var-lib" / bed.root.relative_to("/var/lib") / NS
    assert {p.name for p in host_root.iterdir()} >= {"lost-keep", "lost-due", "keep-3"}
    kept(bed, {"keep-1": one, **others}, {"keep-1": "Retained", "pinned-2": "Pinned"})


def test_the_lost_node_back_after_grace_with_its_disk_gets_its_sandboxes_back(bed: LocalBed) -> None:
    one, two, three, _ = bed.nodes
    assert bed.fleet is not None and phase(bed, "lost-keep") == "Lost", "follows the lost node's story"
    booted = datetime.now(UTC).replace(microsecond=0)
    bed.fleet.power_on(three)
    say(f"{three.name} back long after nodeGrace, its disk as it was")
    eventually(lambda: agent_started(bed, three, booted), "the agent running again on the returned node", timeout=180)
    eventually(
        lambda: phase(bed, "lost-keep") == phase(bed, "keep-3") == "Retained",
        "the unexpired sandboxes Retained again, with their directories",
        timeout=120,
    )
    # The expired one, released while its node was gone: its directory is adopted again and, past its
    # deadline, deleted by its node's agent, once.
    eventually(
        lambda: rsb(bed, "lost-due") is None and not on_disk(bed, three, "lost-due"),
        "lost-due's directory (expired) deleted from the returned node",
        timeout=120,
    )
    assert not tombstones(bed, three)
    kept(bed, {"lost-keep": three, "keep-3": three, "keep-1": one, "keep-2": two, "pinned-2": two})
    assert deletions(bed, {"lost-due", "lost-keep", "keep-3"}) == only(bed, three, ["lost-due"])


# --- an agent killed, two agents on a node, a rollout, the controller leader's node lost ----------------
def kill_agent(bed: LocalBed, on: LocalNode) -> int:
    """SIGKILL every process of the agent container on `on` (a crash, an OOM kill), found by pid in the
    container's cgroup; the container's restart count before."""
    status = agent_status(bed, on)
    container = status["containerID"].partition("://")[2]
    hierarchy = Path("/sys/fs/cgroup/pids", on.cgroup_root.lstrip("/"))
    (group,) = [d for d in hierarchy.rglob(container) if d.is_dir()]
    pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    say(f"the agent on {on.name} killed: SIGKILL to its container's {len(pids)} process(es)")
    return int(status["restartCount"])


def restarted(bed: LocalBed, on: LocalNode, restarts: int) -> bool:
    status = agent_status(bed, on)
    return bool(status["restartCount"] > restarts and status["ready"])


def test_an_agent_killed_while_adopting_500_directories_adopts_each_once(bed: LocalBed) -> None:
    two = bed.nodes[1]
    names = [f"adopt-{i}" for i in range(500)]
    since = audit.now()
    bed.retain_many(NS, two, "retain-adopt", names, "1h", wait=False)
    eventually(lambda: len(bed.sandbox_names(NS, "adopt-")) >= 50, "the agent adopting them", timeout=180, every=0.5)
    restarts = kill_agent(bed, two)
    at_kill = len(bed.sandbox_names(NS, "adopt-"))
    say(f"{at_kill} of {len(names)} adopted when the agent was killed")
    assert at_kill < len(names), "adoption had finished before the kill: nothing was interrupted"
    eventually(lambda: restarted(bed, two, restarts), "the agent restarted by its kubelet, Ready", timeout=180)
    bed.wait_job(NS, "retain-adopt", timeout=300)
    eventually(
        lambda: len(bed.sandbox_names(NS, "adopt-")) == len(names), f"all {len(names)} adopted", timeout=300, every=3
    )
    created = audit.created(bed.cluster.audit_log, NS, since)
    assert {n: created[n] for n in names} == dict.fromkeys(names, 1), "each adopted by one create"
    assert not set(audit.deleted(bed.cluster.audit_log, NS, since)) & set(names), "none deleted"
    listed = bed.on(two, f"ls '{bed.root / NS}'").stdout.split()
    assert {n for n in listed if n.startswith("adopt-")} == set(names), "every directory still on its node"


def test_an_agent_killed_during_a_100000_file_delete_finishes_it_once(bed: LocalBed) -> None:
    two = bed.nodes[1]
    since = audit.now()
    bed.retain_many(NS, two, "retain-big", ["big"], "30s", files=100_000)
    eventually(lambda: rsb(bed, "big"), "big adopted", timeout=60)
    (stone,) = eventually(lambda: tombstones(bed, two), "big expired, its delete under way", timeout=180, every=0.1)
    restarts = kill_agent(bed, two)
    left = int(bed.on(two, f"find '{stone}' | wc -l").stdout)
    say(f"{left} of its 100,000 files and directories left in {stone} when the agent was killed")
    assert left > 1, "the delete had finished before the kill: nothing was interrupted"
    eventually(lambda: restarted(bed, two, restarts), "the agent restarted by its kubelet, Ready", timeout=180)
    eventually(lambda: rsb(bed, "big") is None, "big's delete finished by the restarted agent", timeout=300, every=2)
    assert not tombstones(bed, two) and not on_disk(bed, two, "big")
    deleted = audit.deleted(bed.cluster.audit_log, NS, since)
    assert deleted["big"] == 1 and not {n for n in deleted if n.startswith("adopt-")}, deleted
    assert len(bed.sandbox_names(NS, "adopt-")) == 500


def lock_holders(bed: LocalBed, on: LocalNode) -> int:
    """How many processes hold the root lock of `on` (the kernel's flock table, /proc/locks)."""
    dev, ino = map(int, bed.on(on, f"stat -c '%d %i' '{bed.root}/.sandkeep.lock'").stdout.split())
    ident = f" {os.major(dev):02x}:{os.minor(dev):02x}:{ino} "
    table = bed.on(on, "cat /proc/locks").stdout.splitlines()
    return sum(1 for line in table if "FLOCK" in line and ident in line and "->" not in line)


def test_a_second_agent_on_a_node_waits_for_its_root_and_takes_over_once_the_first_dies(bed: LocalBed) -> None:
    """What `maxSurge` would do (the chart refuses it): two agent Pods on one node. The root lock lets one work;
    the other is alive and not Ready, and takes over when the first dies."""
    one = bed.nodes[0]
    template = bed.get("daemonset", "-n", SYSTEM_NS, "sandkeep-agent")["spec"]["template"]["spec"]
    template["containers"] = [ct for ct in template["containers"] if ct["name"] == "agent"]
    twin = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent-twin", "namespace": SYSTEM_NS, "labels": {"sandkeep.test/twin": "yes"}},
        "spec": {**template, "nodeName": one.name},
    }
    say(f"a second agent Pod on {one.name}, a copy of the DaemonSet's")
    bed.kubectl("apply", "-f", "-", input=json.dumps(twin))

    def twin_log() -> str:
        return bed.kubectl("logs", "-n", SYSTEM_NS, "agent-twin", "-c", "agent", check=False).stdout

    def twin_ready() -> bool:
        status = bed.get("pod", "-n", SYSTEM_NS, "agent-twin")["status"].get("containerStatuses") or [{}]
        return bool(status[0].get("ready"))

    since = audit.now()
    try:
        eventually(lambda: "root_locked_waiting" in twin_log(), "the second agent waiting for the root", timeout=120)
        time.sleep(35)  # past three liveness periods: alive while it waits, so not restarted
        assert agent_status(bed, one)["ready"] and not twin_ready()
        twin_pod = bed.get("pod", "-n", SYSTEM_NS, "agent-twin")["status"]["containerStatuses"][0]
        assert twin_pod["restartCount"] == 0, "a waiting agent is not killed by its liveness probe"
        assert lock_holders(bed, one) == 1
        retain_on(bed, one, {"turn-1": "30s"})
        eventually(lambda: rsb(bed, "turn-1") is None, "turn-1 deleted by the agent holding the root", timeout=120)
        assert "finalizer_removed" not in twin_log()

        restarts = kill_agent(bed, one)
        holders = []
        for _ in range(40):  # the handover: at no moment two holders
            holders.append(lock_holders(bed, one))
            time.sleep(0.25)
        eventually(lambda: lock_holders(bed, one) == 1, "the root held again")
        assert max(holders) == 1, holders
        took_over = "root_lock_acquired" in twin_log()
        say(f"the root taken over by {'the second agent' if took_over else 'the restarted agent'}")
        eventually(lambda: twin_ready() if took_over else restarted(bed, one, restarts), "the new holder Ready")
        assert twin_ready() == took_over
        retain_on(bed, one, {"turn-2": "30s"})
        eventually(lambda: rsb(bed, "turn-2") is None, "turn-2 deleted by the new holder", timeout=120)
        assert ("object=nodes/turn-2 " in twin_log()) == took_over
    finally:
        bed.kubectl("delete", "pod", "agent-twin", "-n", SYSTEM_NS, "--wait=true", timeout=120)
    eventually(lambda: agent_status(bed, one)["ready"], "the DaemonSet's agent holding the root again", timeout=120)
    assert lock_holders(bed, one) == 1
    assert audit.deleted(bed.cluster.audit_log, NS, since) == {"turn-1": 1, "turn-2": 1}


def test_an_agent_rollout_takes_the_nodes_one_at_a_time_while_a_wave_expires_and_pins_land(bed: LocalBed) -> None:
    """A new image tag rolled out by `helm upgrade` while 500 sandboxes on three nodes expire and 100 are pinned
    with kubectl: each expired one deleted once, each pinned one kept, the agents replaced node by node."""
    three_nodes = bed.nodes[:3]
    due = {
        on.name: [f"roll-due-{i}-{j}" for j in range(n)]
        for i, (on, n) in enumerate(zip(three_nodes, (167, 167, 166), strict=True))
    }
    pins = {
        on.name: [f"roll-pin-{i}-{j}" for j in range(n)]
        for i, (on, n) in enumerate(zip(three_nodes, (34, 33, 33), strict=True))
    }
    every_due = [n for names in due.values() for n in names]
    every_pin = [n for names in pins.values() for n in names]
    since = audit.now()
    for i, on in enumerate(three_nodes):
        bed.retain_many(NS, on, f"roll-due-{i}", due[on.name], "120s", wait=False)
        bed.retain_many(NS, on, f"roll-pin-{i}", pins[on.name], "300s", wait=False)
    for i in range(len(three_nodes)):
        bed.wait_job(NS, f"roll-due-{i}", 300)
        bed.wait_job(NS, f"roll-pin-{i}", 300)
    eventually(
        lambda: len(bed.sandbox_names(NS, "roll-")) == len(every_due) + len(every_pin),
        "all 600 adopted",
        timeout=240,
        every=3,
    )
    deadline = min(
        datetime.fromisoformat(o["status"]["deadline"])
        for o in bed.get("rsb", "-n", NS)["items"]
        if o["metadata"]["name"].startswith("roll-due-")
    )
    time.sleep(max(0.0, (deadline - datetime.now(UTC)).total_seconds() - 15))

    # The same image with one more label: a new digest under a new tag, as a release's would be.
    old = bed.image_ref
    tag = f"{bed.chart_version}-rollout"
    repository = old.partition("@")[0]
    new = f"{repository}:{tag}"
    crane = str(tools_bin(("crane",)) / "crane")
    subprocess.run(
        [crane, "mutate", "--insecure", "--label", f"sandkeep.test/rollout={tag}", "-t", new, old],
        check=True,
        capture_output=True,
    )
    say(f"helm upgrade --reuse-values --set image.tag={tag}: the agents roll; the wave is due at {deadline:%H:%M:%S}")
    bed.helm(
        "upgrade",
        RELEASE,
        *bed.chart_args(),
        "-n",
        SYSTEM_NS,
        "--reuse-values",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.digest=",
    )
    for start in range(0, len(every_pin), 10):  # the pins land while the agents roll and the wave expires
        batch = every_pin[start : start + 10]
        bed.kubectl("annotate", *(f"rsb/{n}" for n in batch), "-n", NS, f"{c.ANN_PIN_FOR}=2h")
        time.sleep(2)
    bed.kubectl("rollout", "status", "-n", SYSTEM_NS, "daemonset/sandkeep-agent", "--timeout=400s", timeout=410)
    eventually(lambda: rolled_to(bed, new), "every agent and controller on the new tag, Ready", timeout=300, every=3)
    order = one_node_at_a_time(bed, new)
    say(f"the agents replaced one node at a time: {', '.join(order)}")
    assert sorted(order) == sorted(n.name for n in bed.nodes)

    eventually(
        lambda: not bed.sandbox_names(NS, "roll-due-"),
        "every expired sandbox of the wave deleted",
        timeout=300,
        every=3,
    )
    log = bed.cluster.audit_log
    assert {n: c for n, c in audit.deleted(log, NS, since).items() if n.startswith("roll-")} == dict.fromkeys(
        every_due, 1
    )
    created = audit.created(log, NS, since)
    assert all(created[n] == 1 for n in every_due + every_pin), "a sandbox adopted twice"
    objects = {o["metadata"]["name"]: o for o in bed.get("rsb", "-n", NS)["items"]}
    assert {n: objects[n]["status"]["phase"] for n in every_pin} == dict.fromkeys(every_pin, "Pinned")
    for on in three_nodes:
        listed = set(bed.on(on, f"ls '{bed.root / NS}'").stdout.split())
        assert not listed & set(every_due), f"an expired directory left on {on.name}"
        assert set(pins[on.name]) <= listed, f"a pinned directory gone from {on.name}"
        assert not tombstones(bed, on)


def leader(bed: LocalBed) -> tuple[str, str]:
    """The controller Pod holding the `sandkeep-controller` Lease (its identity is `<pod>_<pid>`), and its node."""
    lease = bed.get("lease", "-n", SYSTEM_NS, c.CONTROLLER_LEASE)["spec"]
    pod = str(lease.get("holderIdentity") or "").rpartition("_")[0]
    found = bed.kubectl("get", "pod", pod, "-n", SYSTEM_NS, "-o", "jsonpath={.spec.nodeName}", check=False)
    return pod, found.stdout if pod and found.returncode == 0 else ""


def controllers_ready(bed: LocalBed) -> bool:
    status = bed.get("deployment", "-n", SYSTEM_NS, "sandkeep-controller")["status"]
    return status.get("readyReplicas") == status.get("replicas") == 2


def test_the_controller_leaders_node_lost_the_standby_leads_and_decides_each_expiry_once(bed: LocalBed) -> None:
    one, two, _, small = bed.nodes
    pods = bed.get("pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=controller")["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted([one.name, small.name]), "one replica a node"
    pod, node = leader(bed)
    if node == one.name:  # the node this story loses is the fourth: its replica must be the one leading
        say(f"the leader {pod} runs on {one.name}: deleted, so that the replica on {small.name} leads")
        bed.kubectl("delete", "pod", pod, "-n", SYSTEM_NS, "--wait=true", timeout=120)
        eventually(lambda: leader(bed)[1] == small.name, f"the controller on {small.name} leading", timeout=90)
    eventually(lambda: controllers_ready(bed), "both controller replicas Ready", timeout=180)
    pod, node = leader(bed)
    assert node == small.name
    duration = int(bed.get("lease", "-n", SYSTEM_NS, c.CONTROLLER_LEASE)["spec"]["leaseDurationSeconds"])

    # Two waves: the first due just before the leader's node goes, the second after the standby leads.
    first, second = [f"lead-a-{i}" for i in range(20)], [f"lead-b-{i}" for i in range(20)]
    since = audit.now()
    bed.retain_many(NS, two, "retain-lead-a", first, "50s", wait=False)
    bed.retain_many(NS, two, "retain-lead-b", second, "90s", wait=False)
    bed.wait_job(NS, "retain-lead-a")
    bed.wait_job(NS, "retain-lead-b")
    eventually(lambda: len(bed.sandbox_names(NS, "lead-")) == 40, "all 40 adopted", timeout=120)
    deadline = min(
        datetime.fromisoformat(o["status"]["deadline"])
        for o in bed.get("rsb", "-n", NS)["items"]
        if o["metadata"]["name"].startswith("lead-a-")
    )
    time.sleep(max(0.0, (deadline - datetime.now(UTC)).total_seconds() + 2))
    say(f"{small.name} powered off, and with it the leader {pod}")
    off_at = audit.now()
    small.power_off()
    off = time.monotonic()
    eventually(lambda: leader(bed)[0] not in ("", pod), "the standby leading", timeout=4 * duration, every=0.5)
    took = time.monotonic() - off
    new_pod, new_node = leader(bed)
    say(f"{new_pod} on {new_node} leads {took:.1f} s after the power-off (its Lease: {duration} s)")
    assert new_node == one.name
    assert took < 3 * duration, f"the standby took {took:.0f} s to lead, over three Lease durations"
    eventually(lambda: not bed.sandbox_names(NS, "lead-"), "both waves deleted", timeout=240, every=2)

    log = bed.cluster.audit_log
    released, deleted = audit.released(log, NS, since), audit.deleted(log, NS, since)
    names = first + second
    assert {n: released[n] for n in names} == dict.fromkeys(names, 1), "an expiry decided twice (or never)"
    assert {n: deleted[n] for n in names} == dict.fromkeys(names, 1)
    early = {w.name for w in audit.sandbox_writes(log, NS, "delete", since) if w.at < off_at}
    say(f"the old leader decided {len(early)} of the first wave before its node went; the rest {new_pod} did")
    assert not {n for n in bed.on(two, f"ls '{bed.root / NS}'").stdout.split() if n.startswith("lead-")}
    assert not tombstones(bed, two)
