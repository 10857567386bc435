"""The standalone sweep on a real root: the reference's races and refusals, one at a time."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from controller.cli.standalone import Replacer
from controller.cli.sweep import Sweeper, in_use_checker
from controller.node.inuse import Usage, uninspectable_pids
from controller.node.reaper import Reaper
from controller.node.store import (
    Entry,
    Read,
    Root,
    Tombstone,
    Transient,
    parse_tombstone,
    pid_namespace,
    standalone_id,
    tombstone_name,
)
from controller.rules.contracts import Reason
from controller.rules.policy import Policy
from tests.bed.diskkit import NOW, REPO, bind_mount, listing, make_immutable, make_job, outside_bait, retain

pytest_plugins = ["tests.bed.diskkit"]  # fixtures: immutable, mounts

H = timedelta(hours=1)
D = timedelta(days=1)
POLICY = Policy(retention=72 * H, max_pin=30 * D)
IGNORE = uninspectable_pids()


class Clock:
    """A clock the test moves: a day of rate-limited logging in a second."""

    def __init__(self, now: datetime = NOW) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def not_in_use(path: Path) -> Usage:
    return Usage(False)


def sweeper(root: Root, clock: Clock | None = None, policy: Policy = POLICY, **kw: object) -> Sweeper:
    kw.setdefault("in_use", not_in_use)
    return Sweeper(root, policy, clock=clock or Clock(), **kw)  # type: ignore[arg-type]


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return Root(tmp_path / "root")


def lines(caplog: pytest.LogCaptureFixture, reason: Reason) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"reason={reason}" in r.getMessage()]


# --- the ordinary pass ---------------------------------------------------------------------------------


def test_expired_sandboxes_are_deleted_young_and_pinned_ones_kept(
    root: Root, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sandkeep.sweep")
    retain(root, tmp_path, "ns", "young", age=H)
    retain(root, tmp_path, "ns", "old", age=4 * D)
    retain(root, tmp_path, "ns", "recorded-short", age=H, retention=timedelta(minutes=30))
    retain(root, tmp_path, "ns", "pinned", age=10 * D)
    root.pin("ns", "pinned", NOW + D, now=NOW)
    report = sweeper(root).run_pass()
    assert listing(root.path / "ns") == ["pinned", "young"]
    assert report.actions("ns/old") == [("deleted", Reason.WINDOW)]
    assert report.actions("ns/recorded-short") == [("deleted", Reason.RETAIN_UNTIL)]
    assert report.actions("ns/pinned") == [("kept", Reason.PINNED)]
    assert report.actions("ns/young") == [("kept", Reason.RETAINED)]
    assert [t for t in os.listdir(root.path) if t.startswith(".reap-")] == []
    deleted = [line for line in caplog.messages if line.startswith("sweep_deleted")]
    assert len(deleted) == 2 and all("tombstone=.reap-" in line for line in deleted)
    assert any("reason=Window entry=ns/old" in line for line in deleted)


def test_retention_zero_deletes_every_unpinned_sandbox(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "a", age=timedelta(seconds=1))
    retain(root, tmp_path, "ns", "b", age=timedelta(0))
    retain(root, tmp_path, "ns", "kept", age=timedelta(0))
    root.pin("ns", "kept", NOW + H, now=NOW)
    sweeper(root, policy=Policy(timedelta(0), 30 * D)).run_pass()
    assert listing(root.path / "ns") == ["kept"]


def test_dry_run_decides_and_deletes_nothing(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "old", age=4 * D)
    (root.path / "stray-file").write_text("")
    (root.path / tombstone_name("leftover", NOW - D)).mkdir()
    report = sweeper(root, policy=Policy(72 * H, 30 * D, dry_run=True)).run_pass()
    assert report.actions("ns/old") == [("would-delete", Reason.WINDOW)]
    assert report.actions("stray-file") == [("would-delete", Reason.NOT_A_DIRECTORY)]
    assert len(report.by_action("would-delete")) == 3
    assert listing(root.path / "ns") == ["old"] and (root.path / "stray-file").exists()


def test_manifests_that_are_missing_or_do_not_parse_are_expired(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "unparsed", age=H)
    retain(root, tmp_path, "ns", "absent", age=H)
    (root.path / "ns" / "unparsed" / "manifest.json").write_text("{oops")
    (root.path / "ns" / "absent" / "manifest.json").unlink()
    report = sweeper(root).run_pass()
    assert report.actions("ns/unparsed") == [("deleted", Reason.MANIFEST_UNPARSED)]
    assert report.actions("ns/absent") == [("deleted", Reason.MANIFEST_ABSENT)]
    assert not (root.path / "ns").exists()  # the emptied namespace directory went too


def test_a_manifest_naming_another_sandbox_is_refused_and_kept(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "moved", age=10 * D)
    path = root.path / "ns" / "moved" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "namespace": "other"}))
    report = sweeper(root).run_pass()
    assert report.actions("ns/moved") == [("refused", Reason.MANIFEST_MISMATCH)]
    assert (root.path / "ns" / "moved" / "workspace").is_dir()


def test_a_transient_read_holds_the_sandbox_this_pass(root: Root, tmp_path: Path) -> None:
    # EIO cannot be summoned on demand from a healthy disk: this seam returns the read the kernel would give.
    class FlakyRoot(Root):
        def read(self, namespace: str, name: str) -> Read:
            return Transient(errno.EIO) if name == "flaky" else super().read(namespace, name)

    flaky = FlakyRoot(root.path)
    retain(flaky, tmp_path, "ns", "flaky", age=10 * D)
    report = sweeper(flaky).run_pass()
    assert report.actions("ns/flaky") == [("held", Reason.MANIFEST_UNREAD)]
    assert (root.path / "ns" / "flaky").is_dir()


# --- links and strays ----------------------------------------------------------------------------------


def test_a_sandbox_that_is_a_symlink_to_a_directory_outside_is_unlinked_never_followed(
    root: Root, tmp_path: Path
) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    elsewhere = Root(tmp_path / "elsewhere")
    retain(elsewhere, tmp_path, "ns", "victim", age=10 * D)
    (root.path / "ns").mkdir()
    (root.path / "ns" / "victim").symlink_to(elsewhere.path / "ns" / "victim")
    (root.path / "evil-ns").symlink_to(bait_dir)
    report = sweeper(root).run_pass()
    assert report.actions("ns/victim") == [("removed", Reason.SYMLINK)]
    assert report.actions("evil-ns") == [("removed", Reason.SYMLINK)]
    assert (elsewhere.path / "ns" / "victim" / "workspace" / "README").exists()
    assert listing(bait_dir) == ["keep.txt"] and bait_file.exists()


def test_a_workspace_with_links_outside_is_deleted_and_nothing_outside_is_touched(root: Root, tmp_path: Path) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    sandbox = retain(root, tmp_path, "ns", "linky", age=10 * D)
    ws = sandbox / "workspace"
    (ws / "dir-link").symlink_to(bait_dir)
    (ws / "src" / "file-link").symlink_to(bait_file)
    (ws / "root-link").symlink_to("/")
    os.link(bait_file, ws / "hard")
    report = sweeper(root).run_pass()
    assert report.actions("ns/linky") == [("deleted", Reason.WINDOW)]
    assert listing(bait_dir) == ["keep.txt"] and bait_file.read_text() == "must survive too\n"


def test_non_directory_entries_are_removed_and_bad_names_reported(
    root: Root, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sandkeep.sweep")
    (root.path / "a-file").write_text("")
    (root.path / "Not_A_Namespace").mkdir()
    (root.path / ".mystery").mkdir()
    clock = Clock()
    s = sweeper(root, clock)
    report = s.run_pass()
    assert report.actions("a-file") == [("removed", Reason.NOT_A_DIRECTORY)]
    assert report.actions("Not_A_Namespace") == [("reported", Reason.BAD_NAME)]
    assert report.actions(".mystery") == [("reported", Reason.BAD_NAME)]
    assert (root.path / "Not_A_Namespace").is_dir() and (root.path / ".mystery").is_dir()
    clock.now += H
    s.run_pass()
    assert len(lines(caplog, Reason.BAD_NAME)) == 2  # said once each, not every pass


# --- races: the fresh read, the read through the tombstone ---------------------------------------------


def test_a_manifest_replaced_between_the_read_and_the_rename_holds_the_sandbox(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "run", age=10 * D)

    def retry_lands(entry: Entry, _: Tombstone) -> None:  # a retry of the job replaces it, as `sandkeep retain` does
        job = make_job(tmp_path / "retry")
        with contextlib.ExitStack() as stack:
            replace = Replacer(Reaper(root, in_use_checker(IGNORE)), stack)
            root.retain(
                job, "ns", "run", job_id="job-run", created_at=NOW - 10 * D + H, retention=None, replace=replace
            )

    report = sweeper(root, after_decide=retry_lands).run_pass()
    assert report.actions("ns/run") == [("held", Reason.MANIFEST_CHANGED)]
    assert (root.path / "ns" / "run" / "workspace" / "README").exists()
    assert [n for n in os.listdir(root.path) if n.startswith(".reap-")] == []


def test_a_pin_landing_between_the_fresh_read_and_the_rename_is_restored(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "run", age=10 * D)

    def pin_lands(entry: Entry, _: Tombstone) -> None:
        root.pin("ns", "run", NOW + D, now=NOW)

    report = sweeper(root, before_rename=pin_lands).run_pass()
    assert report.actions("ns/run") == [("held", Reason.MANIFEST_CHANGED)]
    assert report.decisions[0].detail["restored"] is True
    read = root.read("ns", "run")
    assert read.manifest.keep_until is not None
    assert sweeper(root).run_pass().actions("ns/run") == [("kept", Reason.PINNED)]


def test_a_pin_landing_between_the_rename_and_the_read_back_is_restored(root: Root, tmp_path: Path) -> None:
    # The pinner resolved the directory before the rename and wrote after it: its write is in the tombstone.
    retain(root, tmp_path, "ns", "run", age=10 * D)

    def pin_lands_in_tombstone(entry: Entry, t: Tombstone) -> None:
        path = t.path / "manifest.json"
        body = json.loads(path.read_text())
        path.write_text(json.dumps({**body, "keepUntil": "2026-11-30T12:00:00Z", "pinnedAt": "2026-11-29T12:00:00Z"}))

    report = sweeper(root, after_rename=pin_lands_in_tombstone).run_pass()
    assert report.actions("ns/run") == [("held", Reason.MANIFEST_CHANGED)]
    assert (root.path / "ns" / "run" / "workspace" / "README").exists()
    assert [n for n in os.listdir(root.path) if n.startswith(".reap-")] == []


# --- in use --------------------------------------------------------------------------------------------


def test_a_sandbox_a_process_works_in_is_held_by_the_real_proc_check(root: Root, tmp_path: Path) -> None:
    sandbox = retain(root, tmp_path, "ns", "busy", age=10 * D)
    retain(root, tmp_path, "ns", "idle", age=10 * D)
    proc = subprocess.Popen(["sleep", "60"], cwd=sandbox / "workspace")
    try:
        report = sweeper(root, in_use=in_use_checker(IGNORE)).run_pass()
    finally:
        proc.kill()
        proc.wait()
    assert report.actions("ns/busy") == [("held", Reason.IN_USE)]
    (busy,) = [d for d in report.decisions if d.entry == "ns/busy"]
    assert f"pid {proc.pid}" in busy.detail["holders"]
    assert report.actions("ns/idle") == [("deleted", Reason.WINDOW)]
    assert sweeper(root, in_use=in_use_checker(IGNORE)).run_pass().actions("ns/busy") == [("deleted", Reason.WINDOW)]


def test_an_unknown_in_use_answer_holds(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "maybe", age=10 * D)
    retain(root, tmp_path, "ns", "boom", age=10 * D)

    def unknown(path: Path) -> Usage:
        if path.name == "boom":
            raise OSError(errno.EIO, "proc unreadable")
        return Usage(None, ("pid 1 cannot be inspected",), Reason.IN_USE_UNKNOWN)

    report = sweeper(root, in_use=unknown).run_pass()
    assert report.actions("ns/maybe") == [("held", Reason.IN_USE_UNKNOWN)]
    assert report.actions("ns/boom") == [("held", Reason.IN_USE_UNKNOWN)]
    assert listing(root.path / "ns") == ["boom", "maybe"]


# --- tombstones: stuck, leftover, pinned, foreign ------------------------------------------------------


@pytest.mark.root
def test_an_undeletable_file_leaves_a_stuck_tombstone_logged_once_a_day_and_cleared_later(
    root: Root, tmp_path: Path, immutable: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sandkeep.sweep")
    sandbox = retain(root, tmp_path, "ns", "stuck", age=10 * D)
    clock = Clock()
    s = sweeper(root, clock)
    stuck_file = sandbox / "workspace" / "src" / "pkg" / "f1.py"
    make_immutable(immutable, stuck_file)
    first = s.run_pass()
    assert first.actions("ns/stuck") == [("stuck", Reason.TOMBSTONE_STUCK)]
    (tname,) = [n for n in os.listdir(root.path) if n.startswith(".reap-")]
    assert first.decisions[0].detail["errno"] == os.strerror(errno.EPERM)
    assert first.decisions[0].detail["path"].endswith("/workspace/src/pkg/f1.py")
    assert len(lines(caplog, Reason.TOMBSTONE_STUCK)) == 1
    for hours in (1, 5, 23):  # retried every pass, still stuck every pass, not said again within the day
        clock.now = NOW + hours * H
        report = s.run_pass()
        assert report.actions(tname) == [("stuck", Reason.TOMBSTONE_STUCK)]
    assert len(lines(caplog, Reason.TOMBSTONE_STUCK)) == 1
    clock.now = NOW + 25 * H
    s.run_pass()
    assert len(lines(caplog, Reason.TOMBSTONE_STUCK)) == 2
    subprocess.run(["chattr", "-i", str(root.path / tname / "workspace" / "src" / "pkg" / "f1.py")], check=True)
    clock.now += H
    cleared = s.run_pass()
    assert cleared.actions(tname) == [("deleted", Reason.TOMBSTONE_LEFTOVER)]
    assert listing(root.path) == []


def test_a_crash_between_rename_and_delete_leaves_a_tombstone_the_next_pass_clears(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "run", age=10 * D)
    code = textwrap.dedent("""
        import os, signal, sys
        from controller.rules.policy import Policy
        from controller.node.inuse import Usage
        from controller.cli.sweep import Sweeper
        from controller.node.store import Root
        from datetime import timedelta
        root = Root(sys.argv[1])
        def crash(entry, tombstone):
            os.kill(os.getpid(), signal.SIGKILL)
        Sweeper(root, Policy(timedelta(hours=72), timedelta(days=30)), in_use=lambda p: Usage(False),
                after_rename=crash).run_pass()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root.path)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (tname,) = [n for n in os.listdir(root.path) if n.startswith(".reap-")]
    assert not (root.path / "ns" / "run").exists()
    report = sweeper(root, Clock(datetime.now(NOW.tzinfo))).run_pass()
    assert report.actions(tname) == [("deleted", Reason.TOMBSTONE_LEFTOVER)]
    assert [n for n in os.listdir(root.path) if n.startswith(".reap-")] == []


