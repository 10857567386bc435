"""Disk pressure on a real filesystem and the real API server: a small tmpfs filled past the high watermark.

The agent runs as a real `sandkeep agent` process whose root sits on its own tmpfs, so the percentages
are the kernel's own statvfs answers; no controller runs: the agent's release is a preconditioned
DELETE, and the deletion that follows is the ordinary one behind the finalizer.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller import agent as agent_mod
from controller.api import kube
from controller.api.leases import lease_path
from controller.observe import metrics
from controller.rules import contracts as c
from controller.rules.pressure import Disk, percent
from tests.bed.agentkit import Node, adopted, get, wait_for
from tests.bed.procs import IGNORE

REPO = Path(__file__).resolve().parents[2]

MiB = 1 << 20
pytestmark = pytest.mark.cluster


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of its own under the test's directory, unmounted at the end."""
    point = tmp_path / "disk"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(point)], check=True)
    yield point
    subprocess.run(["umount", str(point)], check=False)


def retain(node: Node, namespace: str, name: str, days_old: int, mib: int) -> Path:
    src = node.root.path.parent / f"job-{name}"
    (src / "data").mkdir(parents=True)
    (src / "data" / "blob").write_bytes(b"\1" * (mib * MiB))
    created = datetime.now(UTC) - timedelta(days=days_old)
    node.root.retain(src, namespace, name, job_id=f"job-{name}", created_at=created, retention=timedelta(days=3650))
    return node.root.path / namespace / name


def used_percent(point: Path) -> float:
    d = Disk.of(os.statvfs(point))
    return percent(d.used, d.size)


def pin(cluster: Any, namespace: str, name: str) -> None:
    cluster.kubectl("annotate", "rsb", name, "-n", namespace, f"{c.ANN_PIN_UNTIL}=2099-01-01T00:00:00Z")


def lease_annotation(cluster: Any, namespace: str, node: Node) -> str:
    lease = cluster.read(lease_path(namespace, f"{c.AGENT_LEASE_PREFIX}{node.name}"))
    found: str = lease["metadata"].get("annotations", {}).get(c.ANN_PRESSURE, "")
    return found


PRESSURE_OFF = ["--pressure-high", "100", "--pressure-low", "99"]
PRESSURE_ON = ["--pressure-high", "80", "--pressure-low", "45"]


def test_a_full_node_releases_exactly_the_oldest_unpinned_down_to_low_and_pins_and_holds_survive(
    cluster, namespace, crd, disk, agents, procs
):
    node = Node(cluster, disk, "full")
    # 7 x 8 MiB on 64 MiB: 87.5% used. Under 45% (28.8 MiB) fit the pinned and the held one and one more.
    retain(node, namespace, "pinned", 30, 8)
    held = retain(node, namespace, "held", 29, 8)
    ages = {"a-oldest": 20, "b-older": 15, "c-old": 10, "d-young": 5, "e-youngest": 1}
    for name, days in ages.items():
        retain(node, namespace, name, days, 8)
    assert used_percent(disk) > 80
    holder = subprocess.Popen(["sleep", "300"], cwd=held / "workspace")
    procs.append(holder)
    first = agents(node, extra=PRESSURE_OFF)  # adopt everything, then pin, before any release can happen
    for name in ("pinned", "held", *ages):
        adopted(cluster, namespace, name)
    pin(cluster, namespace, "pinned")
    first.stop()

    agent = agents(node, extra=PRESSURE_ON)
    gone = ["a-oldest", "b-older", "c-old", "d-young"]
    wait_for(lambda: all(get(cluster, namespace, n) is None for n in gone), 60, "the four oldest unpinned released")
    assert used_percent(disk) < 45
    for name in ("pinned", "held", "e-youngest"):
        obj = get(cluster, namespace, name)
        assert obj is not None and "deletionTimestamp" not in obj["metadata"], name
        assert (node.root.path / namespace / name / "workspace").is_dir(), name
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    pressure = [e for e in events if e["reason"] == c.Reason.DISK_PRESSURE]
    assert sorted(e["involvedObject"]["name"] for e in pressure) == gone
    assert all("% used" in e["message"] and "high watermark 80%" in e["message"] for e in pressure)
    text = agent.metrics()
    assert f'{c.M_DELETIONS}{{node="{node.name}",reason="DiskPressure"}} 4.0' in text
    assert f'{c.M_PRESSURE_RELEASES}{{node="{node.name}"}} 4.0' in text
    assert f'{c.M_PRESSURE_UNRELIEVED}{{node="{node.name}"}} 0.0' in text


