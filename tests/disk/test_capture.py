"""Captured volumes on a real filesystem with real bind mounts (controller/node/capture.py): publish, unpublish,
keep by rename, discard, and an agent killed at every step of a keep or a discard (strace delivers the SIGKILL
at each system call that changes the disk), which ends with exactly one sandbox or none, and nothing leaked."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
import stat
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from controller.node.capture import (
    LOCK_FILE,
    RECORD_NAME,
    Busy,
    Kept,
    Record,
    State,
    Volume,
    Volumes,
    entry_name,
    mount_points,
)
from controller.node.fsdelete import DeleteResult
from controller.node.inuse import Usage
from controller.node.reaper import Claim, Held, Hooks, Reaper, Renamed, Target
from controller.node.store import Present, Root, StoreError
from controller.rules.capture import origin_of
from controller.rules.contracts import MANIFEST_NAME, VOLUMES_DIR, WORKSPACE_DIR, Keep, Outcome, Reason
from controller.rules.models import Origin
from controller.rules.volume import VolumeError, VolumeRequest
from tests.bed.diskkit import NOW, REPO, require_root

MOUNTINFO = Path("/proc/self/mountinfo")
POD_UID = "0f5c2a7e-1b6d-4c8e-9a3f-5d2e7b1c4a90"
_libc = ctypes.CDLL(None, use_errno=True)


def unmount_under(top: Path) -> None:
    """Every mount below `top`, innermost first (a test's teardown: nothing it mounted outlives it)."""
    for _ in range(32):
        points = [p for p in mount_points(MOUNTINFO) if p == str(top) or p.startswith(f"{top}/")]
        if not points:
            return
        for point in sorted(points, key=len, reverse=True):
            _libc.umount2(os.fsencode(point), 0)
    raise AssertionError(f"mounts under {top} would not go")


@pytest.fixture
def volumes(tmp_path: Path) -> Iterator[Volumes]:
    require_root()
    try:
        yield Volumes(Root(tmp_path / "root"), clock=lambda: NOW)
    finally:
        unmount_under(tmp_path)


def request(tmp: Path, **fields: Any) -> VolumeRequest:
    """What the node service hands over for one inline volume of a Pod `team/build-42-x7k2p`."""
    uid = fields.pop("pod_uid", POD_UID)
    target = tmp / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~csi" / "workspace" / "mount"
    base: dict[str, Any] = {
        "volume_id": f"csi-{secrets.token_hex(32)}",
        "target_path": str(target),
        "pod_namespace": "team",
        "pod_name": "build-42-x7k2p",
        "pod_uid": uid,
        "service_account": "default",
    }
    return VolumeRequest(**(base | fields))


def mounts_at(path: str) -> list[str]:
    """The options of each mount at `path`, as mountinfo lists them."""
    out = []
    for line in MOUNTINFO.read_text().splitlines():
        parts = line.split(" ")
        if parts[4] == path:
            out.append(parts[5])
    return out


def record_of(v: Volumes, req: VolumeRequest) -> Record:
    volume = next(x for x in v.records() if x.entry == entry_name(req.volume_id))
    assert volume.record is not None, volume.why
    return volume.record


def tree(top: Path) -> dict[str, str]:
    return {str(p.relative_to(top)): p.read_text() for p in sorted(top.rglob("*")) if p.is_file()}


def origin(req: VolumeRequest, outcome: Outcome = Outcome.FAILED) -> Any:
    return origin_of(None, outcome, pod_name=req.pod_name, pod_uid=req.pod_uid, node="node-a")


# --- publish -----------------------------------------------------------------------------------------------------
def test_publish_mounts_a_fresh_workspace_at_the_target_once_however_often_asked(
    volumes: Volumes, tmp_path: Path
) -> None:
    req = request(tmp_path, keep=Keep.ON_FAILURE, retention=timedelta(hours=6))
    volumes.publish(req)
    volumes.publish(req)  # the kubelet retries: the same id at the same path is the same publish
    assert len(mounts_at(req.target_path)) == 1
    opts = mounts_at(req.target_path)[0].split(",")
    assert {"rw", "nosuid", "nodev"} <= set(opts)
    Path(req.target_path, "out.txt").write_text("built\n")
    entry = volumes.path / entry_name(req.volume_id)
    assert (entry / WORKSPACE_DIR / "out.txt").read_text() == "built\n"
    assert stat.S_IMODE(volumes.path.stat().st_mode) == 0o700 and stat.S_IMODE(entry.stat().st_mode) == 0o700
    record = json.loads((entry / RECORD_NAME).read_text())
    assert record["volumeId"] == req.volume_id and record["state"] == "published"
    assert (record["keep"], record["retentionSeconds"], record["podUID"]) == ("OnFailure", 6 * 3600, POD_UID)
    assert stat.S_IMODE((entry / RECORD_NAME).stat().st_mode) == 0o600
    scan = volumes.root.scan()
    assert (scan.sandboxes, scan.strays, scan.tombstones) == ([], [], [])  # the root's own: no stray


def test_without_fs_group_any_uid_of_the_pod_writes_and_with_one_its_group_owns_what_it_makes(
    volumes: Volumes, tmp_path: Path
) -> None:
    plain = request(tmp_path)
    grouped = request(tmp_path, pod_uid="11111111-2222-3333-4444-555555555555", mount_group=2000)
    for req in (plain, grouped):
        volumes.publish(req)
    ws_plain = volumes.path / entry_name(plain.volume_id) / WORKSPACE_DIR
    ws_grouped = volumes.path / entry_name(grouped.volume_id) / WORKSPACE_DIR
    assert stat.S_IMODE(ws_plain.stat().st_mode) == 0o1777 and ws_plain.stat().st_uid == 0
    assert stat.S_IMODE(ws_grouped.stat().st_mode) == 0o2775 and ws_grouped.stat().st_gid == 2000
    # a non-root Pod user, inside its mount (cwd: the ancestors of a Pod's mount are not its to traverse)
    script = ["/bin/sh", "-c", "mkdir d && echo x > d/f"]
    subprocess.run(script, cwd=plain.target_path, user=1000, group=1000, check=True)
    subprocess.run(script, cwd=grouped.target_path, user=1001, group=1001, extra_groups=[2000], check=True)
    assert (ws_plain / "d" / "f").stat().st_uid == 1000
    assert (ws_grouped / "d").stat().st_gid == 2000 and (ws_grouped / "d" / "f").stat().st_gid == 2000
    outsider = ["/bin/sh", "-c", "echo x > outsider"]
    refused = subprocess.run(outsider, cwd=grouped.target_path, user=1002, group=1002, capture_output=True)
    assert refused.returncode != 0, "a uid outside the Pod's fsGroup cannot write"


def test_a_read_only_publish_cannot_be_written(volumes: Volumes, tmp_path: Path) -> None:
    req = request(tmp_path, read_only=True)
    volumes.publish(req)
    assert "ro" in mounts_at(req.target_path)[0].split(",")
    with pytest.raises(OSError) as caught:
        Path(req.target_path, "x").write_text("no")
    assert caught.value.errno == errno.EROFS


def test_a_second_publish_of_a_volume_at_another_path_is_already_exists(volumes: Volumes, tmp_path: Path) -> None:
    req = request(tmp_path)
    volumes.publish(req)
    other = req.target_path.replace("/workspace/", "/other/")
    with pytest.raises(VolumeError) as caught:
        volumes.publish(request(tmp_path, volume_id=req.volume_id, target_path=other))
    assert caught.value.code == "ALREADY_EXISTS" and req.target_path in caught.value.message
    assert mounts_at(other) == [] and len(mounts_at(req.target_path)) == 1


@pytest.mark.parametrize("how", ["symlink", "file"])
def test_a_target_that_is_a_link_or_a_file_is_refused_and_leaves_nothing(
    volumes: Volumes, tmp_path: Path, how: str
) -> None:
    req = request(tmp_path)
    target = Path(req.target_path)
    target.parent.mkdir(parents=True)
    bait = tmp_path / "bait"
    bait.mkdir()
    if how == "symlink":
        target.symlink_to(bait)
    else:
        target.write_text("")
    with pytest.raises(VolumeError) as caught:
        volumes.publish(req)
    assert caught.value.code == "INVALID_ARGUMENT" and "never followed" in caught.value.message
    assert mounts_at(str(bait)) == [] and mounts_at(req.target_path) == []
    assert list(volumes.records()) == [] and volumes.root.tombstones() == []


def bind(source: Path, target: Path) -> None:
    """`mount --bind source target`: something that is not the volume's, where the kubelet wants it."""
    assert _libc.mount(os.fsencode(source), os.fsencode(target), None, ctypes.c_ulong(0x1000), None) == 0


def test_a_target_with_something_else_mounted_on_it_is_refused_and_left_as_it_is(
    volumes: Volumes, tmp_path: Path
) -> None:
    req = request(tmp_path)
    target, other = Path(req.target_path), tmp_path / "other"
    target.mkdir(parents=True)
    other.mkdir()
    bind(other, target)
    with pytest.raises(VolumeError) as caught:
        volumes.publish(req)
    assert caught.value.code == "FAILED_PRECONDITION" and "something else is mounted" in caught.value.message
    assert len(mounts_at(req.target_path)) == 1 and target.stat().st_ino == other.stat().st_ino
    volumes.unpublish(req.volume_id, req.target_path)  # it never was ours: left mounted
    assert len(mounts_at(req.target_path)) == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"target_path": "relative/mount"},
        {"target_path": "/var/lib/kubelet/pods/../../../etc"},
        {"volume_id": ""},
        {"volume_id": "x" * 2000},
        {"pod_namespace": "Not_A_Namespace"},
        {"sandbox": "Run_42"},
    ],
    ids=["relative", "dotdot", "empty-id", "long-id", "bad-namespace", "bad-sandbox"],
)
def test_a_request_that_cannot_be_used_is_invalid_argument_and_makes_nothing(
    volumes: Volumes, tmp_path: Path, fields: dict[str, Any]
) -> None:
    with pytest.raises(VolumeError) as caught:
        volumes.publish(request(tmp_path, **fields))
    assert caught.value.code == "INVALID_ARGUMENT"
    assert not volumes.path.exists()


