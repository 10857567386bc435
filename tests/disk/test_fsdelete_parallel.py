"""The parallel delete's helpers (issue 15, item 3; issue 31): a level's entries taken by several threads at once.

The hostile cases of tests/disk/test_fsdelete.py again, each arranged to happen where the parallel path runs: in a
helper thread, on a subtree it took or a batch of names it took from a level wide enough to be shared. The
caller's own walk waits for a helper to get there first, so the case happens in one whatever the machine's load.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from pathlib import Path

import pytest

from controller.node import fsdelete, walker
from controller.rules.contracts import Reason
from tests.bed.diskkit import THREADS_ONLY, User, listing, make_immutable, open_fds, outside_bait, require_root

pytest_plugins = ["tests.bed.diskkit"]
pytestmark = pytest.mark.usefixtures("engine")  # every test with both walkers but those marked THREADS_ONLY

WIDE = 3 * fsdelete._BATCH + 5  # several full batches and a short one


def wide(top: Path, files: int = WIDE, subdirs: int = 6) -> int:
    """`files` files in `top` beside `subdirs` subdirectories holding as many again each; returns the count."""
    top.mkdir()
    n = 0
    for i in range(files):
        (top / f"f{i:05d}").write_text("x")
        n += 1
    for d in range(subdirs):
        (top / f"d{d}").mkdir()
        for i in range(files):
            (top / f"d{d}" / f"f{i:05d}").write_text("x")
            n += 1
    return n


def in_helper() -> bool:
    return threading.current_thread().name.startswith("fsdelete_")


def after_a_helper(done: threading.Event) -> None:
    """In the caller's walk, wait (10 s at most) until a helper has done what the test arranges."""
    if not in_helper():
        done.wait(10)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_a_wide_tree_is_deleted_and_every_file_counted_once(tmp_path: Path, workers: int) -> None:
    n = wide(tmp_path / "t")
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert result == fsdelete.DeleteResult(True, Reason.DELETED, files=n)
    assert listing(tmp_path) == []


@THREADS_ONLY
def test_helpers_really_unlink_beside_the_walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = wide(tmp_path / "t")
    seen: set[str] = set()
    real, helped = fsdelete._unlink_names, threading.Event()

    def spy(dir_fd: int, names: list[str]) -> tuple[int, list[str]]:
        seen.add(threading.current_thread().name.rsplit("_", 1)[0])
        if in_helper():
            helped.set()
        after_a_helper(helped)
        return real(dir_fd, names)

    monkeypatch.setattr(fsdelete, "_unlink_names", spy)
    assert fsdelete.delete_tree(tmp_path, "t", workers=4).files == n
    assert "fsdelete" in seen  # the shared path ran, not only the walk's own batches


@THREADS_ONLY
def test_a_file_swapped_for_a_directory_while_a_helper_unlinks_it_is_descended_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The name was a file when read (d_type) and a directory by the time a helper unlinks it: EISDIR in the
    # helper, again through `unlink` in the walk, and the level is read again so the directory is deleted too.
    bait_file, bait_dir = outside_bait(tmp_path)
    n = wide(tmp_path / "t", subdirs=0)
    real, swapped, lock, done = fsdelete._unlink_names, list[str](), threading.Lock(), threading.Event()

    def swap_then_unlink(dir_fd: int, names: list[str]) -> tuple[int, list[str]]:
        after_a_helper(done)
        with lock:  # helpers run at once: exactly one of them swaps
            first = not swapped and in_helper()
            if first:
                swapped.append(names[-1])
        if first:
            name = names[-1]
            os.unlink(name, dir_fd=dir_fd)
            os.mkdir(name, dir_fd=dir_fd)
            os.symlink(bait_dir, f"/proc/self/fd/{dir_fd}/{name}/to-bait")
            Path(f"/proc/self/fd/{dir_fd}/{name}/inner").write_text("x")
            done.set()
        return real(dir_fd, names)

    monkeypatch.setattr(fsdelete, "_unlink_names", swap_then_unlink)
    result = fsdelete.delete_tree(tmp_path, "t", workers=4)
    assert swapped and result.ok and result.files == n - 1 + 2, result
    assert not (tmp_path / "t").exists()
    assert listing(bait_dir) == ["keep.txt"] and bait_file.read_text() == "must survive too\n"


