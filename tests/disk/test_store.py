"""The disk store on a real filesystem: root, lock, retain, read, scan, pin, tombstones."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from controller.cli.standalone import Replacer
from controller.cli.sweep import in_use_checker
from controller.node import treesize
from controller.node.inuse import uninspectable_pids
from controller.node.reaper import Reaper
from controller.node.store import (
    Absent,
    Mismatch,
    Present,
    Read,
    Refusal,
    Root,
    RootRefused,
    StoreError,
    Transient,
    Unparsed,
    Unreadable,
    parse_tombstone,
    same_read,
    standalone_id,
    tombstone_name,
)
from controller.rules.contracts import LOCK_NAME, Reason
from tests.bed.diskkit import NOW, REPO, User, listing, make_job, outside_bait, retain

pytest_plugins = ["tests.bed.diskkit"]  # fixtures: throwaway_user, shared_tmp, immutable
H = timedelta(hours=1)


# --- the root ------------------------------------------------------------------------------------------


def test_a_new_root_is_created_0700(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        root = Root(tmp_path / "a" / "root")
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.path.stat().st_mode) == 0o700


@pytest.mark.root
def test_a_root_owned_by_another_uid_is_refused(tmp_path: Path, throwaway_user: User) -> None:
    path = tmp_path / "root"
    path.mkdir()
    os.chown(path, throwaway_user.uid, throwaway_user.gid)
    with pytest.raises(RootRefused) as caught:
        Root(path)
    assert caught.value.reason is Reason.ROOT_FOREIGN_OWNER
    assert str(path) in str(caught.value) and f"uid {throwaway_user.uid}" in str(caught.value)


@pytest.mark.root
def test_a_non_root_user_refuses_a_root_owned_by_root(shared_tmp: Path, throwaway_user: User) -> None:
    path = shared_tmp / "root"
    path.mkdir(mode=0o755)
    code = "import sys; from controller.node.store import Root, RootRefused\n"
    code += "try:\n Root(sys.argv[1])\nexcept RootRefused as e:\n print(e.reason)"
    out = throwaway_user.python(code, str(path))
    assert out.stdout.strip() == "RootForeignOwner", out.stderr


def test_a_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root").write_text("")
    with pytest.raises(RootRefused) as caught:
        Root(tmp_path / "root")
    assert caught.value.reason is Reason.NOT_A_DIRECTORY


def test_the_lock_refuses_a_second_holder_naming_the_first(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    hold = "import sys, time\nfrom controller.node.store import Root\nwith Root(sys.argv[1]).lock():\n"
    hold += " print('held', flush=True)\n time.sleep(60)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", hold, str(root.path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RootRefused) as caught, root.lock(wait=0):
            pass
        assert caught.value.reason is Reason.ROOT_LOCKED
        assert f"process {holder.pid}" in str(caught.value)
        started = time.monotonic()
        with pytest.raises(RootRefused), root.lock(wait=0.3):
            pass
        assert time.monotonic() - started >= 0.3
    finally:
        holder.kill()
        holder.wait()
    with root.lock(wait=5):  # the flock went with the process: the stale pid in the file blocks nobody
        assert (root.path / LOCK_NAME).read_text().strip() == str(os.getpid())


def test_the_lock_file_is_never_followed_through_a_link(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (root.path / LOCK_NAME).symlink_to(victim)
    with pytest.raises(OSError) as caught, root.lock(wait=0):
        pass
    assert caught.value.errno == errno.ELOOP
    assert victim.read_text() == "precious\n"


# --- retain --------------------------------------------------------------------------------------------


def test_retain_moves_the_job_by_rename_and_writes_a_0600_manifest(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    job = make_job(tmp_path)
    inode = job.stat().st_ino
    manifest = root.retain(job, "team-a", "run-1", job_id="j-1", created_at=NOW, retention=72 * H, node="n1", now=NOW)
    sandbox = root.path / "team-a" / "run-1"
    assert not job.exists()
    assert (sandbox / "workspace").stat().st_ino == inode  # the same directory: renamed, never copied
    assert listing(sandbox) == [".commands", "manifest.json", "workspace"]
    assert stat.S_IMODE((sandbox / "manifest.json").stat().st_mode) == 0o600
    body = json.loads((sandbox / "manifest.json").read_text())
    assert body["namespace"] == "team-a" and body["name"] == "run-1" and body["jobId"] == "j-1"
    assert body["createdAt"] == "2026-11-29T12:00:00.000Z" and body["retainUntil"] == "2026-12-02T12:00:00.000Z"
    assert body["node"] == "n1" and body["keepUntil"] is None and body["workspace"] == "workspace"
    assert manifest.namespace == "team-a"
    assert listing(root.path) == ["team-a"]  # no staging directory, no temp file


def test_retain_removes_excluded_globs_first_and_never_follows_links(tmp_path: Path) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    root = Root(tmp_path / "root")
    job = make_job(tmp_path)
    (job / "src" / "notes.log").write_text("x")
    (job / "linked-session").symlink_to(bait_dir)
    (job / "session" / "to-outside").symlink_to(bait_dir)
    root.retain(
        job,
        "ns",
        "r",
        job_id="j",
        created_at=NOW,
        retention=None,
        exclude=["session", "*.log", "linked-session"],
        now=NOW,
    )
    ws = root.path / "ns" / "r" / "workspace"
    assert listing(ws) == ["README", "src"]
    assert listing(ws / "src") == ["pkg"]
    assert listing(bait_dir) == ["keep.txt"] and bait_file.exists()


def test_a_previous_attempt_is_replaced_last_attempt_wins(tmp_path: Path) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    root = Root(tmp_path / "root")
    first = make_job(tmp_path, "first")
    (first / "link-dir").symlink_to(bait_dir)
    (first / "link-file").symlink_to(bait_file)
    root.retain(first, "ns", "run", job_id="j", created_at=NOW, retention=None, now=NOW)
    second = make_job(tmp_path, "second")
    (second / "marker").write_text("second\n")
    with pytest.raises(StoreError) as caught:  # a replacement is a deletion: never without a deletion pipeline
        root.retain(second, "ns", "run", job_id="j", created_at=NOW + H, retention=None, now=NOW)
    assert caught.value.errno == errno.EEXIST and "source is where it was" in str(caught.value)
    assert (second / "marker").exists() and listing(root.path) == ["ns"]
    reaper = Reaper(root, in_use_checker(uninspectable_pids()))
    with contextlib.ExitStack() as stack:
        replace = Replacer(reaper, stack)
        root.retain(second, "ns", "run", job_id="j", created_at=NOW + H, retention=None, now=NOW, replace=replace)
        assert replace.locked  # the root lock, held for the whole replacement
    ws = root.path / "ns" / "run" / "workspace"
    assert (ws / "marker").read_text() == "second\n" and not (ws / "link-dir").exists()
    assert listing(root.path) == [LOCK_NAME, "ns"]  # the old attempt's tombstone is deleted too
    assert listing(bait_dir) == ["keep.txt"] and bait_file.read_text() == "must survive too\n"


@pytest.mark.parametrize("bad", ["a-symlink", "a-file", "missing", "inside-root"])
def test_retain_refuses_a_bad_source_and_leaves_no_debris(tmp_path: Path, bad: str) -> None:
    root = Root(tmp_path / "root")
    job = make_job(tmp_path)
    source = {
        "a-symlink": tmp_path / "link",
        "a-file": job / "README",
        "missing": tmp_path / "nope",
        "inside-root": root.path / "ns",
    }[bad]
    if bad == "a-symlink":
        source.symlink_to(job)
    if bad == "inside-root":
        source.mkdir()
    with pytest.raises(StoreError) as caught:
        root.retain(source, "ns", "run", job_id="j", created_at=NOW, retention=None, now=NOW)
    assert str(source) in str(caught.value)
    assert listing(root.path) == (["ns"] if bad == "inside-root" else [])
    assert job.is_dir()


def test_retain_across_filesystems_is_refused_not_copied(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    assert os.stat(shm).st_dev != os.stat(tmp_path).st_dev, "this test needs /dev/shm on another filesystem"
    job = make_job(Path(os.path.realpath(shm)), f"sandkeep-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        root = Root(tmp_path / "root")
        with pytest.raises(StoreError) as caught:
            root.retain(job, "ns", "run", job_id="j", created_at=NOW, retention=None, now=NOW)
        assert caught.value.reason is Reason.CROSS_DEVICE and caught.value.errno == errno.EXDEV
        assert "never by copy" in str(caught.value)
        assert listing(root.path) == [] and (job / "README").exists()
    finally:
        subprocess.run(["rm", "-rf", str(job)], check=True)


def test_a_failure_while_placing_puts_the_source_back_and_leaves_no_debris(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    (root.path / "ns").write_text("a file where the namespace directory should be")
    job = make_job(tmp_path)
    with pytest.raises(StoreError) as caught:
        root.retain(job, "ns", "run", job_id="j", created_at=NOW, retention=None, exclude=["session"], now=NOW)
    assert "source is where it was" in str(caught.value)
    assert listing(root.path) == ["ns"]
    assert (job / "src" / "pkg" / "f0.py").exists() and not (job / "session").exists()


@pytest.mark.parametrize(
    ("ns", "name"),
    [
        ("Bad", "run"),
        ("ns", "-run"),
        (".reap-x", "run"),
        ("ns", "a" * 254),
        ("n" * 64, "run"),
        ("ns", ".."),
        ("ns", "a/b"),
    ],
)
def test_names_that_are_not_kubernetes_names_are_refused_clearly(tmp_path: Path, ns: str, name: str) -> None:
    root = Root(tmp_path / "root")
    with pytest.raises(ValueError, match="DNS-1123"):
        root.sandbox_path(ns, name)
    with pytest.raises(ValueError, match="DNS-1123"):
        root.retain(make_job(tmp_path), ns, name, job_id="j", created_at=NOW, retention=None, now=NOW)
    assert listing(root.path) == []


def test_the_longest_names_work_end_to_end_and_the_tombstone_stays_short(tmp_path: Path) -> None:
    # 63 + 253 bytes of names, and a 1000-byte job id: the tombstone name never depends on any of them.
    root = Root(tmp_path / "root")
    ns, name = "n" * 63, ".".join(["a" * 63] * 4)[:253]
    root.retain(make_job(tmp_path), ns, name, job_id="j" * 1000, created_at=NOW, retention=None, now=NOW)
    read = root.read(ns, name)
    assert isinstance(read, Present) and read.manifest.job_id == "j" * 1000
    t = root.tombstone(ns, name, id="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", now=NOW)
    assert len(t.name) < 100
    assert root.delete_tombstone(t).ok and listing(root.path) == [ns]


# --- read ----------------------------------------------------------------------------------------------


def _manifest(root: Root, ns: str, name: str) -> Path:
    return root.path / ns / name / "manifest.json"


def test_read_distinguishes_present_absent_unparsed_unreadable_and_mismatch(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    for name in ("ok", "empty", "garbage", "dir-manifest", "elsewhere"):
        retain(root, tmp_path, "ns", name, age=H)
    _manifest(root, "ns", "empty").unlink()
    _manifest(root, "ns", "garbage").write_text("{not json")
    _manifest(root, "ns", "dir-manifest").unlink()
    _manifest(root, "ns", "dir-manifest").mkdir()
    body = json.loads(_manifest(root, "ns", "elsewhere").read_text())
    _manifest(root, "ns", "elsewhere").write_text(json.dumps({**body, "name": "ok"}))
    assert isinstance(root.read("ns", "ok"), Present)
    assert root.read("ns", "empty") == Absent()
    assert isinstance(root.read("ns", "garbage"), Unparsed)
    assert root.read("ns", "dir-manifest") == Unreadable(errno.EINVAL)
    mismatch = root.read("ns", "elsewhere")
    assert isinstance(mismatch, Mismatch) and mismatch.reason is Reason.MANIFEST_MISMATCH
    assert root.read("ns", "never-made") == Absent()
    assert root.read("nope", "never-made") == Absent()


def test_read_never_follows_a_link_to_a_manifest_outside(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    elsewhere = Root(tmp_path / "elsewhere")
    retain(elsewhere, tmp_path, "ns", "target", age=H)
    retain(root, tmp_path, "ns", "linked-manifest", age=H)
    _manifest(root, "ns", "linked-manifest").unlink()
    _manifest(root, "ns", "linked-manifest").symlink_to(_manifest(elsewhere, "ns", "target"))
    (root.path / "ns" / "linked-sandbox").symlink_to(elsewhere.path / "ns" / "target")
    (root.path / "linked-ns").symlink_to(elsewhere.path / "ns")
    assert root.read("ns", "linked-manifest") == Unreadable(errno.ELOOP)
    assert root.read("ns", "linked-sandbox") == Absent(Reason.SYMLINK)
    assert isinstance(root.read("linked-ns", "target"), Absent)


def test_a_fifo_manifest_does_not_block_the_read(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "fifo", age=H)
    _manifest(root, "ns", "fifo").unlink()
    os.mkfifo(_manifest(root, "ns", "fifo"))
    assert root.read("ns", "fifo") == Unreadable(errno.EINVAL)


def test_a_read_that_runs_out_of_descriptors_is_transient(tmp_path: Path) -> None:
    # A real EMFILE: the read runs in a child whose descriptor limit is what it already has open.
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "run", age=H)
    code = textwrap.dedent("""
        import os, resource, sys
        from controller.node.store import Root
        root = Root(sys.argv[1])
        fds = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        try:
            while True:
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        os.close(fds.pop())  # one free: the root opens, the namespace does not
        print(repr(root.read("ns", "run")))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code, str(root.path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    assert "Transient(errno=24" in out.stdout


def test_same_read_is_byte_for_byte() -> None:
    assert same_read(Absent(), Absent(Reason.SYMLINK))
    assert same_read(Unreadable(13), Unreadable(13)) and not same_read(Unreadable(13), Unreadable(5))
    assert not same_read(Transient(5), Transient(5))
    assert same_read(Unparsed("x"), Unparsed("x")) and not same_read(Unparsed("x"), Unparsed("x "))
    assert not same_read(Unparsed("x"), Absent())


# --- scan ----------------------------------------------------------------------------------------------


def test_scan_lists_sandboxes_strays_and_tombstones_without_following_links(tmp_path: Path) -> None:
    _, bait_dir = outside_bait(tmp_path)
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "a", age=H)
    retain(root, tmp_path, "ns", "b", age=H)
    (root.path / "empty-ns").mkdir()
    (root.path / "link-ns").symlink_to(bait_dir)
    (root.path / "file").write_text("")
    (root.path / "Bad_Name").mkdir()
    (root.path / ".hidden").mkdir()
    (root.path / "ns" / "link").symlink_to(bait_dir)
    (root.path / "ns" / "note.txt").write_text("")
    (root.path / "ns" / "Upper").mkdir()
    (root.path / tombstone_name("abc", NOW)).mkdir()
    with root.lock(wait=0):
        scan = root.scan()
    assert [(e.namespace, e.name) for e in scan.sandboxes] == [("ns", "a"), ("ns", "b")]
    strays = {s.rel: (s.reason, s.is_dir) for s in scan.strays}
    assert strays == {
        "link-ns": (Reason.SYMLINK, False),
        "file": (Reason.NOT_A_DIRECTORY, False),
        "Bad_Name": (Reason.BAD_NAME, True),
        ".hidden": (Reason.BAD_NAME, True),
        "ns/link": (Reason.SYMLINK, False),
        "ns/note.txt": (Reason.NOT_A_DIRECTORY, False),
        "ns/Upper": (Reason.BAD_NAME, True),
    }
    assert [t.id for t in scan.tombstones] == ["abc"]
    assert scan.empty_namespaces == ["empty-ns"]
    for stray in scan.strays:
        root.remove_stray(stray)
    assert listing(root.path) == sorted(
        [".hidden", ".sandkeep.lock", "Bad_Name", "empty-ns", "ns", tombstone_name("abc", NOW)]
    )
    assert listing(bait_dir) == ["keep.txt"]


