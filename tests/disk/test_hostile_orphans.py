"""Hostile orphan records (issue 12, item 3): what a writer of the sandbox tree can aim the reaper at.

The reaper holds CAP_KILL with the node's pids in view, so a record is a claim, never a proof. Each test
forges what an attacker could write (a record naming a process elsewhere or of another session, records
too long, too many, in a place another account controls, generated garbage) next to real processes,
reaps with the real signal path, and checks that only the proven orphans died, the rest are alive, and
the sandbox is held with a reason. The legitimate `sandkeep exec` orphans are still reaped (the tests
in tests/disk/test_commands.py, and both callers in tests/apiserver/test_reaper.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.cli import exec as sandkeep_exec
from controller.node import orphan_records, orphans
from controller.node.orphan_records import MAX_MEMBERS, MAX_RECORD_BYTES, MAX_RECORDS, Mark, boot_id
from controller.node.orphans import orphan_pids, reap_orphans
from controller.rules.contracts import COMMANDS_DIR, Reason
from tests.bed.procs import alive
from tests.disk.test_commands import (  # the reaper's fixtures and helpers, shared rather than copied
    _calls,
    _exec_recorded,
    _record_leader,
    _records,
    _start_ticks,
    _victim,
    _wait_for,
    _write_record,
    sandbox,
)

__all__ = ["sandbox"]  # a fixture (pids comes from conftest)
NOBODY = 65534


def _mark(pid: int) -> dict[str, int]:
    return {"pid": pid, "start": _start_ticks(pid)}


def _orphan(box: Path, pids: list[int], seconds: int) -> subprocess.Popen[bytes]:
    """A real orphan as a killed `sandkeep exec` leaves one: a session leader working in the workspace."""
    return _victim(pids, seconds, box / "workspace")


def _elsewhere(tmp_path: Path, pids: list[int], seconds: int) -> subprocess.Popen[bytes]:
    """A process that is none of the sandbox's business (kubelet, another tenant): it works elsewhere."""
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    return _victim(pids, seconds, tmp_path / "elsewhere")


def test_a_forged_record_naming_a_process_outside_the_sandbox_never_signals_it_and_holds(sandbox, pids, tmp_path):
    _root, box = sandbox
    victim = _elsewhere(tmp_path, pids, 330)  # its own session's leader, as kubelet is: only where it works differs
    _write_record(box, "forged.json", {"boot": boot_id(), "leader": _mark(victim.pid), "members": []})

    assert orphan_pids(box) == frozenset()  # not an orphan the agent would discount either
    result = reap_orphans(box, timeout=1)  # the real signal path

    assert alive(victim.pid)
    assert result.signalled == 0 and result.hold == Reason.ORPHAN_UNPROVEN
    (survivor,) = result.survivors
    assert survivor.pid == victim.pid and survivor.why is not None and "cwd" in survivor.why
    assert len(_records(box)) == 1  # kept for a person to look at: it holds the sandbox until removed
    message = orphans.held_message("sandbox ns/box", result, 1)
    assert f"pid {victim.pid} (sleep 330)" in message and "not signalled" in message and "forged" in message


def test_a_process_inside_the_sandbox_but_of_another_session_is_not_signalled_with_the_real_orphan(sandbox, pids):
    # A record names a real orphan and, as its member, another process working in the same workspace (a
    # person's shell opened on the sandbox): the orphan dies, the other is never signalled and holds it.
    _root, box = sandbox
    orphan = _orphan(box, pids, 331)
    other = _orphan(box, pids, 332)  # inside too, but the leader of a session of its own
    body = {"boot": boot_id(), "leader": _mark(orphan.pid), "members": [_mark(other.pid)]}
    _write_record(box, f"{orphan.pid}-1.json", body)

    assert orphan_pids(box) == {orphan.pid}
    result = reap_orphans(box, timeout=10)

    orphan.wait(timeout=10)
    assert alive(other.pid) and result.signalled == 1
    assert result.hold == Reason.ORPHAN_UNPROVEN
    assert [(s.pid, "recorded session" in (s.why or "")) for s in result.survivors] == [(other.pid, True)]
    (record,) = _records(box)
    assert record["members"] == [_mark(other.pid)] and record["leader"]["pid"] == orphan.pid