def test_a_leftover_tombstone_holding_a_live_pin_is_restored_never_deleted(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "pinned", age=10 * D)
    root.pin("ns", "pinned", NOW + D, now=NOW)
    t = root.tombstone("ns", "pinned", id="crashed", now=NOW - H)
    report = sweeper(root).run_pass()
    assert report.actions(t.name) == [("restored", Reason.TOMBSTONE_PINNED)]
    assert (root.path / "ns" / "pinned" / "workspace" / "README").exists()


def test_a_pinned_tombstone_whose_name_is_taken_is_held_and_retried(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "pinned", age=10 * D)
    root.pin("ns", "pinned", NOW + D, now=NOW)
    t = root.tombstone("ns", "pinned", id="crashed", now=NOW - H)
    retain(root, tmp_path / "again", "ns", "pinned", age=H)  # a new run took the name meanwhile
    report = sweeper(root).run_pass()
    assert report.actions(t.name) == [("held", Reason.TOMBSTONE_PINNED)] * 2  # tried, then retried at the end
    assert t.path.is_dir()  # never deleted


def test_a_young_tombstone_of_another_live_process_is_left_alone(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "run", age=10 * D)
    other = subprocess.Popen(["sleep", "60"])
    try:
        clock = Clock(datetime.now(NOW.tzinfo))
        t = root.tombstone("ns", "run", id=f"p{other.pid}-abcd1234", now=clock.now - timedelta(minutes=1))
        assert sweeper(root, clock).run_pass().actions(t.name) == [("held", Reason.TOMBSTONE_FOREIGN)]
        clock.now += timedelta(minutes=10)  # old enough that no pass could still be holding it
        assert sweeper(root, clock).run_pass().actions(t.name) == [("deleted", Reason.TOMBSTONE_LEFTOVER)]
    finally:
        other.kill()
        other.wait()