# --- unpublish ---------------------------------------------------------------------------------------------------
def test_unpublish_unmounts_removes_the_target_and_records_it_once(volumes: Volumes, tmp_path: Path) -> None:
    req = request(tmp_path)
    volumes.publish(req)
    Path(req.target_path, "out.txt").write_text("kept?\n")
    volumes.unpublish(req.volume_id, req.target_path)
    assert mounts_at(req.target_path) == [] and not Path(req.target_path).exists()
    first = record_of(volumes, req)
    assert first.state is State.UNPUBLISHED and first.unpublished_at is not None
    later = Volumes(volumes.root, clock=lambda: NOW + timedelta(minutes=5))
    later.unpublish(req.volume_id, req.target_path)  # retried: still the first unpublish
    assert record_of(volumes, req) == first
    assert tree(volumes.path / entry_name(req.volume_id) / WORKSPACE_DIR) == {"out.txt": "kept?\n"}


def test_an_unknown_volume_unpublishes_fine_and_a_mount_that_is_not_ours_is_left(
    volumes: Volumes, tmp_path: Path
) -> None:
    volumes.unpublish("csi-never-seen", str(tmp_path / "nowhere" / "mount"))
    req = request(tmp_path)
    volumes.publish(req)
    volumes.unpublish(req.volume_id, req.target_path + "-elsewhere")  # not where it is published: nothing done
    assert len(mounts_at(req.target_path)) == 1 and record_of(volumes, req).state is State.PUBLISHED


