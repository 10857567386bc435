"""The node agent adopting what it finds on its node, against the real local control plane: what it reports
on the object (status, conditions, the size column, its Lease), what it refuses (untrusted manifests) and
what it quarantines (unadoptable entries: held, deleted after the grace, adopted once fixed).

The bed (two simulated nodes, `sandkeep agent` as a real process) is tests/bed/agentkit.py, its fixtures in
this folder's conftest.py; the agent's deletion is in test_agent.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from controller.api.leases import lease_path
from controller.rules import contracts as c
from controller.rules.sizes import human_size
from tests.bed.agentkit import AgentProcess, Node, adopted, cond, delete, get, make_object, tombstones, wait_for

REPO = Path(__file__).resolve().parents[2]
DOCTOR = [sys.executable, "-m", "controller.cli.sandkeep", "doctor"]


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

    def published() -> dict[str, Any] | None:
        """The quarantine the heartbeat Lease says, once a beat has published all 8 entries (None before)."""
        lease = cluster.read(lease_path(namespace, f"{c.AGENT_LEASE_PREFIX}{n1.name}")) or {}
        annotations = lease.get("metadata", {}).get("annotations", {})
        found: dict[str, Any] = json.loads(annotations.get(c.ANN_QUARANTINE) or "{}")
        return found if found.get("total") == 8 else None

    shown = wait_for(published, what="the quarantine on the heartbeat Lease")
    assert shown["grace"] == 8
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