def test_a_full_node_with_only_pinned_and_held_sandboxes_says_so(cluster, namespace, crd, disk, agents, procs):
    node = Node(cluster, disk, "stuck")
    retain(node, namespace, "big-pinned", 10, 30)
    held = retain(node, namespace, "held", 5, 25)
    holder = subprocess.Popen(["sleep", "300"], cwd=held / "workspace")
    procs.append(holder)
    first = agents(node, extra=PRESSURE_OFF)
    for name in ("big-pinned", "held"):
        adopted(cluster, namespace, name)
    pin(cluster, namespace, "big-pinned")
    first.stop()

    agent = agents(node, extra=PRESSURE_ON)
    report = json.loads(wait_for(lambda: lease_annotation(cluster, namespace, node), 60, "the pressure report"))
    assert [b["sandbox"] for b in report["blocked"]] == [f"{namespace}/big-pinned", f"{namespace}/held"]
    assert report["blocked"][0]["why"] == "pinned" and report["blocked"][1]["why"] == "held"
    assert any(f"pid {holder.pid} (sleep) cwd" in h for h in report["blocked"][1]["holders"])
    assert report["usedPercent"] > 80 and report["high"] == 80
    wait_for(lambda: f'{c.M_PRESSURE_UNRELIEVED}{{node="{node.name}"}} 1.0' in agent.metrics(), 30, "the gauge")
    cli = [sys.executable, "-m", "controller.cli.sandkeep", "doctor", "--namespace", namespace]
    cli += ["--kubeconfig", str(cluster.kubeconfig), "--sandbox-namespace", namespace]
    doctor = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr  # something needs a person
    shown = doctor.stdout.split("Disk pressure not relieved", 1)[1].split("\n\n", 1)[0]
    assert f"{namespace}/big-pinned" in shown and "pinned" in shown and "30.0M" in shown, doctor.stdout
    assert f"{namespace}/held" in shown and f"pid {holder.pid} (sleep) cwd" in shown, doctor.stdout
    assert get(cluster, namespace, "big-pinned") is not None and get(cluster, namespace, "held") is not None

    holder.kill()  # the holder leaves: the held one is released, and the report goes
    holder.wait()
    wait_for(lambda: get(cluster, namespace, "held") is None, 60, "the unheld sandbox released")
    wait_for(lambda: lease_annotation(cluster, namespace, node) == "", 60, "the report cleared")
    assert get(cluster, namespace, "big-pinned") is not None


def test_with_dry_run_on_a_full_node_says_what_it_would_release_and_deletes_nothing(
    cluster, namespace, crd, disk, agents
):
    node = Node(cluster, disk, "dry")
    names = {"a-oldest": 20, "b-older": 15, "c-old": 10, "d-young": 5, "e-youngest": 1, "f": 0, "g": 0}
    for name, days in names.items():
        retain(node, namespace, name, days, 8)
    first = agents(node, extra=PRESSURE_OFF)
    for name in names:
        adopted(cluster, namespace, name)
    first.stop()

    agents(node, env={"SANDKEEP_DRY_RUN": "true"}, extra=PRESSURE_ON)

    def would() -> list[str]:
        items = cluster.read(f"/api/v1/namespaces/{namespace}/events")["items"]
        return sorted(e["involvedObject"]["name"] for e in items if e["reason"] == c.Reason.WOULD_DELETE)

    # 56 MiB on 64: under 45% (28.8 MiB) takes four releases, and the projection says so without deleting.
    assert wait_for(lambda: len(would()) >= 4 and would(), 60, "WouldDelete Events") == list(names)[:4]
    assert all(get(cluster, namespace, n) is not None for n in names)
    assert all((node.root.path / namespace / n).is_dir() for n in names)
    assert used_percent(disk) > 80


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--pressure-high", "80", "--pressure-low", "90"], "must be below the high one"),
        (["--pressure-high", "80", "--pressure-low", "80"], "must be below the high one"),
        (["--pressure-high", "120"], "(0, 100]"),
        (["--pressure-min-free-bytes", "-1"], "cannot be negative"),
    ],
)
def test_the_agent_refuses_bad_watermarks_at_start(tmp_path: Path, flags: list[str], words: str) -> None:
    args = [
        sys.executable,
        "-m",
        "controller.cli.sandkeep",
        "agent",
        "--node",
        "n1",
        "--root",
        str(tmp_path / "r"),
        *flags,
    ]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "invalid settings" in done.stderr and words in done.stderr