def test_an_unpublish_under_something_mounted_on_top_of_the_workspace_is_refused_and_keeps_the_record(
    volumes: Volumes, tmp_path: Path
) -> None:
    req = request(tmp_path)
    volumes.publish(req)
    other = tmp_path / "other"
    other.mkdir()
    bind(other, Path(req.target_path))
    with pytest.raises(VolumeError) as caught:
        volumes.unpublish(req.volume_id, req.target_path)
    assert caught.value.code == "FAILED_PRECONDITION" and "on top of its workspace" in caught.value.message
    assert len(mounts_at(req.target_path)) == 2 and record_of(volumes, req).state is State.PUBLISHED


def test_a_publish_after_an_unpublish_mounts_it_again(volumes: Volumes, tmp_path: Path) -> None:
    req = request(tmp_path)
    volumes.publish(req)
    Path(req.target_path, "a").write_text("1")
    volumes.unpublish(req.volume_id, req.target_path)
    volumes.publish(req)  # the kubelet, after a restart, for a Pod still running
    assert Path(req.target_path, "a").read_text() == "1"
    assert record_of(volumes, req).state is State.PUBLISHED and record_of(volumes, req).unpublished_at is None


# --- keep and discard --------------------------------------------------------------------------------------------
def published_and_unpublished(v: Volumes, tmp: Path, **fields: Any) -> tuple[VolumeRequest, str]:
    req = request(tmp, **fields)
    v.publish(req)
    (Path(req.target_path) / "logs").mkdir()
    Path(req.target_path, "logs", "build.log").write_text("error: it failed\n")
    Path(req.target_path, "out.bin").write_bytes(b"\x00" * 4096)
    v.unpublish(req.volume_id, req.target_path)
    return req, entry_name(req.volume_id)


