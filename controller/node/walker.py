"""A tree walked one level at a time through descriptors: what the delete (`fsdelete.py`) and `walk_entries`
stand on.

- `walk_entries(top_fd, max_depth) -> Iterator[Found]`: every entry below an open directory, depth-first, for a
  caller that may remove what it is handed before asking for the next (the store's exclude globs); `TooDeep`
  past `max_depth` levels.
- `Walker`: entering a level safely (O_DIRECTORY|O_NOFOLLOW relative to its parent's fd, `nofollow.OPEN_DIR`;
  checked to be on the walk's device and mount), reading it lazily, at most `MAX_OPEN` levels open (beyond, the
  shallowest is closed), and the way back up through `..`, checked to be the same inode on the same mount.
- `Frame`: one open level: a small frame holding its own name, a link to its parent and a lazy directory
  iterator (never a listing, never a path; paths are built from the links only for a message), and what a
  delete's threads need to share it.
"""

from __future__ import annotations

import ctypes
import errno as E
import os
import threading
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from controller.node.nofollow import OPEN_DIR, identify, mount_id

if TYPE_CHECKING:
    from controller.node.fsdelete import _Delete

MAX_OPEN = 32  # levels held open at once (two fds each: the dir and its iterator); deeper ones reopen via `..`


class Stop(Exception):
    """The tree changed under the walk in a way that makes going on unsafe (a parent is not what it was)."""


# --- the walk ------------------------------------------------------------------------------------------
class Frame:
    """One open level: its name in its parent, the parent, and a reader of its entries.

    In a delete with helpers, any of its threads takes entries from the reader under `lock`; `users` of them
    are still working on what they took (through `fd`), so the level is neither closed nor left until none is.
    """

    __slots__ = (
        "again",
        "cond",
        "delete",
        "done",
        "fd",
        "ident",
        "it",
        "lock",
        "name",
        "parent",
        "shared",
        "stash",
        "taken",
        "users",
    )

    def __init__(
        self, fd: int, name: str, parent: Frame | None, ident: tuple[int, int], delete: _Delete | None = None
    ) -> None:
        self.fd: int | None = fd
        self.name = name
        self.parent = parent
        self.ident = ident  # (st_dev, st_ino) to verify a reopen through `..`
        self.it: Iterator[os.DirEntry[str]] | None = None
        self.again = False  # a batched name turned out to be a directory: read this level again before leaving
        self.done = False  # read to the end (by whichever thread took its last entry)
        self.delete = delete  # the delete whose helpers may take from it; None: one thread walks it
        self.lock = threading.Lock()
        self.users = 0  # helpers working on entries they took from it
        self.cond: threading.Condition | None = None  # made when a thread waits for `users` to reach 0
        self.shared = False  # helpers may take from its reader (it is in `_HELPERS.levels`)
        self.stash: tuple[str, int] | None = None  # a subdirectory a helper read, left for this level's walk
        self.taken = 0  # names taken so far: a level that keeps giving is taken from in bigger batches

    def close(self) -> None:
        if self.it is not None:
            self.it.close()  # type: ignore[attr-defined]
            self.it = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Walker:
    """What the delete walk and `walk_entries` share: entering a level safely, reading it lazily, the fd budget.

    `open` holds the deepest levels with open fds, shallowest first; a level pushed out of it is closed and
    is read again from the start when the walk comes back to it.
    """

    budget = MAX_OPEN

    def __init__(self, parent_fd: int, where: str, place: tuple[int, int | None] | None = None) -> None:
        self.parent_fd = parent_fd
        self.where = where
        if place is None:
            place = (os.fstat(parent_fd).st_dev, mount_id(parent_fd))
        self.dev, self.mnt = place  # the device and mount every directory entered must be on
        self.open: deque[Frame] = deque()
        self.buf = ctypes.create_string_buffer(256)  # statx's answer for every directory this walk enters

    def path_of(self, frame: Frame | None, name: str | None = None) -> str:
        """The path of `frame` (or of `name` in it), built from the parent links: for messages only."""
        names = [] if name is None else [name]
        while frame is not None:
            names.append(frame.name)
            frame = frame.parent
        return "/".join([self.where.rstrip("/"), *reversed(names)])

    def open_dir(self, parent: Frame | None, name: str) -> tuple[Frame | None, OSError | None, bool]:
        """(frame, None, same mount) for a directory; (None, error, _) when it cannot be opened."""
        dir_fd = self.parent_fd if parent is None else parent.fd
        assert dir_fd is not None
        try:
            fd = os.open(name, OPEN_DIR, dir_fd=dir_fd)
        except OSError as err:
            return None, err, True
        try:
            ident = identify(fd, self.buf)  # device, inode and mount in one statx (was fstat, then statx)
        except OSError as err:
            os.close(fd)
            return None, err, True
        dev = os.makedev(*ident.dev)
        same = dev == self.dev and self.mnt is not None and ident.mnt == self.mnt
        frame = Frame(fd, name, parent, (dev, ident.ino), self.shared())
        if not same:
            frame.close()
            return frame, None, False
        self.push(frame)
        return frame, None, True

    def shared(self) -> _Delete | None:
        return None

    def push(self, frame: Frame) -> None:
        self.open.append(frame)
        if len(self.open) > self.budget:
            self.shed()

    def shed(self) -> None:
        """Over budget: close the shallowest open level."""
        self.open.popleft().close()

    def next_entry(self, frame: Frame) -> os.DirEntry[str] | None:
        """The next entry of `frame`, reading it again from the start if its reader was closed."""
        assert frame.fd is not None
        if frame.it is None:
            frame.it = os.scandir(frame.fd)
        return next(frame.it, None)

    def back_to_parent(self, frame: Frame) -> None:
        """Take `frame` out of the open levels and make sure its parent is open again (through `..`, checked).

        `frame`'s fd stays open: the caller rmdirs it by name first and closes it after, so the directory's
        last reference goes (and its inode is freed, its blocks discarded) outside the parent's lock. Freed
        by the rmdir itself, it holds that lock meanwhile: siblings' rmdirs went one at a time, 10x slower.
        """
        parent = frame.parent
        try:
            if parent is not None and parent.fd is None:
                assert frame.fd is not None
                fd = os.open("..", OPEN_DIR, dir_fd=frame.fd)
                st = os.fstat(fd)
                # `..` lands on top of whatever was mounted on the parent since: the same inode is not enough
                if (st.st_dev, st.st_ino) != parent.ident or mount_id(fd) != self.mnt:
                    os.close(fd)
                    raise Stop(E.ESTALE, parent)
                parent.fd = fd
                self.open.appendleft(parent)
        finally:
            if self.open and self.open[-1] is frame:
                self.open.pop()

    def close_all(self) -> None:
        while self.open:
            self.open.pop().close()


