"""The node agent recovering, against the real local control plane: a tombstone it cannot delete (stuck, then
recovered), an agent killed mid-delete (finished by the next), orphan tombstones, a run retained again under
the same name, a tombstone of a live object put back; and the scan benchmark at a small size.

The bed is tests/bed/agentkit.py, its fixtures in this folder's conftest.py; the deletion itself is in
test_agent.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controller import agent as agent_mod
from controller.cli.standalone import Replacer
from controller.cli.sweep import in_use_checker
from controller.node.reaper import Reaper
from tests.bed.agentkit import adopted, cond, delete, get, tombstones, wait_for
from tests.bed.procs import IGNORE

REPO = Path(__file__).resolve().parents[2]


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