def test_keep_renames_the_workspace_into_a_sandbox_with_its_origin_and_removes_the_entry(
    volumes: Volumes, tmp_path: Path
) -> None:
    req, entry = published_and_unpublished(volumes, tmp_path, retention=timedelta(hours=6))
    inode = (volumes.path / entry / WORKSPACE_DIR).stat().st_ino
    result = volumes.keep(entry, origin(req), "Failed and keep: Always")
    assert isinstance(result, Kept) and result.namespace == "team" and result.name.startswith("build-42-x7k2p-")
    sandbox = volumes.root.path / "team" / result.name
    assert (sandbox / WORKSPACE_DIR).stat().st_ino == inode, "moved by rename, never copied"
    assert tree(sandbox / WORKSPACE_DIR) == {"logs/build.log": "error: it failed\n", "out.bin": "\x00" * 4096}
    read = volumes.root.read("team", result.name)
    assert isinstance(read, Present) and read.manifest.origin == origin(req)
    assert read.manifest.job_id == "Pod/build-42-x7k2p" and read.manifest.created_at == "2026-11-29T12:00:00.000Z"
    assert read.manifest.retain_until == "2026-11-29T18:00:00.000Z"
    assert list(volumes.records()) == [] and volumes.root.tombstones() == []
    assert volumes.keep(entry, origin(req), "again") is None, "a keep run again after it finished does nothing"


def test_a_chosen_name_that_is_taken_keeps_it_under_the_generated_one(volumes: Volumes, tmp_path: Path) -> None:
    first, e1 = published_and_unpublished(volumes, tmp_path, name="results")
    second, e2 = published_and_unpublished(
        volumes, tmp_path, name="results", pod_uid="11111111-2222-3333-4444-555555555555"
    )
    assert volumes.keep(e1, origin(first), "x") == Kept("team", "results")
    kept = volumes.keep(e2, origin(second), "x")
    assert isinstance(kept, Kept) and kept.name.startswith("results-") and len(kept.name) == len("results-") + 5
    assert sorted(p.name for p in (volumes.root.path / "team").iterdir()) == sorted(["results", kept.name])


def test_a_mounted_volume_is_never_kept_or_discarded(volumes: Volumes, tmp_path: Path) -> None:
    req = request(tmp_path)
    volumes.publish(req)
    entry = entry_name(req.volume_id)
    assert volumes.keep(entry, origin(req), "x") == Busy(req.target_path)
    assert volumes.discard(entry) == Busy(req.target_path)
    assert record_of(volumes, req).state is State.PUBLISHED and len(mounts_at(req.target_path)) == 1


