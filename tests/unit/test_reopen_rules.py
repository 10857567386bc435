"""rules/reopen.py's answer for a Pod's reopen volume: the same refusals as `kubectl sandkeep open`, as the CSI
status the kubelet shows in the Pod's Events, plus the node it must run on."""

from __future__ import annotations

from typing import Any

import pytest

from controller.rules import contracts as c
from controller.rules.reopen import volume_refusal


def sandbox(phase: str = "Retained", node: str = "node-a", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "run-42", "namespace": "team", **meta},
        "spec": {"nodeName": node},
        "status": {"phase": phase, "deadline": "2026-12-01T00:00:00Z"},
    }


def test_a_retained_sandbox_on_this_node_may_be_reopened() -> None:
    assert volume_refusal(sandbox(), "team", "run-42", "node-a") is None


def test_a_name_not_in_the_pods_namespace_is_not_found() -> None:
    code, message = volume_refusal(None, "team", "run-42", "node-a") or ("", "")
    assert code == "NOT_FOUND" and "RetainedSandbox team/run-42 does not exist" in message


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (sandbox(c.Phase.EXPIRED), ["is expired", "kubectl sandkeep pin run-42 -n team"]),
        (sandbox(deletionTimestamp="2026-12-01T00:00:00Z"), ["is being deleted"]),
        (sandbox(c.Phase.STUCK), ["is Stuck"]),
        (sandbox(c.Phase.LOST), ["is Lost"]),
        (sandbox(node="node-b"), ["is on node node-b", "kubernetes.io/hostname=node-b"]),
    ],
    ids=["expired", "deleting", "stuck", "lost", "other-node"],
)
def test_what_open_refuses_a_reopen_volume_refuses_with_failed_precondition(obj: Any, words: list[str]) -> None:
    code, message = volume_refusal(obj, "team", "run-42", "node-a") or ("", "")
    assert code == "FAILED_PRECONDITION"
    assert all(w in message for w in words), message