# --- pin -----------------------------------------------------------------------------------------------


@pytest.mark.root
def test_a_pin_keeps_the_manifests_owner_mode_and_unknown_keys(tmp_path: Path, throwaway_user: User) -> None:
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "run", age=H)
    path = _manifest(root, "ns", "run")
    body = json.loads(path.read_text())
    path.write_text(json.dumps({**body, "image": "python:3.12"}))
    os.chown(path, throwaway_user.uid, throwaway_user.gid)
    path.chmod(0o640)
    manifest = root.pin("ns", "run", NOW + 24 * H, now=NOW)
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (throwaway_user.uid, throwaway_user.gid, 0o640)
    written = json.loads(path.read_text())
    assert written["keepUntil"] == "2026-11-30T12:00:00Z" and written["pinnedAt"] == "2026-11-29T12:00:00Z"
    assert written["image"] == "python:3.12" and manifest.keep_until == "2026-11-30T12:00:00Z"
    assert listing(path.parent) == [".commands", "manifest.json", "workspace"]  # no temp file left
    root.pin("ns", "run", None, now=NOW)
    assert json.loads(path.read_text())["keepUntil"] is None


def test_pinning_what_has_no_manifest_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "run", age=H)
    _manifest(root, "ns", "run").write_text("{broken")
    with pytest.raises(StoreError) as caught:
        root.pin("ns", "run", NOW + H, now=NOW)
    assert "cannot pin" in str(caught.value) and caught.value.reason is Reason.MANIFEST_UNPARSED
    assert _manifest(root, "ns", "run").read_text() == "{broken"
    with pytest.raises(StoreError):
        root.pin("ns", "absent", NOW + H, now=NOW)


