"""Measuring a sandbox's size (issue 25, item 8): linear on any shape, never following a link or leaving the tree,
bounded in descriptors and names held, and cut short past a time budget with what it counted.

Real directories under tmp_path. Linearity is shown by counting how often each directory is listed (a wrapper
around `os.scandir`), never by timing; the timings against `du -s` are hack/bench/tree_size.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.node import treesize
from controller.node.treesize import TreeSize
from controller.rules.contracts import Reason
from tests.bed.diskkit import open_fds, outside_bait

_DIR = os.O_RDONLY | os.O_DIRECTORY


def reference(top: Path) -> tuple[int, int]:
    """(bytes, files) the way `du` adds them up, from os.walk and lstat: every entry's blocks, links not followed."""
    total, files = os.lstat(top).st_blocks * 512, 0
    for where, dirs, names in os.walk(top, followlinks=False):
        for name in dirs + names:
            st_ = os.lstat(os.path.join(where, name))
            total += st_.st_blocks * 512
            files += not stat.S_ISDIR(st_.st_mode)
    return total, files


def size_of(top: Path, budget: float | None = None) -> TreeSize:
    fd = os.open(top.parent, _DIR)
    try:
        return treesize.tree_size(fd, top.name, budget=budget)
    finally:
        os.close(fd)


class Listings:
    """Wraps `os.scandir`: how often each directory (by inode) was listed, and the most descriptors open meanwhile.

    `after` (inode -> action) runs once when that directory's listing has been read to the end, before the
    walk goes on (to change the tree mid-walk); `during` runs once after the first entry of one.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = os.scandir
        self.count: Counter[int] = Counter()
        self.peak = 0
        self.after: dict[int, Callable[[], None]] = {}
        self.during: dict[int, Callable[[], None]] = {}
        monkeypatch.setattr(os, "scandir", self.scandir)

    def scandir(self, fd: Any) -> Any:
        if not isinstance(fd, int):  # os.walk's, by path: not the walk under test
            return self.real(fd)
        ino = os.fstat(fd).st_ino
        self.count[ino] += 1
        self.peak = max(self.peak, len(open_fds()))
        return _Reader(self, self.real(fd), ino)


class _Reader:
    """A scandir iterator that runs the `Listings` hooks (and is a context manager, as shutil expects)."""

    def __init__(self, listings: Listings, it: Any, ino: int) -> None:
        self.listings, self.it, self.ino, self.i = listings, it, ino, 0

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> os.DirEntry[str]:
        if self.i == 1 and self.ino in self.listings.during:
            self.listings.during.pop(self.ino)()
        self.i += 1
        try:
            return next(self.it)  # type: ignore[no-any-return]
        except StopIteration:
            if self.ino in self.listings.after:
                self.listings.after.pop(self.ino)()
            raise

    def close(self) -> None:
        self.it.close()

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ino(path: Path) -> int:
    return os.lstat(path).st_ino


def chain(top: Path, depth: int, files: int = 1, name: str = "d") -> list[Path]:
    """`depth` levels under `top`, each with `files` files; the levels' paths, shallowest first."""
    levels, here = [], top
    for _ in range(depth):
        here = here / name
        here.mkdir(parents=True)
        levels.append(here)
        for i in range(files):
            (here / f"f{i}").write_bytes(b"x" * 10)
    return levels


def every_dir(top: Path) -> list[int]:
    return [ino(Path(w)) for w, _, _ in os.walk(top)]


# --- shapes ---------------------------------------------------------------------------------------------------