def is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False  # unknown: unlinking it tells (EISDIR for a directory)


# --- walking for a caller that acts on each entry ----------------------------------------------------------
class TooDeep(Exception):
    """`walk_entries` met a tree deeper than it keeps open: the caller refuses rather than walk it partly."""


class Found:
    """One entry handed out by `walk_entries`: remove it (or not) through `dir_fd` before taking the next."""

    __slots__ = ("dir_fd", "frame", "is_dir", "name")

    def __init__(self, dir_fd: int, name: str, is_dir: bool, frame: Frame) -> None:
        self.dir_fd, self.name, self.is_dir, self.frame = dir_fd, name, is_dir, frame

    def rel(self) -> str:
        """The entry's path relative to the walk's top (built from the parent links: only when asked)."""
        names, frame = [self.name], self.frame
        while frame.parent is not None:
            names.append(frame.name)
            frame = frame.parent
        return "/".join(reversed(names))


def walk_entries(top_fd: int, max_depth: int = 256) -> Iterator[Found]:
    """Every entry below the open directory `top_fd`, depth-first, never following a link or entering a mount.

    Each level keeps its reader open (nothing is read twice, so nothing is handed out twice or missed), which
    bounds the depth: deeper than `max_depth` raises TooDeep. A directory the caller removed is not entered.
    Memory is a constant per level, as in the delete walk.
    """
    walker = Walker(top_fd, "")
    top = Frame(os.dup(top_fd), "", None, (walker.dev, os.fstat(top_fd).st_ino))
    depth, frame = 0, top
    try:
        while True:
            entry = walker.next_entry(frame)
            if entry is None:
                if frame is top:
                    return
                parent = frame.parent
                assert parent is not None
                frame.close()
                frame, depth = parent, depth - 1
                continue
            assert frame.fd is not None
            found = Found(frame.fd, entry.name, is_dir(entry), frame)
            del entry
            yield found
            if not found.is_dir:
                continue
            try:
                fd = os.open(found.name, OPEN_DIR, dir_fd=frame.fd)
            except OSError:
                continue  # removed by the caller, or not a directory any more: nothing to walk
            st = os.fstat(fd)
            if st.st_dev != walker.dev or walker.mnt is None or mount_id(fd) != walker.mnt:
                os.close(fd)
                continue
            if depth + 1 > max_depth:
                os.close(fd)
                raise TooDeep(f"deeper than {max_depth} levels at {found.rel()}")
            frame, depth = Frame(fd, found.name, frame, (st.st_dev, st.st_ino)), depth + 1
    finally:
        while frame is not top:
            parent = frame.parent
            frame.close()
            assert parent is not None
            frame = parent
        top.close()
