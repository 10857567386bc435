"""Capture end to end on the API server side: a real `sandkeep agent` process, real Pod objects on the real local
control plane (no kubelet: their status is written as a kubelet writes it), and the volume published and
unpublished through `Volumes` with real bind mounts, as the CSI node service does. The agent's pass decides from
the Pod, keeps the workspace by rename or deletes it, says so in an Event on the Pod, and adoption makes the
RetainedSandbox, whose `spec.origin` says where it came from."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.node.capture import Volumes, entry_name
from controller.rules import contracts as c
from controller.rules.capture import kept_names
from controller.rules.contracts import Keep
from controller.rules.volume import VolumeRequest
from tests.bed.agentkit import Node, adopted, get, wait_for
from tests.disk.test_capture import mounts_at, tree, unmount_under

FILES = {"logs/build.log": "error: it failed\n", "report.xml": "<testsuite failures='1'/>\n"}


@pytest.fixture
def volumes(nodes: tuple[Node, Node], tmp_path: Path) -> Iterator[Volumes]:
    n1, _ = nodes
    try:
        yield Volumes(n1.root)
    finally:
        unmount_under(tmp_path)


class Job:
    """A Job's Pod on the node (created through the API, ended by hand) and its captured volume."""

    def __init__(self, cluster: Any, namespace: str, node: Node, tmp: Path, keep: Keep) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.name = f"build-{secrets.token_hex(3)}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": namespace, "labels": {"job-name": "build"}},
            "spec": {
                "nodeName": node.name,
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "containers": [{"name": "main", "image": "registry.example/ci/runner:1.2"}],
            },
        }
        created = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod)).stdout)
        self.uid: str = created["metadata"]["uid"]
        target = tmp / "kubelet" / "pods" / self.uid / "volumes" / "kubernetes.io~csi" / "workspace" / "mount"
        self.req = VolumeRequest(
            volume_id=f"csi-{secrets.token_hex(32)}",
            target_path=str(target),
            pod_namespace=namespace,
            pod_name=self.name,
            pod_uid=self.uid,
            service_account="default",
            keep=keep,
        )

    @property
    def sandbox(self) -> str:
        return kept_names(None, self.name, self.uid, self.req.volume_id)[0]

    def run(self, volumes: Volumes) -> None:
        """Publish, write the job's files through the mount (as the Pod would), unpublish."""
        volumes.publish(self.req)
        for rel, text in FILES.items():
            (Path(self.req.target_path) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(self.req.target_path) / rel).write_text(text)
        volumes.unpublish(self.req.volume_id, self.req.target_path)

    def end(self, phase: str, code: int) -> None:
        """What the kubelet posts when the Pod's one container exits with `code`."""
        terminated = {"exitCode": code, "reason": "Error" if code else "Completed"}
        status = {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "main",
                    "image": "registry.example/ci/runner:1.2",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        }
        self.cluster.kubectl(
            "patch", "pod", self.name, "-n", self.namespace, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": status}),
        )  # fmt: skip

    def delete(self) -> None:
        self.cluster.kubectl("delete", "pod", self.name, "-n", self.namespace, "--grace-period=0", "--force")

    def events(self) -> list[dict[str, Any]]:
        selector = f"involvedObject.uid={self.uid}"
        got = self.cluster.kubectl("get", "events", "-n", self.namespace, f"--field-selector={selector}", "-o", "json")
        items: list[dict[str, Any]] = json.loads(got.stdout)["items"]
        return items


def event(job: Job, reason: c.Reason) -> dict[str, Any]:
    return wait_for(lambda: next((e for e in job.events() if e["reason"] == reason), None), what=f"a {reason} Event")


