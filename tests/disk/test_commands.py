"""`sandkeep exec` and the orphan reaper with real processes, real signals and real /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.cli import exec as sandkeep_exec
from controller.node.orphan_records import Mark, boot_id
from controller.node.orphans import Handle, orphan_pids, reap_orphans
from controller.node.store import Root
from tests.bed.procs import alive

SANDKEEP = [sys.executable, "-m", "controller.cli.sandkeep"]


def _start_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rfind(")") + 2 :].split()[19])


def _wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "job"
    src.mkdir()
    root = Root(tmp_path / "root")
    root.retain(src, "ns", "box", job_id="j1", created_at=datetime.now(UTC), retention=timedelta(hours=1))
    return root.path, root.path / "ns" / "box"


def _victim(pids: list[int], seconds: int, cwd: Path) -> subprocess.Popen[bytes]:
    """`sleep seconds` in a session of its own with its cwd in `cwd` (a sandbox's workspace, or elsewhere)."""
    victim = subprocess.Popen(["sleep", str(seconds)], cwd=cwd, start_new_session=True)
    pids.append(victim.pid)
    return victim


def _calls(calls: list[tuple[int, int]]) -> Callable[[Handle, int], None]:
    """A kill seam that signals nothing and notes (pid, signal); it checks each came with a pidfd."""

    def note(handle: Handle, sig: int) -> None:
        assert handle.fd is not None and os.fstat(handle.fd)  # signalled through an open pidfd
        calls.append((handle.pid, sig))

    return note


def _exec(root: Path, *cmd: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*SANDKEEP, "exec", "ns/box", "--root", str(root), "--", *cmd],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,  # type: ignore[call-overload]
    )


def _exec_recorded(
    root: Path, box: Path, script: str, members: int, pids: list[int]
) -> tuple[subprocess.Popen[str], dict[str, Any], list[dict[str, Any]]]:
    """`sandkeep exec sh -c script`, once it printed `ready` and its record names the leader and at least
    `members` descendants: (the exec, the record, leader and members). Every recorded pid is cleaned up."""
    p = _exec(root, "sh", "-c", script)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    _wait_for(lambda: len(_records(box)) == 1 and len(_records(box)[0]["members"]) >= members)
    record = _records(box)[0]
    marks = [record["leader"], *record["members"]]
    pids.extend(m["pid"] for m in marks)
    return p, record, marks


def _records(sandbox_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((sandbox_dir / ".commands").glob("*.json"))]


def _write_record(sandbox_dir: Path, name: str, body: object) -> None:
    d = sandbox_dir / ".commands"
    d.mkdir(mode=0o700, exist_ok=True)
    (d / name).write_text(body if isinstance(body, str) else json.dumps(body))


def _record_leader(sandbox_dir: Path, pid: int) -> None:
    """A record, of this boot, naming `pid` as a command's group leader, as a killed `sandkeep exec` leaves."""
    leader = {"pid": pid, "start": _start_ticks(pid)}
    _write_record(sandbox_dir, f"{pid}-1.json", {"boot": boot_id(), "leader": leader, "members": []})


def test_exec_runs_in_the_workspace_exits_with_the_code_and_leaves_no_record(sandbox):
    root, box = sandbox
    p = _exec(root, "sh", "-c", "pwd; exit 7")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 7, err
    assert out.strip() == str(box / "workspace")
    assert _records(box) == []


def test_a_killed_recorder_leaves_a_record_and_the_reaper_kills_group_and_descendants(sandbox, pids):
    root, box = sandbox
    # A background child in the group, one that left the group with setsid, and the leader itself.
    p, record, marks = _exec_recorded(root, box, "sleep 300 & setsid sleep 301 & echo ready; exec sleep 302", 2, pids)
    assert record["boot"] == boot_id()
    p.kill()  # the recorder dies; its command's processes run on in their own group / session
    p.wait(timeout=10)
    assert all(alive(m["pid"]) for m in marks)

    result = reap_orphans(box, timeout=10)

    assert result.survivors == ()
    assert result.signalled >= 2
    assert not any(alive(m["pid"]) for m in marks)
    assert _records(box) == []