def test_a_young_tombstone_of_a_process_in_another_pid_namespace_is_left_alone(root: Root, tmp_path: Path) -> None:
    """A retain in a Job's container writes its own namespace's pid (often 1 or 7): this /proc cannot tell whether
    it is alive, so a young one is held, even when that pid number is free or this very process here."""
    retain(root, tmp_path, "ns", "run", age=10 * D)
    retain(root, tmp_path / "two", "ns", "mine", age=10 * D)
    contained = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
    try:
        other = _namespace_of(contained.pid)
        assert other != pid_namespace()
        gone = subprocess.Popen(["true"])
        gone.wait()
        clock = Clock(datetime.now(NOW.tzinfo))
        young = clock.now - timedelta(minutes=1)
        dead = root.tombstone("ns", "run", id=f"p{gone.pid}n{other}-abcd1234", now=young)
        same = root.tombstone("ns", "mine", id=f"p{os.getpid()}n{other}-abcd1234", now=young)
        actions = sweeper(root, clock).run_pass()
        assert actions.actions(dead.name) == actions.actions(same.name) == [("held", Reason.TOMBSTONE_FOREIGN)]
        clock.now += timedelta(minutes=10)  # old enough that no pass could still be holding it
        actions = sweeper(root, clock).run_pass()
        assert actions.actions(dead.name) == actions.actions(same.name) == [("deleted", Reason.TOMBSTONE_LEFTOVER)]
    finally:
        contained.kill()
        contained.wait()


