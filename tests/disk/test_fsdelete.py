"""Safe deletion on a real filesystem: links never followed, mounts never entered, deep trees, stuck files."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from pathlib import Path

import pytest

from controller.node import fsdelete, nofollow, treesize, walker
from controller.rules.contracts import Reason
from tests.bed.diskkit import THREADS_ONLY, User, listing, make_immutable, open_fds, outside_bait, require_root

pytest_plugins = ["tests.bed.diskkit"]  # fixtures: throwaway_user, shared_tmp, immutable, mounts
pytestmark = pytest.mark.usefixtures("engine")  # every test with both walkers but those marked THREADS_ONLY


def tree(top: Path, dirs: int = 6, files: int = 20) -> int:
    """A small nested tree; returns how many files it holds."""
    n = 0
    for d in range(dirs):
        sub = top / f"d{d}" / "inner"
        sub.mkdir(parents=True)
        for f in range(files):
            (sub / f"f{f}").write_text("x")
            n += 1
    (top / "top.txt").write_text("x")
    return n + 1


@pytest.mark.parametrize("workers", [1, 4])
def test_a_tree_is_deleted_and_its_files_counted(tmp_path: Path, workers: int) -> None:
    n = tree(tmp_path / "t")
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert result == fsdelete.DeleteResult(True, Reason.DELETED, files=n)
    assert listing(tmp_path) == []


def test_an_absent_tree_is_already_deleted(tmp_path: Path) -> None:
    assert fsdelete.delete_tree(tmp_path, "never-there").ok


@pytest.mark.parametrize("workers", [1, 4])
def test_links_inside_the_tree_are_unlinked_never_followed(tmp_path: Path, workers: int) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    top = tmp_path / "t"
    tree(top)
    (top / "d0" / "to-dir").symlink_to(bait_dir)
    (top / "d1" / "inner" / "to-file").symlink_to(bait_file)
    (top / "to-root").symlink_to("/")
    (top / "dangling").symlink_to(tmp_path / "nothing")
    os.link(bait_file, top / "hardlink")
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert result.ok and not top.exists()
    assert listing(bait_dir) == ["keep.txt"] and bait_file.read_text() == "must survive too\n"


def test_a_top_level_link_is_unlinked_and_its_target_survives(tmp_path: Path) -> None:
    _, bait_dir = outside_bait(tmp_path)
    (tmp_path / "t").symlink_to(bait_dir)
    assert fsdelete.delete_tree(tmp_path, "t").ok
    assert not (tmp_path / "t").is_symlink() and listing(bait_dir) == ["keep.txt"]


def test_names_that_would_leave_the_parent_are_refused(tmp_path: Path) -> None:
    for bad in ("..", ".", "", "a/b", "../x"):
        with pytest.raises(ValueError, match="single entry name"):
            fsdelete.delete_tree(tmp_path, bad)


@pytest.mark.root
@pytest.mark.parametrize("workers", [1, 4])
def test_an_immutable_file_fails_the_delete_with_its_errno_and_path(
    tmp_path: Path, immutable: list[Path], workers: int
) -> None:
    n = tree(tmp_path / "t")
    stuck = tmp_path / "t" / "d3" / "inner" / "f7"
    make_immutable(immutable, stuck)
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert not result.ok and result.reason is Reason.DELETE_FAILED
    assert result.errno == errno.EPERM and result.path == str(stuck)
    assert result.files == n - 1  # everything else went
    assert "Operation not permitted" in result.describe()
    subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert fsdelete.delete_tree(tmp_path, "t", workers=workers).ok and listing(tmp_path) == []


@pytest.mark.root
@pytest.mark.parametrize("kind", ["bind", "tmpfs"])
def test_a_mount_inside_the_tree_is_refused_never_entered(tmp_path: Path, mounts: list[Path], kind: str) -> None:
    require_root()
    _, bait_dir = outside_bait(tmp_path)
    top = tmp_path / "t"
    tree(top)
    point = top / "d2" / "mnt"
    point.mkdir()
    if kind == "bind":
        subprocess.run(["mount", "--bind", str(bait_dir), str(point)], check=True)
    else:
        subprocess.run(["mount", "-t", "tmpfs", "none", str(point)], check=True)
        (point / "on-tmpfs").write_text("x")
    mounts.append(point)
    result = fsdelete.delete_tree(tmp_path, "t")
    assert not result.ok and result.reason is Reason.CROSS_DEVICE and result.path == str(point)
    assert listing(point) == (["keep.txt"] if kind == "bind" else ["on-tmpfs"])
    assert listing(bait_dir) == ["keep.txt"]
    assert listing(top) == ["d2"] and listing(top / "d2") == ["mnt"]  # everything around it went


def _deep(top: Path, depth: int) -> None:
    """A chain deeper than PATH_MAX allows by path: built fd-relative."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            with open(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=child), "w") as f:
                f.write("x")
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