def test_a_survivor_is_reported_with_its_command_line_and_stays_recorded(sandbox, pids):
    _root, box = sandbox
    victim = _victim(pids, 303, box / "workspace")
    _record_leader(box, victim.pid)
    calls: list[tuple[int, int]] = []

    result = reap_orphans(box, timeout=0.3, kill=_calls(calls))

    assert calls == [(victim.pid, signal.SIGKILL)]
    assert [(s.pid, s.command) for s in result.survivors] == [(victim.pid, "sleep 303")]
    assert len(_records(box)) == 1  # the next reap tries again
    # ... and a real reap later ends it
    assert reap_orphans(box, timeout=10).survivors == ()
    victim.wait(timeout=10)
    assert _records(box) == []


NEVER_SELF = """
import json, os, subprocess, sys
from pathlib import Path
from controller.node.orphan_records import boot_id
from controller.node.orphans import reap_orphans

def mark(pid):
    text = Path(f"/proc/{pid}/stat").read_text()
    return {"pid": pid, "start": int(text[text.rfind(")") + 2 :].split()[19])}

box, role = Path(sys.argv[1]), sys.argv[2]
if role == "leader":  # lead a group of our own and keep it alive while a member of it reaps
    sys.exit(subprocess.run([sys.executable, "-c", sys.argv[3], str(box), "reaper"]).returncode)
me, group = os.getpid(), os.getpgrp()
assert group != me  # the reaper's group is led by another, live process: the case under test
members = [mark(me)] + ([mark(1)] if os.access("/proc/1/stat", os.R_OK) else [])
records = {"a.json": {"boot": boot_id(), "leader": mark(group), "members": members},
           "b.json": {"boot": boot_id(), "leader": {"pid": 0, "start": 0}, "members": [{"pid": -1, "start": 0}]}}
for name, body in records.items():
    (box / ".commands" / name).write_text(json.dumps(body))
calls = []
result = reap_orphans(box, timeout=0.2, kill=lambda handle, sig: calls.append((handle.pid, sig)))
print(json.dumps({"calls": calls, "hold": result.hold, "survivors": sorted(s.pid for s in result.survivors)}))
"""


def test_never_pid_one_nor_itself_nor_its_own_group_or_session(sandbox):
    # Run as the leader of a session of its own (as the agent is in its pod), so "its own group" is a
    # live group whatever started the test run, working inside the sandbox (so only that rule protects
    # them), and let it record itself, its group's leader, pid 1, 0 and -1.
    _root, box = sandbox
    (box / ".commands").mkdir(mode=0o700, exist_ok=True)
    out = subprocess.run(
        [sys.executable, "-c", NEVER_SELF, str(box), "leader", NEVER_SELF],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
        cwd=box / "workspace",
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    seen = json.loads(out.stdout)
    assert seen["calls"] == []
    assert seen["hold"] == "OrphanUnproven" and seen["survivors"]  # never signalled, and said so


def test_records_of_another_boot_and_torn_records_are_dropped_without_signalling(sandbox, pids):
    _root, box = sandbox
    victim = subprocess.Popen(["sleep", "304"], start_new_session=True)
    pids.append(victim.pid)
    mark = {"pid": victim.pid, "start": _start_ticks(victim.pid)}
    _write_record(box, "old.json", {"boot": "another-boot", "leader": mark, "members": []})
    _write_record(box, "torn.json", '{"boot": "' + (boot_id() or "") + '", "lead')
    calls: list[tuple[int, int]] = []

    result = reap_orphans(box, timeout=0.2, kill=_calls(calls))

    assert calls == []
    assert result.dropped == 2
    assert _records(box) == []
    assert alive(victim.pid)


def test_a_record_of_a_pid_reused_by_another_process_is_not_signalled(sandbox, pids):
    _root, box = sandbox
    victim = _victim(pids, 305, box / "workspace")  # inside, in a session of its own: only its start differs
    stale = Mark(victim.pid, _start_ticks(victim.pid) - 1)  # same pid, another start: another process
    _write_record(box, "x.json", {"boot": boot_id(), "leader": {"pid": stale.pid, "start": stale.start}, "members": []})
    calls: list[tuple[int, int]] = []
    result = reap_orphans(box, timeout=0.2, kill=_calls(calls))
    assert calls == [] and result.survivors == () and result.hold is None
    assert alive(victim.pid)


def test_a_running_exec_is_not_an_orphan(sandbox, pids):
    root, box = sandbox
    p = _exec(root, "sh", "-c", "echo ready; exec sleep 306")
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    _wait_for(lambda: len(_records(box)) == 1)
    leader = _records(box)[0]["leader"]["pid"]
    pids.append(leader)
    calls: list[tuple[int, int]] = []
    reap_orphans(box, timeout=0.2, kill=_calls(calls))
    assert calls == []
    p.send_signal(signal.SIGTERM)  # forwarded to the command's group
    assert p.wait(timeout=10) == 128 + signal.SIGTERM
    assert not alive(leader)
    _wait_for(lambda: _records(box) == [])


def test_exec_reaps_what_a_killed_exec_left_before_starting(sandbox, pids):
    root, box = sandbox
    first, _record, marks = _exec_recorded(root, box, "sleep 307 & echo ready; exec sleep 308", 1, pids)
    left = [m["pid"] for m in marks]
    first.kill()
    first.wait(timeout=10)

    second = _exec(root, "true")
    assert second.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in left)
    assert _records(box) == []


