"""Safe deletion on a real filesystem: links never followed, mounts never entered, deep trees, stuck files."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from diskkit import User, listing, make_immutable, outside_bait, require_root

from controller import fsdelete
from controller.contracts import Reason

pytest_plugins = ["diskkit"]  # fixtures: throwaway_user, shared_tmp, immutable


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


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for point in reversed(made):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


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
    before = len(os.listdir("/proc/self/fd"))
    result = fsdelete.delete_tree(tmp_path, "t", workers=workers)
    assert result.ok and result.files == 2500 and listing(tmp_path) == []
    assert len(os.listdir("/proc/self/fd")) == before  # every descriptor closed


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
    code = "import sys; from controller import fsdelete\n"
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
        "import sys; from controller import fsdelete\n"
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


def test_disk_usage_counts_blocks_without_following_links(tmp_path: Path) -> None:
    top = tmp_path / "t"
    top.mkdir()
    (top / "big").write_bytes(b"x" * 100_000)
    (top / "link").symlink_to("/usr")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        size = fsdelete.disk_usage(fd, "t")
    finally:
        os.close(fd)
    assert 100_000 <= size < 1_000_000