def _namespace_of(pid: int) -> int:
    """The PID namespace of `pid`'s child (what `unshare --pid --fork` runs the command in), once it runs."""
    for _ in range(100):
        child = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if child:
            return Path(f"/proc/{child[0]}/ns/pid").stat().st_ino
        time.sleep(0.05)
    raise AssertionError(f"unshare ({pid}) started no command")


def test_a_standalone_id_names_its_pid_namespace() -> None:
    made = parse_tombstone(tombstone_name(standalone_id(), NOW))
    assert made is not None and made.pid == os.getpid()
    assert made.made_here(pid_namespace()) and not made.made_here(pid_namespace() + 1) and not made.made_here(0)
    older = parse_tombstone(tombstone_name("p123-abcd1234", NOW))  # written before the namespace was recorded
    assert older is not None and older.pid == 123 and older.made_here(pid_namespace())


def test_a_tombstone_of_a_dead_process_is_cleared_at_once(root: Root, tmp_path: Path) -> None:
    retain(root, tmp_path, "ns", "run", age=10 * D)
    gone = subprocess.Popen(["true"])
    gone.wait()
    clock = Clock(datetime.now(NOW.tzinfo))
    t = root.tombstone("ns", "run", id=f"p{gone.pid}-abcd1234", now=clock.now)
    assert sweeper(root, clock).run_pass().actions(t.name) == [("deleted", Reason.TOMBSTONE_LEFTOVER)]