def test_exec_refuses_to_start_beside_a_survivor_and_names_it(sandbox, pids, monkeypatch, capsys):
    import argparse

    root, box = sandbox
    victim = _victim(pids, 309, box / "workspace")
    _record_leader(box, victim.pid)
    monkeypatch.setattr(sandkeep_exec, "EXEC_KILL", [lambda target, sig: None])  # SIGKILL that does not kill
    marker = box / "workspace" / "ran"
    args = argparse.Namespace(
        rest=["ns/box", "--root", str(root), "--orphan-timeout", "1s", "--", "touch", str(marker)],
        root=None,
        orphan_timeout="10s",
    )
    assert sandkeep_exec.run("exec", args) == sandkeep_exec.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "refused to start (OrphanSurvivor)" in err and f"pid {victim.pid} (sleep 309)" in err
    assert f"kill -9 {victim.pid}" in err
    assert not marker.exists()


# --- orphan_pids: which processes a reap would end, read without signalling -----------------------------


def test_orphan_pids_lists_a_killed_recorders_live_group_and_nothing_while_it_runs(sandbox, pids):
    root, box = sandbox
    p, _record, marks = _exec_recorded(root, box, "sleep 310 & setsid sleep 311 & echo ready; exec sleep 312", 2, pids)
    recorded = {m["pid"] for m in marks}

    assert orphan_pids(box) == frozenset()  # its recorder holds the lock: a running command, not an orphan

    p.kill()
    p.wait(timeout=10)
    assert orphan_pids(box) == recorded
    assert all(alive(pid) for pid in recorded)  # only read: nothing was signalled
    assert len(_records(box)) == 1  # ... and nothing removed

    assert reap_orphans(box, timeout=10).survivors == ()
    assert orphan_pids(box) == frozenset()


def test_orphan_pids_names_nothing_for_another_boot_a_torn_record_or_a_reused_pid(sandbox, pids):
    _root, box = sandbox
    victims = [_victim(pids, 313 + i, box / "workspace") for i in range(2)]
    reused, orphan = ({"pid": v.pid, "start": _start_ticks(v.pid)} for v in victims)
    _write_record(box, "old.json", {"boot": "another-boot", "leader": reused, "members": []})
    _write_record(box, "torn.json", '{"boot": "' + (boot_id() or "") + '", "lead')
    stale = {"pid": reused["pid"], "start": reused["start"] - 1}  # same pid, another start: another process
    _write_record(box, "reused.json", {"boot": boot_id(), "leader": None, "members": [stale]})
    _write_record(box, "orphan.json", {"boot": boot_id(), "leader": orphan, "members": []})

    assert orphan_pids(box) == {orphan["pid"]}  # only the one a reap would kill by its record
    assert len(list((box / ".commands").glob("*.json"))) == 4  # read-only: even torn records stay
    assert all(alive(v.pid) for v in victims)