@THREADS_ONLY
def test_a_directory_swapped_for_a_link_inside_a_worker_is_unlinked_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    top = tmp_path / "t"
    wide(top, files=40, subdirs=0)
    for d in range(24):  # enough subtrees that helpers take some
        (top / f"s{d}" / "inner").mkdir(parents=True)
        for i in range(40):
            (top / f"s{d}" / "inner" / f"f{i}").write_text("x")
    real, moved, lock, done = walker.Walker.open_dir, list[Path](), threading.Lock(), threading.Event()

    def swap_then_open(self: walker.Walker, parent: walker.Frame | None, name: str):  # type: ignore[no-untyped-def]
        if name == "inner":
            after_a_helper(done)
        with lock:  # helpers run at once: exactly one of them swaps
            if name == "inner" and not moved and in_helper() and parent is not None:
                assert parent.fd is not None
                away = tmp_path / "moved-away"
                os.rename(f"/proc/self/fd/{parent.fd}/inner", away)
                os.symlink(bait_dir, f"/proc/self/fd/{parent.fd}/inner")
                moved.append(away)
                done.set()
        return real(self, parent, name)

    monkeypatch.setattr(walker.Walker, "open_dir", swap_then_open)
    result = fsdelete.delete_tree(tmp_path, "t", workers=4)
    assert moved and result.ok and not top.exists(), result
    assert listing(bait_dir) == ["keep.txt"] and bait_file.read_text() == "must survive too\n"
    assert len(listing(moved[0])) == 40  # moved out of the tree before it was entered: not the delete's to touch


@pytest.mark.root
def test_an_immutable_file_a_helper_cannot_unlink_fails_with_its_errno_and_path(
    tmp_path: Path, immutable: list[Path]
) -> None:
    n = wide(tmp_path / "t", subdirs=2)
    stuck = tmp_path / "t" / "d1" / f"f{WIDE // 2:05d}"
    make_immutable(immutable, stuck)
    result = fsdelete.delete_tree(tmp_path, "t", workers=4)
    assert not result.ok and result.reason is Reason.DELETE_FAILED
    assert result.errno == errno.EPERM and result.path == str(stuck) and result.files == n - 1
    subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert fsdelete.delete_tree(tmp_path, "t", workers=4).ok and listing(tmp_path) == []


@pytest.mark.root
def test_a_mount_beside_a_wide_level_is_refused_and_everything_around_it_goes(
    tmp_path: Path, mounts: list[Path]
) -> None:
    require_root()
    _, bait_dir = outside_bait(tmp_path)
    top = tmp_path / "t"
    wide(top, subdirs=3)
    point = top / "d1" / "mnt"
    point.mkdir()
    subprocess.run(["mount", "--bind", str(bait_dir), str(point)], check=True)
    mounts.append(point)
    result = fsdelete.delete_tree(tmp_path, "t", workers=4)
    assert not result.ok and result.reason is Reason.CROSS_DEVICE and result.path == str(point)
    assert listing(bait_dir) == ["keep.txt"]
    assert listing(top) == ["d1"] and listing(top / "d1") == ["mnt"]


@pytest.mark.root
def test_unreadable_wide_directories_the_user_owns_are_deleted_with_helpers(
    shared_tmp: Path, throwaway_user: User
) -> None:
    # mode 0 and 0500 directories (the user's own): the walk makes them searchable and writable, then the
    # helpers unlink their files; as a non-root user, so the permissions really bind.
    top = shared_tmp / "t"
    n = wide(top, subdirs=2)
    subprocess.run(["chown", "-R", f"{throwaway_user.uid}:{throwaway_user.gid}", str(top)], check=True)
    shared_tmp.chmod(0o777)
    (top / "d0").chmod(0o000)
    (top / "d1").chmod(0o500)
    top.chmod(0o500)
    code = "import sys; from controller.node import fsdelete\nprint(fsdelete.delete_tree(sys.argv[1], 't', workers=4))"
    out = throwaway_user.python(code, str(shared_tmp))
    assert "ok=True" in out.stdout and f"files={n}" in out.stdout, out.stdout + out.stderr
    assert listing(shared_tmp) == []


@pytest.mark.parametrize("workers", [1, 4])
def test_a_10000_level_chain_with_a_wide_level_on_top_is_deleted_with_every_descriptor_closed(
    tmp_path: Path, workers: int
) -> None:
    top = tmp_path / "t"
    top.mkdir()
    for i in range(WIDE):
        (top / f"w{i}").write_text("x")
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(10_000):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(os.open(f"f{i % 3}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=child))
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    before = open_fds()
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert result.ok and result.files == WIDE + 10_000 and listing(tmp_path) == []
    # None of the delete's descriptors is left open (another test's objects may close theirs meanwhile).
    assert open_fds() - before == set()


@THREADS_ONLY
def test_a_helper_that_fails_unexpectedly_fails_the_delete_and_the_next_one_finishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wide(tmp_path / "t", subdirs=0)
    real, raised, done = fsdelete._unlink_names, list[str](), threading.Event()

    def boom(dir_fd: int, names: list[str]) -> tuple[int, list[str]]:
        after_a_helper(done)
        if in_helper() and not raised:
            raised.append(names[0])
            done.set()
            raise RuntimeError("a bug")
        return real(dir_fd, names)

    monkeypatch.setattr(fsdelete, "_unlink_names", boom)
    result = fsdelete.delete_tree(tmp_path, "t", workers=4)
    assert raised and not result.ok and result.reason is Reason.DELETE_FAILED, result
    monkeypatch.setattr(fsdelete, "_unlink_names", real)
    assert fsdelete.delete_tree(tmp_path, "t", workers=4).ok and listing(tmp_path) == []
