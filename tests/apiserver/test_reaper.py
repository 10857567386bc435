"""The one deletion pipeline, through both of its callers: the same scenarios, the same behaviour.

Each scenario runs twice: through the standalone sweep on a real temp root (an expired manifest is the
request), and through a real `sandkeep agent` process against the real local control plane (a deleted
object is the request). Both must end the same way, said in one vocabulary (`Caller.outcome`):
"deleted", "held <Reason>" or "stuck", with the same directories and tombstones on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import pytest

from controller.cli.sweep import Sweeper, in_use_checker
from controller.node.store import Root
from controller.rules import contracts as c
from controller.rules.contracts import Reason
from controller.rules.durations import parse_duration
from controller.rules.policy import Policy
from tests.bed.agentkit import Node, adopted, cond, delete, get, orphans_of_a_killed_exec, wait_for
from tests.bed.diskkit import make_immutable
from tests.bed.procs import IGNORE
from tests.bed.procs import alive as _running

pytest_plugins = ["tests.bed.diskkit"]  # fixtures: immutable

D = timedelta(days=1)


def parse(text: str) -> timedelta:
    parsed = parse_duration(text)
    assert isinstance(parsed, timedelta)
    return parsed


class Caller(Protocol):
    root: Root
    namespace: str

    def retain(self, name: str, files: dict[str, str] | None = None) -> Path: ...
    def start(self, stuck_after: str = "2s") -> None: ...
    def ask(self, name: str) -> None: ...
    def outcome(self, name: str) -> str: ...
    def settle(self) -> None: ...


class SweepCaller:
    """The standalone sweep: a sandbox should go because its manifest expired ten days ago."""

    # `sandkeep exec` refuses an expired sandbox: its command ran back when it was live (a 30-day window)
    exec_flags = ("--retention", "30d")

    def __init__(self, tmp_path: Path) -> None:
        self.root = Root(tmp_path / "root")
        self.namespace = "ns"
        self.sweeper = Sweeper(
            self.root,
            Policy(timedelta(hours=72), 30 * D),
            in_use=in_use_checker(IGNORE),
            stuck_after=timedelta(seconds=2),
            orphan_timeout=timedelta(seconds=2),
        )
        self.last: dict[str, tuple[str, Reason]] = {}

    def retain(self, name: str, files: dict[str, str] | None = None) -> Path:
        src = self.root.path.parent / f"job-{name}"
        src.mkdir()
        for rel, text in (files or {"README": "hello"}).items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text(text)
        created = datetime.now(UTC) - 10 * D
        self.root.retain(src, self.namespace, name, job_id=f"job-{name}", created_at=created, retention=None)
        return self.root.sandbox_path(self.namespace, name)

    def start(self, stuck_after: str = "2s") -> None:
        self.sweeper.reaper.stuck_after = parse(stuck_after)

    def ask(self, name: str) -> None:
        pass  # expired already: the next pass deletes it

    def settle(self) -> None:
        for d in self.sweeper.run_pass().decisions:
            entry = d.detail.get("sandbox") or d.entry
            self.last[entry] = (d.action, d.reason)

    def outcome(self, name: str) -> str:
        self.settle()
        action, reason = self.last.get(f"{self.namespace}/{name}", ("none", Reason.RETAINED))
        if action == "held":
            return f"held {reason}"
        return action


class AgentCaller:
    """A real `sandkeep agent`: a sandbox should go because its object was deleted (`kubectl delete`)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.cluster = request.getfixturevalue("cluster")
        self.namespace: str = request.getfixturevalue("namespace")
        n1, _ = request.getfixturevalue("nodes")
        self.node: Node = n1
        self.root = n1.root
        self.agents: Callable[..., Any] = request.getfixturevalue("agents")
        self.agent: Any = None

    def retain(self, name: str, files: dict[str, str] | None = None) -> Path:
        return self.node.retain(self.namespace, name, files)

    def start(self, stuck_after: str = "2s") -> None:
        self.agent = self.agents(self.node, extra=["--stuck-after", stuck_after])

    def ask(self, name: str) -> None:
        adopted(self.cluster, self.namespace, name)
        delete(self.cluster, self.namespace, name)

    def settle(self) -> None:
        time.sleep(1.5)  # a pass runs every second

    def outcome(self, name: str) -> str:
        obj = get(self.cluster, self.namespace, name)
        if obj is None:
            return "deleted"
        phase = (obj.get("status") or {}).get("phase")
        if phase == str(c.Phase.STUCK):
            return "stuck"
        if phase == str(c.Phase.HELD):
            why = cond(obj, c.Condition.ORPHANS_SURVIVED) or cond(obj, c.Condition.IN_USE) or {}
            return f"held {why.get('reason')}"
        return f"pending {phase}"


@pytest.fixture(params=["sweep", pytest.param("agent", marks=pytest.mark.cluster)])
def caller(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Caller]:
    yield SweepCaller(tmp_path) if request.param == "sweep" else AgentCaller(request)