def test_a_child_that_left_the_session_and_lost_its_parents_cannot_be_proven_and_holds(sandbox, pids):
    # Fail closed: `setsid` in a subshell that exits leaves a process neither of the session nor below
    # anything of it. It is recorded and inside, yet nothing the kernel says ties it to the command.
    root, box = sandbox
    script = "(setsid sleep 333 &); echo ready; exec sleep 334"
    p, record, _marks = _exec_recorded(root, box, script, 1, pids)
    leader = record["leader"]["pid"]

    def strays() -> list[int]:
        members = [m["pid"] for m in _records(box)[0]["members"] if alive(m["pid"])]
        return [pid for pid in members if orphan_records.command_line(Path("/proc"), pid) == "sleep 333"]

    _wait_for(lambda: len(strays()) == 1)  # recorded once `setsid` became the sleep (pruned of the subshell)
    stray = strays()
    pids.extend(stray)
    p.kill()
    p.wait(timeout=10)

    result = reap_orphans(box, timeout=10)

    assert not alive(leader)
    assert alive(stray[0])
    assert result.hold == Reason.ORPHAN_UNPROVEN and [s.pid for s in result.survivors] == stray


# --- records over the caps --------------------------------------------------------------------------------


def test_a_record_longer_than_any_recorder_writes_is_not_read_and_holds(sandbox, pids):
    _root, box = sandbox
    orphan = _orphan(box, pids, 335)
    body = json.dumps({"boot": boot_id(), "leader": _mark(orphan.pid), "members": []})
    _write_record(box, "long.json", body + " " * MAX_RECORD_BYTES)  # valid JSON, just too long to be ours

    result = reap_orphans(box, timeout=1)

    assert alive(orphan.pid) and result.signalled == 0
    assert result.hold == Reason.ORPHAN_RECORDS_OVER_LIMIT and result.refused[0].record == "long.json"
    assert (box / COMMANDS_DIR / "long.json").exists()


def test_a_record_naming_more_members_than_a_recorder_writes_is_not_acted_on(sandbox, pids):
    _root, box = sandbox
    orphan = _orphan(box, pids, 336)
    members = [{"pid": 4_000_000 - i, "start": 1} for i in range(MAX_MEMBERS + 1)]
    _write_record(box, "wide.json", {"boot": boot_id(), "leader": _mark(orphan.pid), "members": members})

    result = reap_orphans(box, timeout=1)

    assert alive(orphan.pid) and result.signalled == 0 and result.hold == Reason.ORPHAN_RECORDS_OVER_LIMIT


def test_records_beyond_the_count_cap_are_not_read_and_each_reap_makes_progress(sandbox, pids):
    _root, box = sandbox
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = {"pid": gone.pid, "start": 1}  # names nothing alive: a record a reap just removes
    extra = 40
    for i in range(MAX_RECORDS + extra):
        _write_record(box, f"r{i:04d}.json", {"boot": boot_id(), "leader": dead, "members": []})

    first = reap_orphans(box, timeout=1)

    assert first.hold == Reason.ORPHAN_RECORDS_OVER_LIMIT and first.signalled == 0
    assert len(list((box / COMMANDS_DIR).glob("*.json"))) == extra  # exactly MAX_RECORDS were read (and removed)
    assert reap_orphans(box, timeout=1).hold is None
    assert _records(box) == []