def test_discard_deletes_the_entry_through_a_tombstone(volumes: Volumes, tmp_path: Path) -> None:
    _req, entry = published_and_unpublished(volumes, tmp_path)
    result = volumes.discard(entry)
    assert isinstance(result, DeleteResult) and result.ok and result.files == 3  # two files and the record
    assert list(volumes.records()) == [] and volumes.root.tombstones() == []
    assert not (volumes.root.path / "team").exists()
    assert volumes.discard(entry) is None


def test_records_stream_every_entry_and_say_why_one_has_none(volumes: Volumes, tmp_path: Path) -> None:
    _req, entry = published_and_unpublished(volumes, tmp_path)
    (volumes.path / "00deadbeef").mkdir()
    (volumes.path / "00badrecord").mkdir()
    (volumes.path / "00badrecord" / RECORD_NAME).write_text("{not json")
    (volumes.path / "00alink").symlink_to(tmp_path)
    found: dict[str, Volume] = {v.entry: v for v in volumes.records()}
    assert set(found) == {entry, "00deadbeef", "00badrecord"}, "a link is no entry"
    assert found[entry].record is not None and found[entry].record.state is State.UNPUBLISHED
    assert found["00deadbeef"].record is None and "no record" in found["00deadbeef"].why
    assert found["00badrecord"].record is None and "does not parse" in found["00badrecord"].why


def test_a_retain_from_inside_the_volumes_directory_is_refused_unless_it_is_a_volumes_keep(
    volumes: Volumes, tmp_path: Path
) -> None:
    _req, entry = published_and_unpublished(volumes, tmp_path)
    with pytest.raises(StoreError) as caught:
        volumes.root.retain(
            volumes.path / entry / WORKSPACE_DIR, "team", "sneaky", job_id="j", created_at=NOW, retention=None
        )
    assert caught.value.reason is Reason.PATH_OUTSIDE_ROOT
    with pytest.raises(StoreError) as deeper:  # and a keep takes its entry's workspace itself, nothing below it
        volumes.root.retain(
            volumes.path / entry / WORKSPACE_DIR / "logs", "team", "x", job_id="j", created_at=NOW, retention=None
        )
    assert deeper.value.reason is Reason.PATH_OUTSIDE_ROOT


# --- an agent killed at every step -----------------------------------------------------------------------------
# The system calls that change what is on disk; a kill right before each one (strace, SIGKILL on entry) leaves
# every state a real crash can leave. fsync is left out: it changes nothing a crash without power loss can see.
CHANGES = "mkdir,mkdirat,rename,renameat,renameat2,unlink,unlinkat,rmdir,fchmod,fchown,fchmodat,fchownat,linkat"
MARK = "/sandkeep-capture-test-marker"  # an rmdir that fails: where the step under test starts in a trace

STEP = textwrap.dedent(
    """
    import functools, os, sys
    from datetime import UTC, datetime
    from controller.node import fsdelete
    from controller.node.capture import Volumes
    from controller.node.store import Root
    from controller.rules.models import Origin
    root, entry, verb, origin = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    volumes = Volumes(Root(root, create=False))
    # The delete in one thread, so strace cuts it at each of its calls in turn (its helper threads would die
    # with the process all the same, leaving the tombstone the next pass finishes).
    fsdelete.delete_tree = functools.partial(fsdelete.delete_tree, workers=1)
    try:
        os.rmdir(MARK)
    except OSError:
        pass
    if verb == "keep":
        volumes.keep(entry, Origin.model_validate_json(origin), "Failed and keep: Always")
    else:
        volumes.discard(entry)
    """
).replace("MARK", repr(MARK))


