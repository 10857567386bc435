"""A sandbox too slow to measure whole (issue 25, item 8): its size is what was counted, said and still counted.

The pure parts (the condition's words, the status the agent writes, what disk pressure and the quota see) run
without a server; one test runs a real `sandkeep agent` against the real API server with `--size-budget 1s`
on a sandbox that takes longer to walk.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest

from controller.agent import AgentSettings, command
from controller.agent.decide import OWNED_CONDITIONS, size_partial
from controller.agent.relief import Relief
from controller.agent.report import Reporter
from controller.agent.sizer import Sizer
from controller.agent.state import AgentState, Shared
from controller.node.inuse import Usage
from controller.node.store import Root
from controller.node.treesize import TreeSize
from controller.rules import contracts as c
from controller.rules.contracts import Reason
from controller.rules.policy import Quota
from controller.rules.pressure import Disk, Watermarks, choose
from controller.rules.quota import choose as choose_quota
from tests.bed.agentkit import Node, cond, get, wait_for

KEY = ("team", "big")
SLOW = TreeSize(7 << 30, 123_456, False, Reason.SIZE_TOO_SLOW)


def sandbox(name: str = "big", days_old: int = 10) -> dict[str, Any]:
    created = (datetime.now(UTC) - timedelta(days=days_old)).isoformat().replace("+00:00", "Z")
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {"nodeName": "n1", "createdAt": created},
        "status": {},
    }


def shared(tmp_path: Path, sizes: dict[tuple[str, str], TreeSize]) -> Shared:
    settings = AgentSettings(node="n1", root=tmp_path, size_budget=timedelta(minutes=2))
    state = AgentState()
    for key in sizes:
        state.objects[key] = sandbox(key[1])
        state.present.add(key)
        state.usage[key] = Usage(False)
    return Shared(settings, cast(Any, None), Root(tmp_path), cast(Any, None), state, lambda: sizes)


# --- the words and the status ---------------------------------------------------------------------------------


def test_a_complete_size_needs_no_condition() -> None:
    assert size_partial("team/big", "n1", TreeSize(10, 1), timedelta(minutes=2)) is None


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        (Reason.SIZE_TOO_SLOW, "longer than --size-budget (2m)"),
        (Reason.SIZE_INTERRUPTED, "changed under the walk"),
        (Reason.SIZE_UNREADABLE, "could not be opened or read"),
    ],
)
def test_a_partial_size_says_why_what_was_counted_and_that_it_is_still_counted(reason: Reason, words: str) -> None:
    said = size_partial("team/big", "n1", TreeSize(7 << 30, 123_456, False, reason), timedelta(minutes=2))
    assert said is not None
    got, message = said
    assert got == reason and words in message
    assert message.startswith("sandbox team/big on node n1: ") and "7.0G in 123456 files" in message
    assert "lower bound" in message and "quota" in message and "disk pressure" in message
    assert ("agent.sizeBudget" in message) == (reason == Reason.SIZE_TOO_SLOW)


def test_the_agent_reports_a_partial_size_as_its_size_with_condition_size_partial(tmp_path: Path) -> None:
    report = Reporter(shared(tmp_path, {KEY: SLOW}))
    status = report.observed_status(sandbox())
    assert status["sizeBytes"] == 7 << 30 and status["fileCount"] == 123_456 and status["size"] == "7.0G"
    partial = [x for x in status["conditions"] if x["type"] == c.Condition.SIZE_PARTIAL]
    assert len(partial) == 1 and partial[0]["status"] == "True" and partial[0]["reason"] == Reason.SIZE_TOO_SLOW
    whole = Reporter(shared(tmp_path, {KEY: TreeSize(7 << 30, 123_456)})).observed_status(sandbox())
    assert all(x["type"] != c.Condition.SIZE_PARTIAL for x in whole["conditions"])  # applied away once whole
    assert c.Condition.SIZE_PARTIAL in OWNED_CONDITIONS


# --- what disk pressure and the quota count ---------------------------------------------------------------------


def test_disk_pressure_counts_a_partial_size_and_can_release_it(tmp_path: Path) -> None:
    relief = Relief(shared(tmp_path, {KEY: SLOW, ("team", "young"): TreeSize(1 << 20, 1)}), cast(Any, None), dict)
    by_key = {cand.key: cand for cand in relief.candidates(datetime.now(UTC))}
    assert by_key[KEY].size == 7 << 30  # never None ("not measured": never chosen)
    disk = Disk(size=10 << 30, available=1 << 30)  # 90% used
    plan = choose(disk, Watermarks(85, 80), by_key.values())
    assert plan.release == (KEY,) and plan.relieved


def test_the_quota_counts_a_partial_size_reported_as_size_bytes(tmp_path: Path) -> None:
    relief = Relief(shared(tmp_path, {KEY: SLOW}), cast(Any, None), dict)
    plan = choose_quota(Quota(max_bytes=1 << 30), relief.candidates(datetime.now(UTC)))
    assert plan.before.bytes == 7 << 30 and plan.release == (KEY,) and plan.within


# --- the sizer thread and the flag -------------------------------------------------------------------------------


def test_the_sizer_measures_with_its_budget_and_keeps_the_partial_size(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    asked: list[float | None] = []

    def usage(namespace: str, name: str, budget: float | None = None) -> TreeSize:
        asked.append(budget)
        return SLOW

    root.usage = usage  # type: ignore[method-assign]
    changed: list[tuple[str, str]] = []
    sizer = Sizer(root, changed.append, budget=120.0)
    sizer.measure_one(KEY)
    assert asked == [120.0] and sizer.sizes[KEY] == SLOW and changed == [KEY]


def test_a_measurement_that_raises_does_not_end_the_sizer_thread(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    calls: list[str] = []

    def usage(namespace: str, name: str, budget: float | None = None) -> TreeSize:
        calls.append(name)
        if name == "bad":
            raise AssertionError("a bug in the walk")
        return TreeSize(4096, 1)

    root.usage = usage  # type: ignore[method-assign]
    sizer = Sizer(root, lambda key: None)
    sizer.start()
    sizer.request([("team", "bad"), ("team", "good")])
    sizer.stop()
    sizer.join(timeout=10)
    assert calls == ["bad", "good"] and sizer.sizes == {("team", "good"): TreeSize(4096, 1)}


def test_the_size_budget_is_a_flag_and_an_env_var_defaulting_to_two_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    command.add_arguments("agent", parser)
    assert command.settings_from(parser.parse_args([])).size_budget == timedelta(minutes=2)
    assert command.settings_from(parser.parse_args(["--size-budget", "30s"])).size_budget == timedelta(seconds=30)
    monkeypatch.setenv("SANDKEEP_SIZE_BUDGET", "5m")
    assert command.settings_from(parser.parse_args([])).size_budget == timedelta(minutes=5)


# --- against the real API server ----------------------------------------------------------------------------------


@pytest.mark.cluster
def test_a_sandbox_too_slow_to_measure_reports_what_was_counted_and_says_so(
    cluster: Any, namespace: str, crd: None, tmp_path: Path, agents: Any
) -> None:
    node = Node(cluster, tmp_path, "slow")
    node.retain(namespace, "small")
    src = tmp_path / "job-big"
    (src / "w").mkdir(parents=True)
    fd = os.open(src / "w", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(150_000):  # ~15 us each to open and read: seconds of walking, against a budget of 1s
            os.mkdir(f"d{i}", dir_fd=fd)
    finally:
        os.close(fd)
    node.root.retain(
        src, namespace, "big", job_id="job-big", created_at=datetime.now(UTC), retention=timedelta(hours=1)
    )
    agents(node, extra=["--size-budget", "1s"])

    def partial() -> dict[str, Any] | None:
        o = get(cluster, namespace, "big")
        return o if o and (cond(o, c.Condition.SIZE_PARTIAL) or {}).get("status") == "True" else None

    big = wait_for(partial, timeout=120, what="SizePartial on the big sandbox")
    said = cond(big, c.Condition.SIZE_PARTIAL) or {}
    assert said["reason"] == Reason.SIZE_TOO_SLOW and "--size-budget (1s)" in said["message"]
    assert big["status"]["sizeBytes"] > 4096  # what was counted, never 0
    small = wait_for(
        lambda: (o := get(cluster, namespace, "small")) and "sizeBytes" in o.get("status", {}) and o, what="small"
    )
    assert cond(small, c.Condition.SIZE_PARTIAL) is None