# --- tombstones ----------------------------------------------------------------------------------------


def test_tombstone_names_are_bounded_and_parse_back() -> None:
    name = tombstone_name("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", NOW)
    t = parse_tombstone(name)
    assert t is not None and t.id == "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0" and t.made_at == NOW and t.pid is None
    mine = parse_tombstone(tombstone_name(standalone_id(), NOW))
    assert mine is not None and mine.pid == os.getpid()
    assert mine.age(NOW + H) == H
    for bad in (".reap-", ".reap-x", ".reap--1", "reap-a-1", ".reap-a-b", ".reap-a/b-1", ".reap-" + "a" * 65 + "-1"):
        assert parse_tombstone(bad) is None
    for bad_id in ("", "-a", "a/b", "a" * 65, "a_b", "..", "ä"):
        with pytest.raises(ValueError, match="tombstone id"):
            tombstone_name(bad_id, NOW)


def test_tombstone_renames_aside_and_never_onto_an_existing_name(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "a", age=H)
    retain(root, tmp_path, "ns", "b", age=H)
    t = root.tombstone("ns", "a", id="same", now=NOW)
    assert listing(root.path / "ns") == ["b"] and t.path.is_dir()
    assert isinstance(root.read_tombstone(t), Present)
    (root.path / "empty").mkdir()
    with pytest.raises(StoreError) as caught:
        root.tombstone("ns", "b", id="same", now=NOW)  # the same name: refused, b stays where it was
    assert caught.value.reason is Reason.RENAME_FAILED and caught.value.errno == errno.EEXIST
    assert listing(root.path / "ns") == ["b"]
    with pytest.raises(StoreError) as gone:
        root.tombstone("ns", "never", id="x", now=NOW)
    assert gone.value.errno == errno.ENOENT
    (root.path / "ns" / "file").write_text("")
    with pytest.raises(StoreError) as not_dir:
        root.tombstone("ns", "file", id="y", now=NOW)
    assert not_dir.value.errno == errno.ENOTDIR


