"""End to end on four real nodes: each node's agent looks after its own disk and nothing else, a drain, a full
disk on one node and a lost node, asserted sandbox by sandbox. `make e2e-nodes` runs this file alone (marker
`nodes`); it is not in `make test`.

The bed (tests/bed/e2e_bed.py, `LocalBed(count=4)`) is started once for this module; the tests run in file
order. The disk is `/var/lib/sandkeep-e2e` on every node, each node's own; the fourth node's is a small tmpfs
(`SmallDiskBed`). The controller runs on the first node (a nodeSelector), which no test drains or loses, so
each story is about the agents and the disks.
Every story asserts that no pinned, held or unexpired sandbox is deleted and that every expired one is
deleted exactly once: one `finalizer_removed` line in its node's agent log and none in any other's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from controller.rules import contracts as c
from controller.rules.objects import is_session_holder
from hack.localnode import LocalNode
from tests.bed.e2e_bed import SYSTEM_NS, LocalBed, eventually, say, started

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


class SmallDiskBed(LocalBed):
    """The fourth node's disk is a small tmpfs, mounted in its namespace before the chart's agent starts there."""

    def prepare(self) -> None:
        small = self.nodes[3]
        self.on(small, f"mkdir -p '{self.disk}' && mount -t tmpfs -o size={SMALL_DISK_MIB}m small '{self.disk}'")


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBed]:
    bed = SmallDiskBed(tmp_path_factory.mktemp("nodes"), count=4)
    bed.values = {
        "controller": {"nodeGrace": f"{NODE_GRACE}s", "nodeSelector": {"kubernetes.io/hostname": "sandkeep-node"}}
    }
    with started(bed, NS):
        yield bed


# --- helpers -------------------------------------------------------------------------------------------
def pod_spec(bed: LocalBed, on: LocalNode, script: str, disk: str | None = None) -> dict[str, Any]:
    """A root container of the sandkeep image on node `on` running `script`, with the node's disk (or `disk`)
    mounted at the same path."""
    path = disk or str(bed.disk)
    return {
        "nodeName": on.name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": "main",
                "image": bed.image_ref,
                "command": ["sh", "-c", script],
                "securityContext": {"runAsUser": 0},
                "volumeMounts": [{"name": "disk", "mountPath": path}],
            }
        ],
        "volumes": [{"name": "disk", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}],
    }


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
    job_name = f"retain-{next(iter(sandboxes))}"
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name, "namespace": NS},
        "spec": {"backoffLimit": 0, "template": {"spec": pod_spec(bed, on, "\n".join(lines))}},
    }
    say(f"on {on.name}: sandkeep retain {', '.join(f'{n} ({r})' for n, r in sandboxes.items())}")
    bed.kubectl("apply", "-f", "-", input=json.dumps(job))
    bed.kubectl("wait", "-n", NS, f"job/{job_name}", "--for=condition=Complete", "--timeout=180s", timeout=190)
    if adopted:
        eventually(lambda: all(rsb(bed, n) for n in sandboxes), "adopted", timeout=60)


def holder(bed: LocalBed, on: LocalNode, name: str, sandbox: str) -> dict[str, Any]:
    """A bare Pod on `on` that sleeps with the sandbox's workspace mounted (what holds it from deletion)."""
    workspace = str(bed.root / NS / sandbox / c.WORKSPACE_DIR)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": pod_spec(bed, on, "sleep 3600", disk=workspace),
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


def agent_started(bed: LocalBed, on: LocalNode, since: datetime) -> bool:
    """The agent on `on` is Ready in a container started after `since` (a node back from power-off)."""
    pod = bed.get("pod", "-n", SYSTEM_NS, agents(bed)[on.name])
    (status,) = [s for s in pod["status"].get("containerStatuses", []) if s["name"] == "agent"]
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