def until(caller: Caller, name: str, want: str, timeout: float = 30.0) -> None:
    wait_for(lambda: caller.outcome(name) == want, timeout, f"{name}: {want}")


def tombstones(root: Root) -> list[str]:
    return sorted(p.name for p in root.path.iterdir() if p.name.startswith(c.TOMBSTONE_PREFIX))


def test_a_sandbox_that_should_go_is_renamed_and_deleted(caller: Caller) -> None:
    path = caller.retain("plain", {"a/b.txt": "x", "c.txt": "y"})
    caller.start()
    caller.ask("plain")
    until(caller, "plain", "deleted")
    assert not path.exists() and tombstones(caller.root) == []


def test_a_process_working_inside_holds_it_until_it_exits(caller: Caller) -> None:
    path = caller.retain("busy")
    worker = subprocess.Popen(["sleep", "120"], cwd=path / "workspace")
    try:
        caller.start()
        caller.ask("busy")
        until(caller, "busy", f"held {Reason.IN_USE}")
        assert path.is_dir() and tombstones(caller.root) == []
    finally:
        worker.kill()
        worker.wait()
    until(caller, "busy", "deleted")
    assert not path.exists()


def test_recorded_orphans_of_a_killed_exec_are_reaped_then_it_is_deleted(caller: Caller) -> None:
    path = caller.retain("orphans")
    script = "sleep 210 & sleep 211 & echo ready; exec sleep 212"
    pids = orphans_of_a_killed_exec(caller, caller.namespace, "orphans", script)  # type: ignore[arg-type]
    try:
        assert all(_running(pid) for pid in pids)
        caller.start()
        caller.ask("orphans")
        until(caller, "orphans", "deleted")
        assert not path.exists() and tombstones(caller.root) == []
        assert not any(_running(pid) for pid in pids)
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, 9)


def test_a_forged_record_naming_a_process_elsewhere_holds_it_and_never_signals_it(
    caller: Caller, tmp_path: Path
) -> None:
    # issue 12, item 3: a record names a process that works outside the sandbox (as kubelet does). Both
    # callers hold the sandbox, say why, and the process lives.
    path = caller.retain("forged")
    (tmp_path / "elsewhere").mkdir()
    victim = subprocess.Popen(["sleep", "213"], cwd=tmp_path / "elsewhere", start_new_session=True)
    try:
        stat = Path(f"/proc/{victim.pid}/stat").read_text()
        mark = {"pid": victim.pid, "start": int(stat[stat.rfind(")") + 2 :].split()[19])}
        body = {"boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(), "leader": mark, "members": []}
        (path / c.COMMANDS_DIR / f"{victim.pid}-1.json").write_text(json.dumps(body))
        caller.start()
        caller.ask("forged")
        until(caller, "forged", f"held {Reason.ORPHAN_UNPROVEN}")
        assert path.is_dir() and tombstones(caller.root) == []
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.root
def test_an_undeletable_file_leaves_a_stuck_tombstone_that_goes_once_it_can(
    caller: Caller, immutable: list[Path]
) -> None:
    path = caller.retain("stuck", {"keep/immutable": "x", "other": "y"})
    make_immutable(immutable, path / "workspace" / "keep" / "immutable")
    caller.start()
    caller.ask("stuck")
    until(caller, "stuck", "stuck")
    (tomb,) = tombstones(caller.root)
    assert not path.exists()
    caller.settle()
    assert tombstones(caller.root) == [tomb]  # retried, still stuck, never anything else
    subprocess.run(["chattr", "-i", str(caller.root.path / tomb / "workspace" / "keep" / "immutable")], check=True)
    wait_for(lambda: caller.settle() or tombstones(caller.root) == [], 30, "the stuck tombstone deleted")
    assert not path.exists()


def test_a_young_tombstone_of_another_live_process_is_left_alone_and_a_clock_ahead_never_protects_one(
    caller: Caller,
) -> None:
    caller.retain("young")
    caller.retain("future")
    other = subprocess.Popen(["sleep", "120"])
    try:
        now = datetime.now(UTC)
        young = caller.root.tombstone(caller.namespace, "young", id=f"p{other.pid}-abcd1234", now=now)
        # Made "an hour from now" by a clock that was ahead: a negative age counts as old, not as young.
        future = caller.root.tombstone(caller.namespace, "future", id=f"p{other.pid}-dcba4321", now=now + D / 24)
        caller.start(stuck_after="1h")
        wait_for(lambda: caller.settle() or not future.path.exists(), 30, "the future-dated tombstone cleared")
        caller.settle()
        assert young.path.is_dir()  # its maker is alive and it is younger than stuck_after
    finally:
        other.kill()
        other.wait()
    wait_for(lambda: caller.settle() or not young.path.exists(), 30, "cleared once its maker is gone")