def run_step(
    root: Path, entry: str, verb: str, origin_json: str, strace: list[str]
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-B", "-c", STEP, str(root), entry, verb, origin_json]
    # SANDKEEP_RMTREE="": the delete in this process's threads, not the compiled walker's process (see STEP)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "SANDKEEP_RMTREE": ""}
    return subprocess.run(["strace", "-f", "-qq", *strace, *args], cwd=REPO, env=env, capture_output=True, text=True)


def steps_of(root: Path, entry: str, verb: str, origin_json: str, log: Path) -> list[tuple[str, int]]:
    """(system call, its count from the process's start) for every disk-changing call the step makes."""
    done = run_step(root, entry, verb, origin_json, ["-o", str(log), f"--trace={CHANGES}"])
    assert done.returncode == 0, done.stderr
    seen: Counter[str] = Counter()
    steps: list[tuple[str, int]] = []
    started, pids = False, set()
    for line in log.read_text().splitlines():
        pid, _, call = line.partition(" ")
        name = call.strip().partition("(")[0]
        if not name or name.startswith(("+++", "---", "<...")):
            continue
        seen[name] += 1
        if MARK in call:
            started = True
        elif started:
            steps.append((name, seen[name]))
            pids.add(pid)
    assert steps and len(pids) == 1, f"the step must run in one thread to be cut at each call: {log.read_text()}"
    return steps


def recover(root: Root, verb: str, origin: Origin) -> None:
    """What the next agent's pass does: captured volumes first (one decided keeps its decision; one not yet
    decided is decided again, the same way: its Pod has not changed), then leftover tombstones (deleted: no
    object owns them)."""
    volumes = Volumes(root, clock=lambda: NOW)
    for volume in list(volumes.records()):
        record = volume.record
        if record is None:
            volumes.discard(volume.entry)
        elif record.state in (State.KEEPING, State.KEPT) and record.origin is not None:
            volumes.keep(volume.entry, record.origin, record.why or "")
        elif verb == "keep":
            volumes.keep(volume.entry, origin, "Failed and keep: Always")
        else:
            volumes.discard(volume.entry)
    for tomb in root.tombstones():
        assert root.delete_tombstone(tomb).ok


def leftovers(root: Root) -> list[str]:
    """Anything in the root that is neither a sandbox nor an empty volumes directory: temp files, tombstones."""
    out = [
        str(p.relative_to(root.path))
        for p in root.path.rglob(".*")
        if p.name not in (".commands", ".sandkeep.lock", LOCK_FILE)
    ]
    return [p for p in out if p != VOLUMES_DIR]


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["keep", "discard"])
def test_an_agent_killed_at_any_step_ends_with_exactly_one_sandbox_or_none_and_nothing_leaked(
    volumes: Volumes, tmp_path: Path, verb: str
) -> None:
    files = {"logs/build.log": "error: it failed\n", "out.bin": "\x00" * 4096}
    req, entry = published_and_unpublished(volumes, tmp_path)
    origin_json = origin(req).model_dump_json(by_alias=True)
    steps = steps_of(volumes.root.path, entry, verb, origin_json, tmp_path / "trace.log")
    assert len(steps) >= (10 if verb == "keep" else 2), steps
    for name, count in steps:
        subprocess.run(["rm", "-rf", str(volumes.root.path / "team")], check=True)
        req, entry = published_and_unpublished(volumes, tmp_path)  # the same step on a new volume: same calls
        killed = run_step(volumes.root.path, entry, verb, origin_json, [f"--inject={name}:signal=KILL:when={count}"])
        assert killed.returncode == -9 or "+++ killed by SIGKILL" in killed.stderr, (name, count, killed.stderr)
        recover(volumes.root, verb, origin(req))
        sandboxes = [p for p in (volumes.root.path / "team").iterdir()] if (volumes.root.path / "team").exists() else []
        where = f"killed at {name} #{count}"
        assert list(volumes.records()) == [], where
        assert leftovers(volumes.root) == [], where
        if verb == "discard":
            assert sandboxes == [], where
            continue
        assert len(sandboxes) == 1, f"{where}: {sandboxes}"  # never two; and with the workspace moved back, never none
        assert tree(sandboxes[0] / WORKSPACE_DIR) == files, where
        read = volumes.root.read("team", sandboxes[0].name)
        assert isinstance(read, Present) and read.manifest.origin == origin(req), where
        assert (sandboxes[0] / MANIFEST_NAME).stat().st_mode & 0o777 == 0o600, where