def test_a_directory_flooded_with_entries_is_not_listed_whole(sandbox, pids):
    _root, box = sandbox
    orphan = _orphan(box, pids, 337)
    _record_leader(box, orphan.pid)
    fd = os.open(box / COMMANDS_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(20_000):
            os.close(os.open(f".junk-{i:05d}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)

    result = reap_orphans(box, timeout=10)

    assert result.hold == Reason.ORPHAN_RECORDS_OVER_LIMIT and "entries" in result.refused[0].detail


_WORST = """
import json, resource, sys
from pathlib import Path
from controller.node.orphans import orphan_pids, reap_orphans

box = Path(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
pids = orphan_pids(box)
result = reap_orphans(box, timeout=0)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps([grown, sorted(pids), result.signalled, result.hold, len(result.survivors)]))
"""


@pytest.mark.parametrize("named", ["live processes elsewhere", "distinct dead pids"])
def test_the_most_a_forger_can_write_is_judged_in_bounded_memory(sandbox, pids, tmp_path, named):
    # MAX_RECORDS records of MAX_MEMBERS members each (262,144 marks, 13 MB of JSON): each live process is
    # read once per reap, each dead pid costs a set lookup, and nothing is held beyond what is alive.
    _root, box = sandbox
    victims = [_elsewhere(tmp_path, pids, 343) for _ in range(8)]
    marks = [_mark(v.pid) for v in victims]
    for i in range(MAX_RECORDS):
        if named == "live processes elsewhere":
            members = [marks[j % len(marks)] for j in range(MAX_MEMBERS)]
        else:
            members = [{"pid": 4_000_000 - i * MAX_MEMBERS - j, "start": 7} for j in range(MAX_MEMBERS)]
        _write_record(box, f"r{i:03d}.json", {"boot": boot_id(), "leader": marks[i % len(marks)], "members": members})
    out = subprocess.run(
        [sys.executable, "-c", _WORST, str(box)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    grown_kib, orphans, signalled, hold, survivors = json.loads(out.stdout)
    assert grown_kib < 16 * 1024, f"peak RSS grew {grown_kib} KiB"
    assert orphans == [] and signalled == 0 and hold == Reason.ORPHAN_UNPROVEN and survivors == len(victims)
    assert all(alive(v.pid) for v in victims)


def test_the_largest_record_a_recorder_can_write_fits_the_cap() -> None:
    biggest = Mark(orphan_records.PID_MAX, (1 << 64) - 1)
    body = orphan_records.record_body("f" * 36, biggest, [biggest] * MAX_MEMBERS)
    assert len(json.dumps(body).encode()) <= MAX_RECORD_BYTES


def test_a_recorder_of_a_command_with_more_processes_than_the_cap_records_the_cap_and_its_session_is_reaped(
    sandbox, pids, monkeypatch, caplog
):
    # The record stays bounded however many processes the command starts; those it could not record are
    # still of the command's session, which the reaper reaches through /proc (the old kill(-pgid)).
    caplog.set_level(logging.WARNING, "sandkeep")
    monkeypatch.setattr(orphan_records, "MAX_MEMBERS", 3)
    _root, box = sandbox
    script = "for i in 1 2 3 4 5 6; do sleep 338 & done; echo ready; wait"
    leader = subprocess.Popen(
        ["sh", "-c", script], cwd=box / "workspace", start_new_session=True, stdout=subprocess.PIPE
    )
    pids.append(leader.pid)
    assert leader.stdout is not None and leader.stdout.readline().strip() == b"ready"
    with orphan_records.open_commands_dir(box, create=False) as cfd:
        assert cfd is not None
        recorder = orphan_records.Recorder(cfd, Mark(leader.pid, _start_ticks(leader.pid)), boot_id() or "")
        assert recorder.walk()
        (record,) = _records(box)
        assert len(record["members"]) == 3
        assert len([m for m in caplog.messages if m.startswith("record_full")]) == 1
        assert recorder.walk()  # said once
        assert len([m for m in caplog.messages if m.startswith("record_full")]) == 1
        os.close(recorder.lock_fd)  # the recorder dies: its record is an orphan's
    children = [int(c) for c in Path(f"/proc/{leader.pid}/task/{leader.pid}/children").read_text().split()]
    pids.extend(children)
    assert len(children) == 6

    result = reap_orphans(box, timeout=10)

    leader.wait(timeout=10)
    assert result.hold is None and result.signalled == 7
    assert not any(alive(pid) for pid in children)
    assert _records(box) == []


# --- records where another account could have written them ----------------------------------------------


def _untrusted_commands_dir(box: Path, tmp_path: Path, how: str) -> None:
    commands_dir = box / COMMANDS_DIR
    if how == "a link to a directory elsewhere":
        (tmp_path / "planted").mkdir(mode=0o700)
        for f in commands_dir.iterdir():
            f.rename(tmp_path / "planted" / f.name)
        commands_dir.rmdir()
        commands_dir.symlink_to(tmp_path / "planted")
    elif how == "writable by everyone":
        commands_dir.chmod(0o777)
    elif how == "owned by another uid":
        os.chown(commands_dir, NOBODY, NOBODY)


def _untrusted_record(box: Path, tmp_path: Path, how: str, pid: int) -> None:
    body = json.dumps({"boot": boot_id(), "leader": _mark(pid), "members": []})
    record = box / COMMANDS_DIR / f"{pid}-1.json"
    if how == "a link to a file elsewhere":
        (tmp_path / "planted.json").write_text(body)
        record.symlink_to(tmp_path / "planted.json")
    elif how == "a FIFO":
        os.mkfifo(record, 0o600)  # opening it for reading would block a reaper that waited for a writer
    elif how == "writable by everyone":
        record.write_text(body)
        record.chmod(0o666)
    elif how == "owned by another uid":
        record.write_text(body)
        os.chown(record, NOBODY, NOBODY)


@pytest.mark.parametrize("how", ["a link to a directory elsewhere", "writable by everyone", "owned by another uid"])
def test_records_in_a_commands_dir_another_account_controls_are_not_acted_on(sandbox, pids, tmp_path, how):
    _root, box = sandbox
    orphan = _orphan(box, pids, 339)  # a real orphan: only where its record sits is wrong
    _record_leader(box, orphan.pid)
    _untrusted_commands_dir(box, tmp_path, how)

    assert orphan_pids(box) == frozenset()
    result = reap_orphans(box, timeout=1)

    assert alive(orphan.pid) and result.signalled == 0
    assert result.hold == Reason.ORPHAN_RECORDS_UNTRUSTED and result.refused[0].record == ""


@pytest.mark.parametrize(
    "how", ["a link to a file elsewhere", "a FIFO", "writable by everyone", "owned by another uid"]
)
def test_a_record_another_account_could_have_written_is_not_acted_on(sandbox, pids, tmp_path, how):
    _root, box = sandbox
    orphan = _orphan(box, pids, 340)
    (box / COMMANDS_DIR).mkdir(mode=0o700, exist_ok=True)
    _untrusted_record(box, tmp_path, how, orphan.pid)

    result = reap_orphans(box, timeout=1)

    assert alive(orphan.pid) and result.signalled == 0
    assert result.hold == Reason.ORPHAN_RECORDS_UNTRUSTED and result.refused[0].record == f"{orphan.pid}-1.json"


def test_exec_refuses_to_start_beside_records_it_does_not_trust_and_signals_nothing(sandbox, pids, capsys):
    import argparse

    root, box = sandbox
    orphan = _orphan(box, pids, 342)
    _record_leader(box, orphan.pid)
    (box / COMMANDS_DIR).chmod(0o777)
    marker = box / "workspace" / "ran"
    args = argparse.Namespace(
        rest=["ns/box", "--root", str(root), "--", "touch", str(marker)], root=None, orphan_timeout="1s"
    )
    assert sandkeep_exec.run("exec", args) == sandkeep_exec.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "refused to start" in err and "others may write it" in err and "remove them" in err
    assert not marker.exists() and alive(orphan.pid)


# --- generated garbage ---------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["pid", "start", "x"]), inner),
    max_leaves=12,
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    leader=_json | st.sampled_from(["victim", "self"]),
    members=st.lists(_json | st.sampled_from(["victim", "victim-pid-only", "self"]), max_size=5),
    nested=st.integers(0, 40_000),
)
def test_generated_records_never_signal_a_process_outside_the_sandbox_and_never_crash(
    sandbox, tmp_path, leader: Any, members: list[Any], nested: int
) -> None:
    _root, box = sandbox
    seen: list[int] = []
    victim = _elsewhere(tmp_path, seen, 341)
    try:
        named = {"victim": _mark(victim.pid), "victim-pid-only": {"pid": victim.pid}, "self": _mark(os.getpid())}
        body = {
            "boot": boot_id(),
            "leader": named.get(leader, leader) if isinstance(leader, str) else leader,
            "members": [named.get(m, m) if isinstance(m, str) else m for m in members],
        }
        _write_record(box, "generated.json", json.dumps(body))
        _write_record(box, "nested.json", "[" * nested)  # deeper than json's recursion limit goes
        calls: list[tuple[int, int]] = []
        result = reap_orphans(box, timeout=0.1, kill=_calls(calls))
        assert calls == [] and result.signalled == 0 and alive(victim.pid)
    finally:
        victim.kill()
        victim.wait()
        for f in (box / COMMANDS_DIR).iterdir():
            f.unlink()