def test_a_leftover_whose_manifest_cannot_be_read_just_now_is_held(root: Root, tmp_path: Path) -> None:
    class FlakyRoot(Root):
        def read_tombstone(self, t: Tombstone) -> Read:
            return Transient(errno.EMFILE)

    flaky = FlakyRoot(root.path)
    retain(flaky, tmp_path, "ns", "run", age=10 * D)
    t = flaky.tombstone("ns", "run", id="x", now=NOW - D)
    assert sweeper(flaky).run_pass().actions(t.name) == [("held", Reason.MANIFEST_UNREAD)]
    assert t.path.is_dir()


# --- a mount that appears after the in-use check (issue 12, item 6) ------------------------------------


@pytest.mark.root
@pytest.mark.parametrize("when", ["after_decide", "after_rename"])
def test_a_mount_made_after_the_in_use_check_is_never_entered_and_its_delete_stops_stuck(
    root: Root, tmp_path: Path, mounts: list[Path], when: str
) -> None:
    # The in-use check saw no mount; one bound inside the sandbox right after it (before the rename, or inside
    # the tombstone) is found by the delete walk's mount id, never descended: the tombstone stays Stuck.
    bait_file, bait_dir = outside_bait(tmp_path)
    sandbox = retain(root, tmp_path, "ns", "old", age=10 * D)
    (sandbox / "workspace" / "mnt").mkdir()

    def mount_lands(entry: Entry, tomb: Tombstone) -> None:
        bind_mount(mounts, bait_dir, (tomb.path if when == "after_rename" else entry.path) / "workspace" / "mnt")

    s = sweeper(root, in_use=in_use_checker(IGNORE), **{when: mount_lands})
    report = s.run_pass()
    assert report.actions("ns/old") == [("stuck", Reason.TOMBSTONE_STUCK)]
    (decision,) = report.decisions
    (tomb,) = root.tombstones()
    assert decision.detail["cause"] == Reason.CROSS_DEVICE
    assert decision.detail["path"] == str(tomb.path / "workspace" / "mnt")
    assert listing(bait_dir) == ["keep.txt"] and (bait_dir / "keep.txt").read_text() == "must survive\n"
    assert listing(tomb.path / "workspace") == ["mnt"]  # everything around the mount went, nothing below it
    assert bait_file.read_text() == "must survive too\n"
    assert s.run_pass().actions(tomb.name) == [("stuck", Reason.TOMBSTONE_STUCK)]  # still mounted: still stuck
    subprocess.run(["umount", str(tomb.path / "workspace" / "mnt")], check=True)
    assert s.run_pass().actions(tomb.name) == [("deleted", Reason.TOMBSTONE_LEFTOVER)]
    assert listing(root.path) == [] and listing(bait_dir) == ["keep.txt"]
