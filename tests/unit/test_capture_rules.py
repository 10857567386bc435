"""The capture decision (controller/rules/capture.py): how a Pod ended, whether its workspace is kept, under which
name, and what `spec.origin` says; total on any Pod object (hypothesis), since nothing from the API is trusted."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.rules.capture import (
    WAIT_FOR_END,
    decide,
    exit_codes,
    job_id_of,
    kept_name,
    kept_names,
    origin_of,
    outcome_of,
    pod_volume,
    should_keep,
)
from controller.rules.contracts import ORIGIN_CONTAINERS_MAX, ORIGIN_LABELS, Keep, Outcome
from controller.rules.models import IMAGE_MAX, Manifest, Origin, is_namespace_name

LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def pod(phase: str = "Running", codes: dict[str, int | None] | None = None, **meta: Any) -> dict[str, Any]:
    """A Pod as the API serves it: containers by name, each terminated with its code (None: still running)."""
    codes = {"main": 0} if codes is None else codes
    statuses = [
        {
            "name": n,
            "image": f"img/{n}",
            "state": {"running": {}} if code is None else {"terminated": {"exitCode": code}},
        }
        for n, code in codes.items()
    ]
    return {
        "metadata": {"name": "build-42-x7k2p", "uid": "u-1", **meta},
        "spec": {"nodeName": "node-a", "containers": [{"name": n, "image": f"img/{n}:1"} for n in codes]},
        "status": {"phase": phase, "containerStatuses": statuses},
    }


# --- how a Pod ended -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (pod("Succeeded"), Outcome.SUCCEEDED),
        (pod("Failed", {"main": 0}), Outcome.FAILED),  # the phase wins over the codes
        (pod("Running", {"main": 0, "side": 0}), Outcome.SUCCEEDED),  # all terminated, before the phase is posted
        (pod("Running", {"main": 0, "side": 137}), Outcome.FAILED),
        (pod("Running", {"main": 1, "side": None}), None),  # one still running: not decided yet
        (pod("Pending", {}), None),
        (pod("Running", {"main": 0}, deletionTimestamp="2026-01-01T00:00:00Z"), Outcome.UNKNOWN),
        (None, Outcome.UNKNOWN),
        ("not a pod", Outcome.UNKNOWN),
    ],
    ids=["succeeded", "failed-phase", "codes-0", "codes-137", "one-running", "pending", "deleted", "none", "garbage"],
)
def test_the_outcome_is_the_phase_else_every_containers_exit_code(obj: Any, expected: Outcome | None) -> None:
    assert outcome_of(obj) == expected


def test_a_container_without_a_status_is_not_ended() -> None:
    p = pod("Running", {"main": 0})
    p["spec"]["containers"].append({"name": "late"})
    assert exit_codes(p) is None and outcome_of(p) is None


@pytest.mark.parametrize(
    ("keep", "kept"),
    [
        (Keep.ALWAYS, {Outcome.SUCCEEDED, Outcome.FAILED, Outcome.UNKNOWN}),
        (Keep.ON_FAILURE, {Outcome.FAILED, Outcome.UNKNOWN}),
        (Keep.NEVER, set()),
    ],
)
def test_unknown_is_kept_unless_never(keep: Keep, kept: set[Outcome]) -> None:
    assert {o for o in Outcome if should_keep(keep, o)} == kept


# --- the decision ----------------------------------------------------------------------------------------------
def test_a_pod_not_yet_ended_is_looked_at_again_until_the_bound_then_unknown_and_kept() -> None:
    running = pod("Running", {"main": None})
    assert decide(Keep.ON_FAILURE, running, waited=timedelta(seconds=5)) is None
    late = decide(Keep.ON_FAILURE, running, waited=WAIT_FOR_END)
    assert late is not None and late.keep and late.outcome is Outcome.UNKNOWN
    assert late.why == "Unknown (its Pod did not report how it ended within 2m) and keep: OnFailure"


def test_a_success_with_keep_on_failure_is_not_kept_and_says_why() -> None:
    decision = decide(Keep.ON_FAILURE, pod("Succeeded"), waited=timedelta(0))
    assert decision is not None and not decision.keep
    assert decision.why == "Succeeded and keep: OnFailure"


def test_a_pod_that_is_gone_is_unknown_and_kept() -> None:
    decision = decide(Keep.ON_FAILURE, None, waited=timedelta(0))
    assert decision is not None and decision.keep and decision.outcome is Outcome.UNKNOWN
    assert decision.why == "Unknown (its Pod is gone) and keep: OnFailure"
    never = decide(Keep.NEVER, None, waited=None)
    assert never is not None and not never.keep


def test_a_volume_never_unpublished_waits_for_its_pods_final_phase_however_long() -> None:
    # after a reboot a running Pod's containers show as terminated until the kubelet starts them again
    rebooted = pod("Running", {"main": 255})
    assert decide(Keep.ALWAYS, rebooted, waited=None) is None
    ended = decide(Keep.ON_FAILURE, pod("Failed", {"main": 2}), waited=None)
    assert ended is not None and ended.keep and ended.outcome is Outcome.FAILED
    gone = decide(Keep.ON_FAILURE, None, waited=None)
    assert gone is not None and gone.keep and gone.outcome is Outcome.UNKNOWN


# --- names ---------------------------------------------------------------------------------------------------
def test_the_kept_name_is_the_pods_shortened_with_a_hash_of_uid_and_volume() -> None:
    name = kept_name("build-42-x7k2p", "u-1", "csi-abc")
    assert re.fullmatch(r"build-42-x7k2p-[0-9a-f]{5}", name)
    assert name == kept_name("build-42-x7k2p", "u-1", "csi-abc")
    assert name != kept_name("build-42-x7k2p", "u-2", "csi-abc") != kept_name("build-42-x7k2p", "u-1", "csi-abd")
    long = kept_name("a." * 120 + "b", "u", "v")
    assert len(long) == 63 and LABEL.fullmatch(long)


def test_a_chosen_name_comes_first_then_the_generated_ones() -> None:
    names = kept_names("results", "build-42", "u", "v")
    assert names[0] == "results" and names[1].startswith("results-") and len(names) == 3
    assert kept_names(None, "build-42", "u", "v")[0].startswith("build-42-")


@given(st.text(max_size=300), st.text(max_size=80), st.text(max_size=200))
def test_a_kept_name_is_always_a_dns_label(base: str, uid: str, volume: str) -> None:
    name = kept_name(base, uid, volume)
    assert len(name) <= 63 and LABEL.fullmatch(name) and is_namespace_name(name)


# --- the origin ----------------------------------------------------------------------------------------------
def test_the_origin_names_the_pod_owner_node_containers_outcome_and_pipeline_labels() -> None:
    p = pod("Failed", {"main": 2, "side": 0})
    p["metadata"]["labels"] = {"job-name": "build-42", "tekton.dev/taskRun": "tr-1", "app": "x"}
    p["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "not-the-controller"},
        {"kind": "Job", "name": "build-42", "controller": True},
    ]
    origin = origin_of(p, Outcome.FAILED, pod_name="build-42-x7k2p", pod_uid="u-1", node="ignored")
    assert origin.body() == {
        "pod": "build-42-x7k2p",
        "podUID": "u-1",
        "owner": {"kind": "Job", "name": "build-42"},
        "node": "node-a",
        "containers": [
            {"name": "main", "image": "img/main:1", "exitCode": 2},
            {"name": "side", "image": "img/side:1", "exitCode": 0},
        ],
        "outcome": "Failed",
        "labels": {"job-name": "build-42", "tekton.dev/taskRun": "tr-1"},
    }
    assert job_id_of(origin) == "Job/build-42"


def test_the_origin_records_where_each_container_worked_and_mounted_the_workspace_whole() -> None:
    p = pod("Failed", {"build": 1, "side": 0, "sub": 0})
    mounts = {
        "build": [{"name": "cache", "mountPath": "/cache"}, {"name": "workspace", "mountPath": "/src"}],
        "side": [{"name": "workspace", "mountPath": "/w", "subPath": "logs"}],  # a part of it: not "as the job was"
        "sub": [{"name": "workspace", "mountPath": "/" + "x" * 600}],  # too long to record whole: left out
    }
    p["spec"]["containers"] = [
        {"name": n, "image": f"img/{n}:1", "volumeMounts": m, **({"workingDir": "/src/app"} if n == "build" else {})}
        for n, m in mounts.items()
    ]
    target = "/var/lib/kubelet/pods/0f1e-22/volumes/kubernetes.io~csi/workspace/mount"
    origin = origin_of(p, Outcome.FAILED, pod_name="p", pod_uid="u", node=None, volume=pod_volume(target))
    assert [(cn.working_dir, cn.mount_path) for cn in origin.containers] == [
        ("/src/app", "/src"),
        (None, None),
        (None, None),
    ]
    assert origin.body()["containers"][0] == {
        "name": "build",
        "image": "img/build:1",
        "exitCode": 1,
        "workingDir": "/src/app",
        "mountPath": "/src",
    }
    unnamed = origin_of(p, Outcome.FAILED, pod_name="p", pod_uid="u", node=None, volume=None)
    assert [cn.mount_path for cn in unnamed.containers] == [None, None, None]


@pytest.mark.parametrize(
    ("target", "name"),
    [
        ("/var/lib/kubelet/pods/0f1e/volumes/kubernetes.io~csi/workspace/mount", "workspace"),
        ("/k/pods/u/volumes/kubernetes.io~csi/ws/mount/", "ws"),
        ("/var/lib/kubelet/pods/0f1e/volumes/kubernetes.io~empty-dir/workspace/mount", None),
        ("/elsewhere/mount", None),
        ("/k/pods/u/volumes/kubernetes.io~csi//mount", None),
    ],
)
def test_the_pods_name_for_its_volume_is_read_from_the_kubelets_target_path(target: str, name: str | None) -> None:
    assert pod_volume(target) == name


def test_the_origin_of_a_pod_that_is_gone_is_what_the_kubelet_said() -> None:
    origin = origin_of(None, Outcome.UNKNOWN, pod_name="p", pod_uid="u", node="node-b")
    assert origin.body() == {
        "pod": "p",
        "podUID": "u",
        "node": "node-b",
        "containers": [],
        "outcome": "Unknown",
        "labels": {},
    }
    assert job_id_of(origin) == "Pod/p"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)
pod_keys = st.sampled_from(["metadata", "spec", "status", "containers", "containerStatuses", "name", "phase"])
pod_like = st.recursive(
    st.none() | st.integers(min_value=-(2**40), max_value=2**40) | st.text(max_size=700) | st.booleans(),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(pod_keys | st.text(max_size=8), inner, max_size=6),
    max_leaves=60,
)


@given(st.one_of(json_values, pod_like), st.sampled_from(list(Keep)), st.none() | st.timedeltas())
def test_nothing_a_pod_object_says_makes_the_decision_raise(obj: Any, keep: Keep, waited: timedelta | None) -> None:
    outcome = outcome_of(obj)
    assert outcome is None or outcome in Outcome
    decide(keep, obj, waited=waited)
    origin = origin_of(obj, outcome or Outcome.UNKNOWN, pod_name="p", pod_uid="u", node=None)
    assert Origin.model_validate(origin.body()) == origin


@given(
    st.lists(st.tuples(st.text(max_size=100), st.text(max_size=900), st.integers()), max_size=40),
    st.dictionaries(st.sampled_from([*ORIGIN_LABELS, "other"]), st.text(max_size=200)),
    st.text(max_size=400),
)
def test_the_origin_is_bounded_whatever_the_pod(
    containers: list[tuple[str, str, int]], labels: dict[str, str], name: str
) -> None:
    p = {
        "metadata": {"labels": labels},
        "spec": {"containers": [{"name": n, "image": i} for n, i, _ in containers], "nodeName": name},
        "status": {
            "containerStatuses": [{"name": n, "state": {"terminated": {"exitCode": x}}} for n, _, x in containers]
        },
    }
    for container in p["spec"]["containers"]:
        container |= {"workingDir": name, "volumeMounts": [{"name": "w", "mountPath": name}]}
    origin = origin_of(p, Outcome.FAILED, pod_name=name, pod_uid=name, node=name, volume="w")
    assert Origin.model_validate(origin.body()) == origin
    assert all(cn.mount_path in (None, name) and len(cn.mount_path or "") <= 512 for cn in origin.containers)
    assert len(origin.containers) <= ORIGIN_CONTAINERS_MAX
    assert all(len(cn.name) <= 63 and len(cn.image) <= IMAGE_MAX for cn in origin.containers)
    assert set(origin.labels) <= set(ORIGIN_LABELS) and all(len(v) <= 63 for v in origin.labels.values())
    assert len(origin.pod) <= 253 and (origin.node is None or len(origin.node) <= 253)


# --- the manifest ------------------------------------------------------------------------------------------------
def test_a_manifest_without_an_origin_reads_and_writes_as_before() -> None:
    old = '{"schemaVersion": 1, "namespace": "ns", "name": "run", "createdAt": "2026-01-01T00:00:00Z"}'
    manifest = Manifest.model_validate_json(old)
    assert manifest.origin is None and "origin" not in manifest.to_json()


def test_a_manifest_with_an_origin_that_does_not_fit_keeps_the_manifest_and_drops_the_origin() -> None:
    text = '{"schemaVersion": 1, "namespace": "ns", "name": "run", "origin": {"pod": "p", "outcome": "Maybe"}}'
    manifest = Manifest.model_validate_json(text)
    assert (manifest.name, manifest.origin) == ("run", None)
    good = origin_of(pod("Failed"), Outcome.FAILED, pod_name="p", pod_uid="u", node=None)
    again = Manifest.model_validate_json(Manifest(namespace="ns", name="run", origin=good).to_json())
    assert again.origin == good
