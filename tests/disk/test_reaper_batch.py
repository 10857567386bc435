"""The pipeline's looks for many sandboxes at once (`Reaper.prepare`): one /proc pass for a wave of
deletions, never an answer older than `fresh_for` to rename on, and a held one among many still held.

Real directories, real processes, real /proc: the in-use answers are `inuse.scan_usage`'s.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controller.node.inuse import Usage, scan_usage
from controller.node.reaper import Claim, Deleted, Held, Reaper, Renamed, Target
from controller.node.store import Root
from controller.rules.contracts import Reason
from tests.bed.procs import IGNORE


class CountingScan:
    """The real /proc pass for many paths, counting how often it is asked."""

    def __init__(self) -> None:
        self.calls = 0
        self.sizes: list[int] = []

    def __call__(self, paths: Mapping[int, Path]) -> Mapping[int, Usage]:
        self.calls += 1
        self.sizes.append(len(paths))
        return scan_usage(paths, ignore={os.getpid(), *IGNORE})


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def retained(root: Root, count: int) -> list[Target]:
    targets = []
    for i in range(count):
        src = root.path.parent / f"job-{i}"
        (src / "logs").mkdir(parents=True)
        (src / "logs" / "out.txt").write_text("done\n")
        root.retain(src, "ns", f"run-{i}", job_id=f"job-{i}", created_at=datetime.now(UTC), retention=None)
        targets.append(Target("ns", f"run-{i}", f"uid-{i}", Claim(created_at=None), Reason.DELETED))
    return targets


def reaper(root: Root, scan: CountingScan, fresh_for: float = 60.0) -> Reaper:
    return Reaper(root, in_use_many=scan, fresh_for=fresh_for, orphan_timeout=timedelta(seconds=2))


def test_a_wave_of_deletions_costs_one_proc_pass_and_a_held_one_stays(
    tmp_path: Path, holders: list[subprocess.Popen[bytes]]
) -> None:
    root = Root(tmp_path / "root")
    targets = retained(root, 40)
    busy = root.sandbox_path("ns", "run-7") / "workspace"
    holders.append(subprocess.Popen(["sleep", "300"], cwd=busy))
    scan = CountingScan()
    steps = reaper(root, scan).prepare(targets)
    assert scan.calls == 1 and scan.sizes == [40]
    held = [s for s in steps if isinstance(s, Held)]
    assert len(held) == 1 and held[0].reason == Reason.IN_USE and busy.parent.is_dir()
    renamed = [s for s in steps if isinstance(s, Renamed)]
    assert len(renamed) == 39
    assert all(not root.sandbox_path(*r.target.key).exists() for r in renamed)  # aside, under a tombstone
    outcomes = [reaper(root, scan).finish(r) for r in renamed]
    assert all(isinstance(o, Deleted) for o in outcomes)
    assert sorted(p.name for p in (root.path / "ns").iterdir()) == ["run-7"]
    assert root.tombstones() == []


def test_an_answer_older_than_fresh_for_is_asked_again_before_the_next_rename(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    targets = retained(root, 5)
    scan = CountingScan()
    steps = reaper(root, scan, fresh_for=0.0).prepare(targets)  # never fresh enough past the first rename
    assert all(isinstance(s, Renamed) for s in steps) and len(steps) == 5
    assert scan.sizes == [5, 4, 3, 2, 1]  # each rename on a pass taken after the one before it


def test_a_holder_arriving_after_the_first_pass_holds_the_sandboxes_still_to_be_renamed(
    tmp_path: Path, holders: list[subprocess.Popen[bytes]]
) -> None:
    root = Root(tmp_path / "root")
    targets = retained(root, 3)
    scan = CountingScan()
    late = root.sandbox_path("ns", "run-2") / "workspace"

    def arrive(key: tuple[str, str], _tomb: object) -> None:
        if key == ("ns", "run-0"):  # right after the first rename, a process moves into run-2
            holders.append(subprocess.Popen(["sleep", "300"], cwd=late))

    pipeline = reaper(root, scan, fresh_for=0.0)
    pipeline.hooks.after_rename = arrive
    steps = pipeline.prepare(targets)
    assert [type(s).__name__ for s in steps] == ["Renamed", "Renamed", "Held"]
    assert late.is_dir()