@pytest.mark.parametrize("workers", [1, 4])
def test_a_tree_deeper_than_path_max_and_the_fd_budget_is_deleted(tmp_path: Path, workers: int) -> None:
    _deep(tmp_path / "t", 2500)  # 2500 levels: 5000+ bytes of path, and far more dirs than open fds kept
    before = open_fds()
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert result.ok and result.files == 2500 and listing(tmp_path) == []
    assert open_fds() - before == set()  # every descriptor closed


@pytest.mark.root
@pytest.mark.parametrize("workers", [1, 4])
def test_read_only_directories_the_user_owns_are_deleted_as_that_user(
    shared_tmp: Path, throwaway_user: User, workers: int
) -> None:
    top = shared_tmp / "t"
    tree(top, dirs=3, files=3)
    subprocess.run(["chown", "-R", f"{throwaway_user.uid}:{throwaway_user.gid}", str(top)], check=True)
    shared_tmp.chmod(0o777)
    (top / "d0" / "inner").chmod(0o500)
    (top / "d1" / "inner").chmod(0o000)
    (top / "d2").chmod(0o300)
    top.chmod(0o500)
    code = "import sys; from controller.node import fsdelete\n"
    code += "print(fsdelete.delete_tree(sys.argv[1], 't', workers=int(sys.argv[2])))"
    out = throwaway_user.python(code, str(shared_tmp), str(workers))
    assert "ok=True" in out.stdout, out.stdout + out.stderr
    assert listing(shared_tmp) == []


@pytest.mark.root
def test_another_users_files_are_not_made_writable(shared_tmp: Path, throwaway_user: User) -> None:
    # root's read-only directory inside a tree a non-root user deletes: refused with the path, never chmod'ed.
    top = shared_tmp / "t"
    tree(top, dirs=2, files=2)
    subprocess.run(["chown", "-R", f"{throwaway_user.uid}:{throwaway_user.gid}", str(top)], check=True)
    os.chown(top / "d1" / "inner", 0, 0)
    (top / "d1" / "inner").chmod(0o555)
    shared_tmp.chmod(0o777)
    out = throwaway_user.python(
        "import sys; from controller.node import fsdelete\n"
        "r = fsdelete.delete_tree(sys.argv[1], 't'); print(r.errno, r.path)",
        str(shared_tmp),
    )
    code, path = out.stdout.split()
    assert int(code) == errno.EACCES and Path(path).parent == top / "d1" / "inner", out.stderr
    assert (top / "d1" / "inner").stat().st_mode & 0o777 == 0o555


def test_the_event_loop_keeps_running_while_a_tree_is_deleted(tmp_path: Path) -> None:
    tree(tmp_path / "t", dirs=40, files=100)
    ticks = 0

    async def main() -> fsdelete.DeleteResult:
        nonlocal ticks
        done = False

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        result = await fsdelete.delete_tree_async(tmp_path, "t")
        done = True
        await task
        return result

    result = asyncio.run(main())
    assert result.ok and result.files == 4001
    assert ticks > 10  # the loop ran beside the delete; the stall itself is measured by hack/bench/delete.py


@THREADS_ONLY
def test_disk_usage_counts_blocks_without_following_links(tmp_path: Path) -> None:
    top = tmp_path / "t"
    top.mkdir()
    (top / "big").write_bytes(b"x" * 100_000)
    (top / "link").symlink_to("/usr")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        size = treesize.disk_usage(fd, "t")
    finally:
        os.close(fd)
    assert 100_000 <= size < 1_000_000


# --- issue 12, items 1 and 6: bounded memory, sizes of any tree, mounts by mount id ---------------------------


@pytest.mark.parametrize("workers", [1, 4])
def test_a_tree_is_deleted_even_when_it_is_read_again_after_a_deep_descent(tmp_path: Path, workers: int) -> None:
    # A level pushed out of the fd budget is read again on the way back: files beside a deep chain at every
    # level, and a wide level above it, all go, each counted once.
    _deep(tmp_path / "t", 300)
    for i in range(500):
        (tmp_path / "t" / f"wide{i}").write_text("x")
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert result.ok and result.files == 800 and listing(tmp_path) == []