def test_restore_displaces_only_an_empty_directory(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "run", age=H)
    t = root.tombstone("ns", "run", id="t1", now=NOW)
    (root.path / "ns" / "run").mkdir()  # empty: displaced
    assert root.restore(t, "ns", "run") and isinstance(root.read("ns", "run"), Present)
    t = root.tombstone("ns", "run", id="t2", now=NOW)
    (root.path / "ns" / "run").mkdir()
    (root.path / "ns" / "run" / "someone-elses").write_text("x")
    assert not root.restore(t, "ns", "run")  # non-empty: never removed
    assert (root.path / "ns" / "run" / "someone-elses").exists() and t.path.is_dir()
    (root.path / "ns" / "run" / "someone-elses").unlink()
    (root.path / "ns" / "run").rmdir()
    (root.path / "ns" / "run").symlink_to(tmp_path)
    assert not root.restore(t, "ns", "run") and t.path.is_dir()
    (root.path / "ns" / "run").unlink()
    assert root.restore(t, "ns", "run")


def test_a_pin_never_writes_through_a_linked_sandbox_or_a_foreign_manifest(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    elsewhere = Root(tmp_path / "elsewhere")
    retain(elsewhere, tmp_path, "ns", "target", age=H)
    before = _manifest(elsewhere, "ns", "target").read_text()
    (root.path / "ns").mkdir()
    (root.path / "ns" / "linked").symlink_to(elsewhere.path / "ns" / "target")
    with pytest.raises(StoreError) as linked:
        root.pin("ns", "linked", NOW + H, now=NOW)
    assert "cannot pin it" in str(linked.value)
    retain(root, tmp_path, "ns", "moved", age=H)
    body = json.loads(_manifest(root, "ns", "moved").read_text())
    _manifest(root, "ns", "moved").write_text(json.dumps({**body, "name": "other"}))
    with pytest.raises(StoreError) as foreign:
        root.pin("ns", "moved", NOW + H, now=NOW)
    assert foreign.value.reason is Reason.MANIFEST_MISMATCH
    assert _manifest(elsewhere, "ns", "target").read_text() == before


def test_read_many_answers_what_read_answers_for_each(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    for ns, name in (("a", "ok"), ("a", "garbage"), ("a", "gone"), ("b", "elsewhere"), ("b", "empty")):
        retain(root, tmp_path, ns, name, age=H)
    _manifest(root, "a", "garbage").write_text("{")
    _manifest(root, "b", "empty").unlink()
    body = json.loads(_manifest(root, "b", "elsewhere").read_text())
    _manifest(root, "b", "elsewhere").write_text(json.dumps({**body, "namespace": "a"}))
    scan = root.scan()
    subprocess.run(["rm", "-rf", str(root.path / "a" / "gone")], check=True)  # vanished after the scan
    many = root.read_many(scan.sandboxes)
    assert many == {(e.namespace, e.name): root.read(e.namespace, e.name) for e in scan.sandboxes}
    assert [type(many[k]).__name__ for k in sorted(many)] == ["Unparsed", "Absent", "Present", "Mismatch", "Absent"]


def test_usage_counts_a_sandboxs_bytes_and_files_without_following_links(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    path = retain(root, tmp_path, "ns", "sized", age=H)
    (path / "workspace" / "big").write_bytes(b"x" * 200_000)
    (path / "workspace" / "out").symlink_to("/usr")
    usage = root.usage("ns", "sized")
    assert usage.files == 7 + 1 + 1 + 1  # the job's 7 files, big, the link, the manifest
    assert 200_000 <= usage.bytes < 2_000_000 and root.size("ns", "sized") == usage.bytes
    assert root.usage("ns", "absent") == treesize.TreeSize(0, 0)


# --- a replacing retain keeps a deletion's rules (issue 12, item 5) ------------------------------------------


def test_a_retain_never_replaces_a_pinned_sandbox(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "run", age=H)
    root.pin("ns", "run", NOW + 24 * H, now=NOW)
    second = make_job(tmp_path / "retry")
    (second / "marker").write_text("second\n")
    with pytest.raises(StoreError) as caught:
        root.retain(second, "ns", "run", job_id="j", created_at=NOW, retention=None, now=NOW)
    assert caught.value.reason is Reason.PINNED and "pinned until" in str(caught.value)
    assert "source is where it was" in str(caught.value) and (second / "marker").exists()
    assert listing(root.path) == ["ns"] and (root.path / "ns" / "run" / "workspace" / "README").exists()
    root.pin("ns", "run", None, now=NOW)  # unpinned: the last attempt wins again
    with contextlib.ExitStack() as stack:
        replace = Replacer(Reaper(root, in_use_checker(uninspectable_pids())), stack)
        root.retain(second, "ns", "run", job_id="j", created_at=NOW, retention=None, now=NOW, replace=replace)
    assert (root.path / "ns" / "run" / "workspace" / "marker").exists()


def test_a_replacing_retain_goes_through_the_callers_pipeline_which_may_refuse(tmp_path: Path) -> None:
    root = Root(tmp_path / "root")
    retain(root, tmp_path, "ns", "run", age=H)
    asked: list[tuple[str, str]] = []

    def held(ns: str, name: str, read: Read) -> Refusal | None:
        asked.append((ns, name))
        assert isinstance(read, Present) and read.manifest.job_id == "job-run"  # the read the pin was checked on
        return Refusal(Reason.IN_USE, "in use: pid 4242 has its cwd inside it")

    second = make_job(tmp_path / "retry")
    with pytest.raises(StoreError) as caught:
        root.retain(second, "ns", "run", job_id="j", created_at=NOW, retention=None, now=NOW, replace=held)
    assert caught.value.reason is Reason.IN_USE and "pid 4242" in str(caught.value)
    assert asked == [("ns", "run")] and (second / "README").exists() and listing(root.path) == ["ns"]

    def pipeline(ns: str, name: str, read: Read) -> Refusal | None:
        t = root.tombstone(ns, name, id="replaced", now=NOW)
        assert root.delete_tombstone(t).ok
        return None

    root.retain(second, "ns", "run", job_id="j2", created_at=NOW, retention=None, now=NOW, replace=pipeline)
    read = root.read("ns", "run")
    assert isinstance(read, Present) and read.manifest.job_id == "j2" and listing(root.path) == ["ns"]