# --- reopen -------------------------------------------------------------------------------------------------------
def retained(volumes: Volumes, tmp_path: Path, namespace: str = "team", name: str = "run-42") -> Path:
    """A real retained sandbox of the root, kept by `Root.retain` from a job directory with one file."""
    job = tmp_path / f"job-{name}"
    (job / "logs").mkdir(parents=True)
    (job / "logs" / "build.log").write_text("error: it failed\n")
    volumes.root.retain(job, namespace, name, job_id="j-1", created_at=NOW, retention=None, node="n1", now=NOW)
    return volumes.root.path / namespace / name / WORKSPACE_DIR


def test_a_reopen_mounts_the_sandboxs_workspace_read_only_and_its_unpublish_leaves_no_entry(
    volumes: Volumes, tmp_path: Path
) -> None:
    workspace = retained(volumes, tmp_path)
    req = request(tmp_path, sandbox="run-42", read_only=True)
    volumes.publish(req)
    volumes.publish(req)  # the kubelet's retry: the same mount, once
    target = Path(req.target_path)
    assert (target / "logs" / "build.log").read_text() == "error: it failed\n"
    (options,) = mounts_at(req.target_path)
    assert {"ro", "nosuid", "nodev"} <= set(options.split(","))
    with pytest.raises(OSError) as caught:
        (target / "new.txt").write_text("x")
    assert caught.value.errno == errno.EROFS
    (volume,) = volumes.records()
    assert volume.record is not None and volume.record.sandbox == "run-42"
    assert volume.record.state is State.PUBLISHED and not (volumes.path / volume.entry / WORKSPACE_DIR).exists()
    holds, unknown = volumes.reopened()
    assert holds == [("pod team/build-42-x7k2p (reopen volume)", volumes.root.path / "team" / "run-42")]
    assert unknown == []
    volumes.unpublish(req.volume_id, req.target_path)
    assert mounts_at(req.target_path) == [] and list(volumes.records()) == [] and volumes.reopened() == ([], [])
    assert (workspace / "logs" / "build.log").exists()  # nothing of the sandbox goes with its reopen


def test_a_read_write_reopen_writes_into_the_sandbox(volumes: Volumes, tmp_path: Path) -> None:
    workspace = retained(volumes, tmp_path)
    req = request(tmp_path, sandbox="run-42", read_only=False)
    volumes.publish(req)
    (Path(req.target_path) / "notes.txt").write_text("looked at it")
    assert (workspace / "notes.txt").read_text() == "looked at it"
    volumes.unpublish(req.volume_id, req.target_path)


@pytest.mark.parametrize("how", ["absent", "link", "mismatch"])
def test_a_reopen_of_a_sandbox_it_cannot_trust_is_refused_and_mounts_nothing(
    volumes: Volumes, tmp_path: Path, how: str
) -> None:
    if how == "link":  # team/run-42 is a link to another namespace's sandbox: never followed
        retained(volumes, tmp_path, "other", "run-42")
        (volumes.root.path / "team").mkdir()
        (volumes.root.path / "team" / "run-42").symlink_to(volumes.root.path / "other" / "run-42")
    elif how == "mismatch":  # a manifest of other/run-42 under team/run-42
        retained(volumes, tmp_path, "other", "run-42")
        (volumes.root.path / "team").mkdir()
        (volumes.root.path / "other" / "run-42").rename(volumes.root.path / "team" / "run-42")
    req = request(tmp_path, sandbox="run-42")
    with pytest.raises(VolumeError) as caught:
        volumes.publish(req)
    assert caught.value.code == ("NOT_FOUND" if how == "absent" else "FAILED_PRECONDITION")
    assert "RetainedSandbox team/run-42" in caught.value.message
    assert mounts_at(req.target_path) == [] and list(volumes.records()) == []