def test_a_failed_pods_workspace_becomes_a_retained_sandbox_with_outcome_failed_and_its_files(
    cluster, namespace, nodes, agents, volumes
):
    n1, _ = nodes
    job = Job(cluster, namespace, n1, n1.root.path.parent, Keep.ON_FAILURE)
    agents(n1)
    job.run(volumes)
    job.end("Failed", 2)
    obj = adopted(cluster, namespace, job.sandbox)
    assert obj["spec"]["origin"] == {
        "pod": job.name,
        "podUID": job.uid,
        "node": n1.name,
        "containers": [{"name": "main", "image": "registry.example/ci/runner:1.2", "exitCode": 2}],
        "outcome": "Failed",
        "labels": {"job-name": "build"},
    }
    assert obj["spec"]["jobId"] == f"Pod/{job.name}"
    assert tree(n1.root.path / namespace / job.sandbox / c.WORKSPACE_DIR) == FILES
    said = event(job, c.Reason.WORKSPACE_KEPT)
    assert said["message"] == (
        f"workspace kept as RetainedSandbox {namespace}/{job.sandbox} on node {n1.name}: Failed and keep: OnFailure"
    )
    assert list(volumes.records()) == []
    row = cluster.kubectl("get", c.SANDBOX_SHORT, job.sandbox, "-n", namespace).stdout
    assert "OUTCOME" in row.splitlines()[0] and "Failed" in row.splitlines()[1]


def test_a_success_with_keep_on_failure_keeps_nothing_and_an_event_says_why(cluster, namespace, nodes, agents, volumes):
    n1, _ = nodes
    job = Job(cluster, namespace, n1, n1.root.path.parent, Keep.ON_FAILURE)
    agents(n1)
    job.run(volumes)
    job.end("Succeeded", 0)
    said = event(job, c.Reason.WORKSPACE_NOT_KEPT)
    assert said["message"] == (
        f"workspace not kept: Succeeded and keep: OnFailure; its files are deleted on node {n1.name}"
    )
    assert list(volumes.records()) == [] and not (n1.root.path / namespace).exists()
    assert [p.name for p in n1.root.path.iterdir() if p.name.startswith(c.TOMBSTONE_PREFIX)] == []
    assert get(cluster, namespace, job.sandbox) is None


def test_a_deleted_pods_workspace_is_unknown_and_kept(cluster, namespace, nodes, agents, volumes):
    n1, _ = nodes
    job = Job(cluster, namespace, n1, n1.root.path.parent, Keep.ON_FAILURE)
    job.run(volumes)
    job.delete()
    agents(n1)
    obj = adopted(cluster, namespace, job.sandbox)
    assert obj["spec"]["origin"]["outcome"] == "Unknown" and obj["spec"]["origin"]["containers"] == []
    assert tree(n1.root.path / namespace / job.sandbox / c.WORKSPACE_DIR) == FILES
    said = event(job, c.Reason.WORKSPACE_KEPT)
    assert said["message"].endswith(": Unknown (its Pod is gone) and keep: OnFailure")


def test_recovery_keeps_a_volume_never_unpublished_whose_pod_is_gone_and_never_touches_a_mounted_one(
    cluster, namespace, nodes, agents, volumes
):
    n1, _ = nodes
    live = Job(cluster, namespace, n1, n1.root.path.parent, Keep.NEVER)
    lost = Job(cluster, namespace, n1, n1.root.path.parent, Keep.ALWAYS)
    for job in (live, lost):
        volumes.publish(job.req)
        Path(job.req.target_path, "out").write_text(job.name)
        job.delete()  # force-deleted while the kubelet was down: no unpublish comes
    unmount_under(Path(lost.req.target_path))  # the node rebooted: its mounts are gone, the records are not
    a = agents(n1)
    obj = adopted(cluster, namespace, lost.sandbox)
    assert obj["spec"]["origin"]["outcome"] == "Unknown"
    assert (n1.root.path / namespace / lost.sandbox / c.WORKSPACE_DIR / "out").read_text() == lost.name
    # the live one, in the same pass: still mounted, so in use, whatever its Pod and its keep: Never say
    assert a.proc.poll() is None
    assert len(mounts_at(live.req.target_path)) == 1
    assert Path(live.req.target_path, "out").read_text() == live.name
    assert [v.entry for v in volumes.records()] == [entry_name(live.req.volume_id)]
    assert live.events() == []