class LandsDuringThePass(kube.Kube):
    """The real client; right after its fresh read of a sandbox, `land()` runs (a pin, a holder arriving)."""

    def __init__(self, cluster: Any, land: Callable[[], None]) -> None:
        super().__init__(kube.load_config(cluster.kubeconfig), component="sandkeep-agent")
        self.land = land

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        fresh = super().get_sandbox(namespace, name)
        self.land()
        return fresh


def release_once(cluster: Any, namespace: str, node: Node, name: str, land: Callable[[], None]) -> bool:
    """One release of `name` by an in-process agent whose fresh read is followed at once by `land()`."""
    settings = agent_mod.AgentSettings(node=node.name, root=node.root.path, namespace=namespace, ignore_pids=IGNORE)
    client = LandsDuringThePass(cluster, land)
    agent = agent_mod.Agent(settings, client, node.root, metrics.AgentMetrics(node.name))
    cached = get(cluster, namespace, name)
    assert cached is not None
    agent.state.objects[(namespace, name)] = cached
    try:
        return asyncio.run(agent.relief.release([(namespace, name)], "node usage")) == 1
    finally:
        client.close()


def test_a_pin_landing_after_the_fresh_read_wins(cluster, namespace, crd, tmp_path, agents):
    node = Node(cluster, tmp_path, "race")
    retain(node, namespace, "late-pin", 3, 1)
    first = agents(node, extra=PRESSURE_OFF)
    adopted(cluster, namespace, "late-pin")
    first.stop()

    assert not release_once(cluster, namespace, node, "late-pin", lambda: pin(cluster, namespace, "late-pin"))
    obj = get(cluster, namespace, "late-pin")  # the DELETE's resourceVersion precondition failed: a 409
    assert obj is not None and "deletionTimestamp" not in obj["metadata"]
    assert obj["metadata"]["annotations"][c.ANN_PIN_UNTIL] == "2099-01-01T00:00:00Z"


def test_a_holder_arriving_after_the_fresh_read_wins(cluster, namespace, crd, tmp_path, agents, procs):
    node = Node(cluster, tmp_path, "race")
    path = retain(node, namespace, "late-holder", 3, 1)
    first = agents(node, extra=PRESSURE_OFF)
    adopted(cluster, namespace, "late-holder")
    first.stop()

    def arrive() -> None:
        procs.append(subprocess.Popen(["sleep", "300"], cwd=path / "workspace"))

    assert not release_once(cluster, namespace, node, "late-holder", arrive)
    obj = get(cluster, namespace, "late-holder")
    assert obj is not None and "deletionTimestamp" not in obj["metadata"]
    assert release_once(cluster, namespace, node, "late-holder", lambda: None) is False  # still held
    procs[0].kill()
    procs[0].wait()
    assert release_once(cluster, namespace, node, "late-holder", lambda: None)  # the holder gone: released
    deleting = get(cluster, namespace, "late-holder")
    assert deleting is None or "deletionTimestamp" in deleting["metadata"]


def test_the_release_benchmark_runs_small(tools: Path) -> None:
    # hack/bench/release.py end to end at a small size: its own control plane, a real agent's release path.
    script = Path(__file__).resolve().parents[2] / "hack" / "bench" / "release.py"
    cmd = [sys.executable, str(script), "--sandboxes=60", "--releases=5"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "disk pressure (candidates+choose)" in result.stdout and "quota (choose)" in result.stdout
    released = re.search(r"\((\d+) released\)", result.stdout)
    assert released and int(released.group(1)) >= 5, result.stdout  # more if the shared disk filled meanwhile


def test_a_wave_of_deletions_on_one_node_shares_proc_passes_and_keeps_the_held_ones(tools: Path) -> None:
    # hack/bench/mass_expiry.py end to end at a small size: a real agent, 120 objects deleted at once.
    # One /proc pass per sandbox (the pipeline asked one at a time) would be 120 or more; batched, the
    # wave takes a few, plus the held ones' retries.
    script = Path(__file__).resolve().parents[2] / "hack" / "bench" / "mass_expiry.py"
    cmd = [sys.executable, str(script), "--sandboxes=120", "--processes=200", "--held=3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["held"] == 3, result.stdout  # every held sandbox kept; every other one gone (the bench waits)
    assert numbers["scans"] <= 40, result.stdout
