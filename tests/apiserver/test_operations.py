"""docs/operations.md's commands, run as written against a real kube-apiserver of their own.

A block whose first line is a comment is a command a person will paste; each is found by that line
and run with bash (`-euo pipefail`) and the real kubectl, so the guide cannot drift from what works.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.rules import contracts as c
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import instant
from tests.bed.own_cluster import own_cluster

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operations.md"
BACKUP = "# Back up every pin (namespace, name, pin-until), one line each:"
RESTORE = "# Restore the pins from sandkeep-pins.txt:"
UNSTRAND = "# Remove the agent's finalizer from every RetainedSandbox (only once no agent runs):"


def block(first_line: str) -> str:
    """The fenced sh block of the guide that starts with `first_line`."""
    blocks = re.findall(r"```sh\n(.*?)```", GUIDE.read_text(), re.S)
    [found] = [b for b in blocks if b.startswith(first_line + "\n")]
    return found


def run_block(cluster: LocalCluster, first_line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PATH": f"{cluster.bin}:{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block(first_line)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def cluster_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The guide's commands work on every namespace (`-A`), so they get a cluster of their own."""
    yield from own_cluster(tmp_path_factory.mktemp("operations-cluster"))


def make(cluster: LocalCluster, namespace: str, name: str, annotations: dict[str, str] | None = None) -> None:
    body = {
        "apiVersion": c.API_VERSION,
        "kind": c.SANDBOX_KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "finalizers": [c.FINALIZER],
            "annotations": annotations or {},
        },
        "spec": {"nodeName": "node-1", "createdAt": instant()},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(body))


def annotations(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.kubectl_json("get", "rsb", name, "-n", namespace)["metadata"].get("annotations", {})
    return found


def test_pins_backed_up_and_restored_by_the_guides_commands(cluster_alone: LocalCluster, tmp_path: Path) -> None:
    for ns in ("pins-a", "pins-b"):
        cluster_alone.kubectl("create", "namespace", ns)
    until, at = "2099-01-01T00:00:00Z", "2026-11-30T10:00:00Z"
    make(cluster_alone, "pins-a", "kept", {c.ANN_PIN_UNTIL: until, c.ANN_PINNED_AT: at})
    make(cluster_alone, "pins-a", "plain")
    make(cluster_alone, "pins-b", "fresh", {c.ANN_PIN_UNTIL: until})  # not yet stamped with pinned-at

    backup = run_block(cluster_alone, BACKUP, tmp_path)
    assert backup.returncode == 0, backup.stderr
    lines = sorted((tmp_path / "sandkeep-pins.txt").read_text().splitlines())
    assert lines == [f"pins-a kept {until}", f"pins-b fresh {until}"]

    # The objects come back without their pins (as after a reinstall's re-adoption); one does not come back.
    for ns, name in (("pins-a", "kept"), ("pins-b", "fresh")):
        cluster_alone.kubectl("annotate", "rsb", name, "-n", ns, f"{c.ANN_PIN_UNTIL}-", f"{c.ANN_PINNED_AT}-")
    cluster_alone.kubectl(
        "patch", "rsb", "fresh", "-n", "pins-b", "--type=merge", "-p", '{"metadata":{"finalizers":null}}'
    )
    cluster_alone.kubectl("delete", "rsb", "fresh", "-n", "pins-b")

    restore = run_block(cluster_alone, RESTORE, tmp_path)
    assert restore.returncode == 0, restore.stderr
    restored = annotations(cluster_alone, "pins-a", "kept")
    assert restored[c.ANN_PIN_UNTIL] == until
    assert c.ANN_PINNED_AT not in restored, "sandkeep's bookkeeping is not a person's to write"
    assert c.ANN_PIN_UNTIL not in annotations(cluster_alone, "pins-a", "plain")
    assert "not restored: pins-b/fresh" in restore.stderr


def test_the_guides_finalizer_removal_frees_stranded_objects_and_their_namespace(
    cluster_alone: LocalCluster, tmp_path: Path
) -> None:
    cluster_alone.kubectl("create", "namespace", "stranded")
    make(cluster_alone, "stranded", "one")
    make(cluster_alone, "stranded", "two")
    # Another controller's finalizer first: the guarded patch must refuse rather than remove the wrong one.
    cluster_alone.kubectl("create", "namespace", "foreign")
    make(cluster_alone, "foreign", "theirs")
    cluster_alone.kubectl(
        "patch",
        "rsb",
        "theirs",
        "-n",
        "foreign",
        "--type=json",
        "-p",
        '[{"op":"add","path":"/metadata/finalizers/0","value":"example.com/keep"}]',
    )
    # No agent runs: deleting the namespace strands it, Terminating on the agent's finalizer.
    cluster_alone.kubectl("delete", "namespace", "stranded", "--wait=false")
    time.sleep(3)
    phase = cluster_alone.kubectl_json("get", "namespace", "stranded")["status"]["phase"]
    assert phase == "Terminating"
    assert cluster_alone.kubectl_json("get", "rsb", "-n", "stranded")["items"], "objects held by the finalizer"

    unstrand = run_block(cluster_alone, UNSTRAND, tmp_path)

    assert unstrand.returncode == 0, unstrand.stderr
    assert "left alone: foreign/theirs" in unstrand.stderr  # the guarded patch refused the other finalizer
    assert annotations_finalizers(cluster_alone, "foreign", "theirs") == ["example.com/keep", c.FINALIZER]
    deadline = time.monotonic() + 60
    while cluster_alone.kubectl("get", "namespace", "stranded", check=False).returncode == 0:
        assert time.monotonic() < deadline, "namespace stranded still there a minute after the finalizers went"
        time.sleep(0.5)


def annotations_finalizers(cluster: LocalCluster, namespace: str, name: str) -> list[str]:
    found: list[str] = cluster.kubectl_json("get", "rsb", name, "-n", namespace)["metadata"].get("finalizers", [])
    return found