def test_a_reopen_whose_unpublish_never_came_is_forgotten_only_once_unmounted_and_never_its_sandbox(
    volumes: Volumes, tmp_path: Path
) -> None:
    workspace = retained(volumes, tmp_path)
    req = request(tmp_path, sandbox="run-42")
    volumes.publish(req)
    entry = entry_name(req.volume_id)
    assert volumes.forget(entry) == Busy(req.target_path)  # still mounted: in use, the hold stays
    unmount_under(Path(req.target_path))  # the node rebooted: its mounts are gone, the record is not
    assert volumes.forget(entry) is True and list(volumes.records()) == [] and volumes.reopened() == ([], [])
    assert (workspace / "logs" / "build.log").exists()
    capture = request(tmp_path, pod_uid="1f5c2a7e-1b6d-4c8e-9a3f-5d2e7b1c4a91")
    volumes.publish(capture)
    unmount_under(Path(capture.target_path))
    assert volumes.forget(entry_name(capture.volume_id)) is False  # a capture's entry is never a reopen's to drop


# --- a reopen recorded between the agent's in-use look and its rename (the per-sandbox mark and lock) --------
def not_in_use(paths: Any) -> dict[Any, Usage]:
    return {i: Usage(False) for i in paths}


def test_a_reopen_published_after_the_in_use_look_holds_the_rename_and_without_the_guard_would_not(
    volumes: Volumes, tmp_path: Path
) -> None:
    workspace = retained(volumes, tmp_path)
    target = Target("team", "run-42", "uid-1", Claim(created_at=None), Reason.DELETED)
    req = request(tmp_path, sandbox="run-42")
    published = Hooks(after_check=lambda key, tomb: volumes.publish(req))  # after the look, before the rename
    held = Reaper(volumes.root, in_use_many=not_in_use, hooks=published, guard=volumes).reap(target)
    assert isinstance(held, Held) and held.reason == Reason.IN_USE and "reopen volume" in (held.error or "")
    assert (workspace / "logs" / "build.log").exists() and (Path(req.target_path) / "logs").is_dir()
    volumes.unpublish(req.volume_id, req.target_path)
    # The same sequence without the guard renames the sandbox while the Pod has it mounted: what it prevents.
    again = request(tmp_path, sandbox="run-42", pod_uid="1a2b3c4d-0000-4000-8000-000000000001")
    unguarded = Hooks(after_check=lambda key, tomb: volumes.publish(again))
    step = Reaper(volumes.root, in_use_many=not_in_use, hooks=unguarded).prepare([target])[0]
    assert isinstance(step, Renamed) and not workspace.exists()
    assert (Path(again.target_path) / "logs" / "build.log").exists()  # a tombstone's workspace, still mounted
    volumes.unpublish(again.volume_id, again.target_path)


def test_the_rename_waits_while_another_process_records_a_reopen_of_the_same_sandbox(
    volumes: Volumes, tmp_path: Path
) -> None:
    retained(volumes, tmp_path)
    key = ("team", "run-42")
    seen = volumes.seen([key])[key]
    code = textwrap.dedent(
        f"""
        import fcntl, sys
        from pathlib import Path
        from controller.node.capture import Volumes
        from controller.node.store import Root
        v = Volumes(Root(Path({str(volumes.root.path)!r})))
        with v._slot({key!r}, fcntl.LOCK_EX) as mark:  # as csi-node holds it while it records a reopen
            print("locked", flush=True)
            sys.stdin.readline()
            v._bump(mark)  # its reopen recorded
        """
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline() == "locked\n"
        answer: list[bool] = []
        renaming = threading.Thread(target=lambda: answer.extend(_unchanged(volumes, key, seen)))
        renaming.start()
        renaming.join(0.5)
        assert renaming.is_alive() and answer == [], "the rename waits for the other process's record"
        other.stdin.write("go\n")
        other.stdin.flush()
        renaming.join(30)
        assert answer == [False], "and then sees it, so the sandbox is held"
    finally:
        other.kill()
        other.wait()
    assert volumes.seen([key])[key] == seen + 1


def _unchanged(volumes: Volumes, key: tuple[str, str], seen: int) -> list[bool]:
    with volumes.unchanged(key, seen) as unchanged:
        return [unchanged]