def test_a_wide_directory_is_listed_once_and_counted_as_du_counts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = tmp_path / "t"
    top.mkdir()
    fd = os.open(top, _DIR)
    try:
        for i in range(20_000):
            os.close(os.open(f"f{i:06d}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    (top / "big").write_bytes(b"x" * 100_000)
    for i in range(30):
        (top / f"d{i}").mkdir()
        (top / f"d{i}" / "g").write_bytes(b"y" * 5000)
    listed = Listings(monkeypatch)
    size = size_of(top)
    assert (size.bytes, size.files) == reference(top) and size.complete and size.reason is None
    assert set(listed.count.values()) == {1} and set(listed.count) == set(every_dir(top))


def test_a_chain_deeper_than_the_descriptor_budget_lists_each_level_once_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = tmp_path / "t"
    top.mkdir()
    chain(top, 300, files=3)
    before = open_fds()
    listed = Listings(monkeypatch)
    size = size_of(top)
    assert (size.bytes, size.files) == reference(top) and size.complete
    assert set(listed.count.values()) == {1} and len(listed.count) == 301
    assert listed.peak - len(before) <= treesize.SIZE_OPEN + 2  # + the fd of `top`'s parent, + listdir's own
    assert open_fds() - before == set()


def test_a_comb_of_teeth_deeper_than_the_budget_lists_its_wide_level_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before issue 25 the walk read the wide level again from the start after every tooth: 100 listings of
    # it here, quadratic in the teeth.
    top = tmp_path / "t"
    for t in range(100):
        chain(top / f"tooth{t}", 80, files=1)
    listed = Listings(monkeypatch)
    size = size_of(top)
    assert (size.bytes, size.files) == reference(top) and size.complete
    assert listed.count[ino(top)] == 1 and set(listed.count.values()) == {1}


def test_a_level_with_more_subdirectories_than_a_batch_pauses_and_goes_on_without_listing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(treesize, "SIZE_NAMES", 7)
    monkeypatch.setattr(treesize, "SIZE_OPEN", 6)
    top = tmp_path / "t"
    for t in range(50):
        chain(top / f"s{t}", 9, files=2)  # deeper than the budget: the paused reader must survive them
    listed = Listings(monkeypatch)
    size = size_of(top)
    assert (size.bytes, size.files) == reference(top) and size.complete
    assert set(listed.count.values()) == {1}


def test_paused_readers_pushed_out_of_the_budget_are_read_again_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three nested levels of 12 subdirectories in batches of 3 with 4 descriptors: paused readers must be
    # closed, and each is read again at most once per batch, still counting everything once.
    monkeypatch.setattr(treesize, "SIZE_NAMES", 3)
    monkeypatch.setattr(treesize, "SIZE_OPEN", 4)
    top = tmp_path / "t"
    for a in range(12):
        for b in range(12):
            for c in range(3):
                (top / f"a{a}" / f"b{b}" / f"c{c}").mkdir(parents=True)
            (top / f"a{a}" / f"b{b}" / "f").write_text("x")
    listed = Listings(monkeypatch)
    size = size_of(top)
    assert (size.bytes, size.files) == reference(top) and size.complete
    assert max(listed.count.values()) <= 12 // 3 + 1


def test_links_are_counted_as_links_and_never_followed(tmp_path: Path) -> None:
    bait_file, bait_dir = outside_bait(tmp_path)
    (bait_dir / "huge").write_bytes(b"z" * 2_000_000)
    top = tmp_path / "t"
    (top / "sub").mkdir(parents=True)
    (top / "own").write_bytes(b"x" * 10)
    (top / "to-dir").symlink_to(bait_dir)
    (top / "sub" / "to-file").symlink_to(bait_file)
    (top / "sub" / "to-parent").symlink_to("..")
    (top / "dangling").symlink_to(tmp_path / "nowhere")
    size = size_of(top)
    assert (size.bytes, size.files) == reference(top) == (size.bytes, 5) and size.bytes < 2_000_000
    link = tmp_path / "link-top"
    link.symlink_to(top)
    assert size_of(link) == TreeSize(os.lstat(link).st_blocks * 512, 1)  # the top itself a link: just the link


def test_a_directory_replaced_by_a_link_mid_walk_is_counted_as_the_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, bait_dir = outside_bait(tmp_path)
    (bait_dir / "huge").write_bytes(b"z" * 2_000_000)
    top = tmp_path / "t"
    (top / "sub").mkdir(parents=True)
    (top / "sub" / "f").write_bytes(b"x" * 10)
    (top / "g").write_bytes(b"x" * 10)

    def swap() -> None:  # `sub` was read as a directory; before it is entered it becomes a link outside
        shutil.rmtree(top / "sub")
        (top / "sub").symlink_to(bait_dir)

    listed = Listings(monkeypatch)
    listed.after[ino(top)] = swap
    size = size_of(top)
    monkeypatch.undo()
    assert (size.bytes, size.files) == reference(top) and size.files == 2 and size.complete
    assert size.bytes < 2_000_000


def test_files_that_vanish_mid_walk_are_not_counted_and_nothing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = tmp_path / "t"
    top.mkdir()
    for i in range(2000):
        (top / f"f{i}").write_bytes(b"x" * 10)
    (top / "sub").mkdir()
    (top / "sub" / "g").write_bytes(b"x" * 10)

    def vanish() -> None:  # after the first entry: every file and `sub` go (the listing's buffer still names them)
        for path in top.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    listed = Listings(monkeypatch)
    listed.during[ino(top)] = vanish
    size = size_of(top)
    monkeypatch.undo()
    assert size.complete and size.files <= 1
    assert size.bytes <= reference(top)[0] + 8 * 4096  # the top's own blocks (and at most the one file)


def _fork(fn: Callable[[], TreeSize], uid: int) -> TreeSize:
    """Run `fn` in a child as `uid` (root ignores permissions); its TreeSize back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            size = fn()
            os.write(w, json.dumps(list(size)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as out:
        text = out.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and text, "the measuring child failed"
    got, files, complete, reason = json.loads(text)
    return TreeSize(got, files, complete, None if reason is None else Reason(reason))


def test_directories_that_cannot_be_read_count_their_own_blocks_and_say_so(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # tmp_path's parents are 0700: the unprivileged child must reach it
    try:
        base.chmod(0o755)
        top = base / "t"
        (top / "ok").mkdir(parents=True)
        (top / "ok" / "f").write_bytes(b"x" * 10)
        (top / "locked").mkdir()
        (top / "locked" / "secret").write_bytes(b"s" * 500_000)
        (top / "locked").chmod(0o000)
        (top / "unsearchable").mkdir()
        (top / "unsearchable" / "hidden").write_bytes(b"h" * 500_000)
        (top / "unsearchable").chmod(0o744)  # others may list it but not stat what it holds
        for p in (top, top / "ok", top / "ok" / "f"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        size = _fork(lambda: size_of(top), 65534)
        full = reference(top)
        assert not size.complete and size.reason == Reason.SIZE_UNREADABLE
        assert size.files == 1 and size.bytes <= full[0] - 500_000 and size.bytes >= 3 * 4096
    finally:
        with contextlib.suppress(OSError):
            (top / "locked").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


# --- the time budget ----------------------------------------------------------------------------------------


def test_past_the_budget_the_walk_stops_with_what_it_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "t"
    for d in range(40):
        (top / f"d{d}").mkdir(parents=True)
        (top / f"d{d}" / "f").write_bytes(b"x" * 10_000)
    full = reference(top)
    ticks = iter(range(1_000_000))  # a clock that moves one second each time it is read
    monkeypatch.setattr(treesize, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    size = size_of(top, budget=10)
    assert not size.complete and size.reason == Reason.SIZE_TOO_SLOW
    assert 0 < size.bytes < full[0] and 0 < size.files < full[1]
    assert size_of(top, budget=0).complete and size_of(top).complete  # 0 or none: no limit


def test_a_directory_moved_away_mid_walk_stops_it_as_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Deeper than the budget, so the way back up reopens levels through `..`: one moved elsewhere meanwhile
    # has another parent, which is not this walk's to count.
    top = tmp_path / "t"
    levels = chain(top / "a", 100, files=1)
    (top / "b").mkdir()
    listed = Listings(monkeypatch)
    listed.after[ino(levels[-1])] = lambda: levels[4].rename(top / "b" / "moved")
    size = size_of(top)
    monkeypatch.undo()
    assert not size.complete and size.reason == Reason.SIZE_INTERRUPTED and size.files > 0


# --- any shape ----------------------------------------------------------------------------------------------

Shape = Any  # int: a file of that many bytes; "link": a symlink; list: a directory of those


def _build(where: Path, shape: list[Shape]) -> None:
    where.mkdir()
    for i, item in enumerate(shape):
        if isinstance(item, list):
            _build(where / f"d{i}", item)
        elif item == "link":
            (where / f"l{i}").symlink_to("..")
        else:
            (where / f"f{i}").write_bytes(b"x" * item)


shapes = st.recursive(
    st.one_of(st.integers(0, 9000), st.just("link")),
    lambda children: st.lists(children, max_size=7),
    max_leaves=60,
).map(lambda s: s if isinstance(s, list) else [s])


@settings(max_examples=60, deadline=None)
@given(shape=shapes, budget=st.integers(2, 9), names=st.integers(1, 5), held=st.integers(1, 12))
def test_any_shape_with_any_budgets_is_counted_exactly_as_os_walk_and_lstat_count_it(
    shape: list[Shape], budget: int, names: int, held: int
) -> None:
    base = Path(tempfile.mkdtemp())
    try:
        _build(base / "t", shape)
        with (
            mock.patch.object(treesize, "SIZE_OPEN", budget),
            mock.patch.object(treesize, "SIZE_NAMES", names),
            mock.patch.object(treesize, "SIZE_HELD", held),
        ):
            before = open_fds()
            size = size_of(base / "t")
            assert open_fds() - before == set()
        assert (size.bytes, size.files) == reference(base / "t") and size.complete
    finally:
        shutil.rmtree(base)
