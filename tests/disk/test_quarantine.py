"""Quarantine's bookkeeping (pure) and `Reaper.reap_unadoptable` on a real root, real links and processes.

The agent's end-to-end behaviour (a real API server, a real `sandkeep agent`) is in
tests/apiserver/test_agent_adoption.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controller.agent.quarantine import MAX_RECORDS, Record, Sighting, advance, due, dumps, loads
from controller.node.inuse import scan_usage, uninspectable_pids
from controller.node.reaper import Claim, Deleted, Held, Reaper, Refused, Unadoptable
from controller.node.store import Root
from controller.rules import contracts as c
from controller.rules.contracts import Reason

IGNORE = {os.getpid(), *uninspectable_pids()}


def seen(rel: str, ident: tuple[int, int] = (1, 2), reason: Reason = Reason.MANIFEST_ABSENT) -> Sighting:
    return Sighting(rel, reason, ident, None, "")


# --- the clock (pure) ----------------------------------------------------------------------------------


def test_an_entry_seen_again_gains_the_step_and_one_not_seen_is_forgotten() -> None:
    records = advance({}, [seen("ns/a"), seen("ns/b")], step=0.0)
    assert {r: v.watched for r, v in records.items()} == {"ns/a": 0.0, "ns/b": 0.0}
    records = advance(records, [seen("ns/a")], step=5.0)
    assert records == {"ns/a": Record((1, 2), "ManifestAbsent", 5.0)}
    records = advance(records, [seen("ns/a"), seen("ns/b")], step=3.0)
    assert records["ns/a"].watched == 8.0 and records["ns/b"].watched == 0.0, "b came back: it starts again"


def test_an_entry_replaced_under_its_name_starts_again() -> None:
    records = advance({"ns/a": Record((1, 2), "ManifestAbsent", 100.0)}, [seen("ns/a", ident=(1, 3))], step=5.0)
    assert records["ns/a"] == Record((1, 3), "ManifestAbsent", 0.0)


def test_beyond_the_limit_new_entries_wait_and_timed_ones_keep_their_time() -> None:
    records = advance({"old": Record((1, 2), "BadName", 50.0)}, [seen("new1"), seen("old"), seen("new2")], 1.0, 2)
    assert set(records) == {"old", "new1"} and records["old"].watched == 51.0


def test_due_is_what_was_watched_for_the_whole_grace_and_a_zero_grace_never_deletes() -> None:
    records = {"a": Record((1, 1), "X", 10.0), "b": Record((1, 2), "X", 30.0), "c": Record((1, 3), "X", 9.9)}
    assert due(records, timedelta(seconds=10)) == ["b", "a"]
    assert due(records, timedelta(0)) == []


def test_the_state_file_round_trips_and_anything_forged_or_foreign_is_skipped() -> None:
    records = {"ns/a": Record((7, 8), "ManifestUnparsed", 12.3), "Bad Name": Record((7, 9), "BadName", 0.0)}
    assert loads(dumps(records)) == records
    assert loads(None) == {} and loads(b"\xff not json") == {} and loads(b"[]") == {}
    assert loads(json.dumps({"version": 2, "entries": {"a": {}}}).encode()) == {}
    forged = {
        "version": 1,
        "entries": {
            "nan": {"dev": 1, "ino": 2, "reason": "X", "watched": float("nan")},
            "negative": {"dev": 1, "ino": 2, "reason": "X", "watched": -5},
            "text": {"dev": "1", "ino": 2, "reason": "X", "watched": 5},
            "ok": {"dev": 1, "ino": 2, "reason": "X", "watched": 5},
        },
    }
    assert loads(json.dumps(forged).encode()) == {"ok": Record((1, 2), "X", 5.0)}
    many = {"version": 1, "entries": {f"e{i}": {"dev": 1, "ino": i, "reason": "X", "watched": 1} for i in range(20000)}}
    assert len(loads(json.dumps(many).encode())) == MAX_RECORDS, "bounded whatever the file holds"


# --- the root's own file -----------------------------------------------------------------------------


def test_the_state_file_is_the_roots_own_never_a_stray_and_never_read_through_a_link(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    root.write_private(c.QUARANTINE_FILE, b"{}")
    assert (root.path / c.QUARANTINE_FILE).stat().st_mode & 0o777 == 0o600
    assert root.read_private(c.QUARANTINE_FILE) == b"{}"
    (root.path / "lost+found").mkdir()  # where the root is a filesystem of its own
    assert root.scan().strays == [], "the scan never reports them, so nothing ever removes them"
    (root.path / c.QUARANTINE_FILE).unlink()
    secret = tmp_path / "secret"
    secret.write_text('{"version": 1}')
    (root.path / c.QUARANTINE_FILE).symlink_to(secret)
    assert root.read_private(c.QUARANTINE_FILE) is None
    with pytest.raises(ValueError):
        root.read_private("../secret")


# --- deletion through the pipeline, on a real root --------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return Root(tmp_path / "root")


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(timeout=10)


def reaper(root: Root) -> Reaper:
    return Reaper(root, in_use_many=lambda paths: scan_usage(paths, (), Path("/proc"), IGNORE))


def unadoptable(root: Root, rel: str, claim: Claim | None = None) -> Unadoptable:
    st = os.lstat(root.path / rel)
    return Unadoptable(rel, (st.st_dev, st.st_ino), claim)


def test_links_files_and_bad_names_go_as_names_and_nothing_they_point_at_is_touched(root: Root, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("keep me")
    (root.path / "ns").mkdir()
    (root.path / "ns" / "link").symlink_to(victim)  # a link where a sandbox would be
    (root.path / "rootlink").symlink_to(victim)  # a link where a namespace would be
    (root.path / "ns" / "file").write_text("x")
    (root.path / "Bad_Name").mkdir()
    (root.path / "Bad_Name" / "deep").mkdir()
    (root.path / "Bad_Name" / "deep" / "escape").symlink_to(victim)
    reasons = {s.rel: s.reason for s in root.scan().strays}
    assert reasons == {
        "ns/link": Reason.SYMLINK,
        "rootlink": Reason.SYMLINK,
        "ns/file": Reason.NOT_A_DIRECTORY,
        "Bad_Name": Reason.BAD_NAME,
    }
    outcomes = reaper(root).reap_unadoptable([unadoptable(root, rel) for rel in sorted(reasons)])
    assert all(isinstance(o, Deleted) and o.reason == Reason.QUARANTINE_EXPIRED for o in outcomes), outcomes
    assert sorted(os.listdir(root.path)) == ["ns"] and os.listdir(root.path / "ns") == []
    assert (victim / "data").read_text() == "keep me" and victim.is_dir()


def test_an_entry_replaced_or_fixed_since_it_was_quarantined_is_not_deleted(root: Root) -> None:
    ns = root.path / "ns"
    (ns / "a").mkdir(parents=True)
    replaced = unadoptable(root, "ns/a", Claim(decided=root.read("ns", "a")))
    (ns / "new").mkdir()
    (ns / "new" / "f").write_text("another run's")
    (ns / "a").rename(ns / "old-a")  # the quarantined inode lives on elsewhere: the name now holds another
    (ns / "new").rename(ns / "a")
    (ns / "fixed").mkdir()
    fixed = unadoptable(root, "ns/fixed", Claim(decided=root.read("ns", "fixed")))
    manifest = {"namespace": "ns", "name": "fixed", "createdAt": datetime.now(UTC).isoformat()}
    (ns / "fixed" / c.MANIFEST_NAME).write_text(json.dumps(manifest))  # its manifest written meanwhile
    gone = Unadoptable("ns/gone", (1, 1), None)
    outcomes = reaper(root).reap_unadoptable([replaced, fixed, gone])
    assert outcomes == [Refused(Reason.MANIFEST_CHANGED), Refused(Reason.MANIFEST_CHANGED), Refused(Reason.LOST)]
    assert (ns / "a" / "f").exists() and (ns / "fixed" / c.MANIFEST_NAME).exists() and (ns / "old-a").is_dir()


def test_an_entry_a_process_works_in_is_held_until_it_exits(root: Root, sleepers: list) -> None:
    busy = root.path / "ns" / "busy"
    busy.mkdir(parents=True)
    sleepers.append(subprocess.Popen(["sleep", "60"], cwd=busy))
    entry = unadoptable(root, "ns/busy", Claim(decided=root.read("ns", "busy")))
    r = reaper(root)
    (held,) = r.reap_unadoptable([entry])
    assert isinstance(held, Held) and held.reason == Reason.IN_USE and busy.is_dir()
    sleepers[0].kill()
    sleepers[0].wait()
    (done,) = r.reap_unadoptable([entry])
    for _ in range(20):  # a process of the machine caught mid-exit is unknown, and unknown holds (fail closed)
        if not (isinstance(done, Held) and done.reason == Reason.IN_USE_UNKNOWN):
            break
        time.sleep(0.25)
        (done,) = r.reap_unadoptable([entry])
    assert isinstance(done, Deleted) and not busy.exists()
    assert [t for t in os.listdir(root.path) if t.startswith(c.TOMBSTONE_PREFIX)] == []


def test_a_dry_run_renames_nothing(root: Root) -> None:
    (root.path / "ns" / "a").mkdir(parents=True)
    r = reaper(root)
    r.dry_run = True
    (outcome,) = r.reap_unadoptable([unadoptable(root, "ns/a")])
    assert outcome.reason == Reason.QUARANTINE_EXPIRED and (root.path / "ns" / "a").is_dir()


def test_only_entries_a_scan_reports_can_be_named(root: Root) -> None:
    for rel in ("../x", "ns/../x", "a/b/c", c.LOCK_NAME, c.QUARANTINE_FILE, ".reap-abc-1", "", "Bad/x", "lost+found"):
        with pytest.raises(ValueError):
            root.tombstone_entry(rel, (0, 0), id="abc", now=datetime.now(UTC))