@pytest.mark.parametrize("workers", [1, 4])
def test_a_directory_that_stays_is_not_entered_again_when_its_parent_is_read_again(
    tmp_path: Path, immutable: list[Path], workers: int
) -> None:
    # An undeletable file deep down keeps every directory above it: each is failed once, never looped on.
    _deep(tmp_path / "t", 120)
    stuck = tmp_path / "t" / "/".join(["d"] * 100) / "f99"
    make_immutable(immutable, stuck)
    for i in range(50):
        (tmp_path / "t" / f"side{i}").mkdir()
        (tmp_path / "t" / f"side{i}" / "x").write_text("x")
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert not result.ok and result.errno == errno.EPERM and result.path == str(stuck)
    assert result.files == 120 - 1 + 50 and listing(tmp_path / "t") == ["d"]
    subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert fsdelete.delete_tree(tmp_path, "t", workers=workers).ok


@THREADS_ONLY
def test_tree_size_counts_blocks_and_files_of_a_chain_deeper_than_recursion_allows(tmp_path: Path) -> None:
    _deep(tmp_path / "t", 2500)  # os.fwalk (the agent's measure) died with RecursionError at ~1,500 levels
    (tmp_path / "t" / "link").symlink_to("/usr")
    before = open_fds()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        size = treesize.tree_size(fd, "t")
    finally:
        os.close(fd)
        fsdelete.delete_tree(tmp_path, "t")  # pytest's tmp_path cleanup (shutil.rmtree) recurses and dies on it
    assert size.files == 2501  # 2,500 files and the link, counted once each, never followed
    assert size.bytes >= 2500 * 4096
    assert open_fds() - before == set()  # every descriptor it opened is closed


@THREADS_ONLY
@pytest.mark.root
def test_tree_size_does_not_enter_a_mount(tmp_path: Path, mounts: list[Path]) -> None:
    require_root()
    _, bait_dir = outside_bait(tmp_path)
    for i in range(20):
        (bait_dir / f"big{i}").write_bytes(b"x" * 100_000)
    top = tmp_path / "t"
    (top / "mnt").mkdir(parents=True)
    (top / "own").write_bytes(b"x" * 10)
    subprocess.run(["mount", "--bind", str(bait_dir), str(top / "mnt")], check=True)
    mounts.append(top / "mnt")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        size = treesize.tree_size(fd, "t")
    finally:
        os.close(fd)
    assert size.files == 1 and size.bytes < 100_000


@THREADS_ONLY
@pytest.mark.root
@pytest.mark.parametrize("source", ["statx", "fdinfo"])
def test_a_bind_mount_is_found_by_its_mount_id_without_reading_mountinfo(
    tmp_path: Path, mounts: list[Path], source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mountinfo is never read (a snapshot that was stale for a mount made after it, and empty on EMFILE):
    # the mount id of each directory opened is compared with its parent's, from statx or /proc/self/fdinfo.
    require_root()
    if source == "fdinfo":
        monkeypatch.setattr(nofollow, "_statx", None)
    monkeypatch.setattr(fsdelete, "_mount_points_under", lambda *_: frozenset(), raising=False)
    _, bait_dir = outside_bait(tmp_path)
    top = tmp_path / "t"
    tree(top)
    point = top / "d4" / "inner" / "mnt"
    point.mkdir()
    subprocess.run(["mount", "--bind", str(bait_dir), str(point)], check=True)
    mounts.append(point)
    result = fsdelete.delete_tree(tmp_path, "t", workers=1)
    assert not result.ok and result.reason is Reason.CROSS_DEVICE and result.path == str(point)
    assert listing(bait_dir) == ["keep.txt"]


@THREADS_ONLY
@pytest.mark.parametrize("workers", [1, 4])
def test_a_directory_whose_mount_cannot_be_known_is_treated_as_a_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    # issue 12, item 6: EMFILE while reading mountinfo turned "in use (mount)" into "not in use". Unknown is a mount.
    tree(tmp_path / "t")
    monkeypatch.setattr(fsdelete, "mount_id", lambda fd: None)  # the delete's top
    monkeypatch.setattr(walker, "mount_id", lambda fd: None)  # every level it enters
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert not result.ok and result.reason is Reason.CROSS_DEVICE and result.path == str(tmp_path / "t")
    assert listing(tmp_path / "t") == sorted(["top.txt", *(f"d{d}" for d in range(6))])
    assert all(len(listing(tmp_path / "t" / f"d{d}" / "inner")) == 20 for d in range(6))


@THREADS_ONLY
def test_mount_id_reads_the_same_from_statx_and_fdinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        from_statx = nofollow.mount_id(fd)
        monkeypatch.setattr(nofollow, "_statx", None)
        assert from_statx is not None and nofollow.mount_id(fd) == from_statx
        assert nofollow.mount_id(99999) is None  # not an open descriptor: unknown, never a guess
    finally:
        os.close(fd)
