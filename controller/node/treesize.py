"""The size of a directory tree: allocated bytes and files, walked the same safe way as the delete.

- `tree_size(parent_fd, name, budget=None) -> TreeSize(bytes, files, complete, reason)`: allocated bytes and
  non-directory entries of a tree, in linear time on any shape (each directory read once, subdirectories
  taken in bounded batches), stopping with what it counted (`complete=False`) past `budget` seconds.
- `disk_usage(parent_fd, name)` is its byte count.

Every directory is opened as `fsdelete` opens one (O_DIRECTORY|O_NOFOLLOW, relative to its parent's fd) and
checked to be on the walk's mount (`nofollow.identify`); a link is counted, never followed, and another
mount is not entered. Memory and descriptors are bounded (`SIZE_OPEN`, `SIZE_NAMES`, `SIZE_HELD`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as E
import itertools
import os
import stat
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from controller.node.nofollow import OPEN_DIR, Ident, identify
from controller.rules.contracts import Reason


class TreeSize(NamedTuple):
    bytes: int  # allocated (st_blocks * 512), the directories' own blocks included
    files: int  # non-directory entries
    complete: bool = True  # False: what was counted before the walk had to stop (a lower bound)
    reason: Reason | None = None  # why not complete: SizeTooSlow, SizeInterrupted, SizeUnreadable


class _TooSlow(Exception):
    """The size walk ran past its time budget."""


class _Moved(Exception):
    """A directory met again on the way back up is not the one left: the tree moved under the walk."""


def tree_size(parent_fd: int, name: str, *, budget: float | None = None) -> TreeSize:
    """Allocated bytes and files of `<parent>/<name>`, never following a link or entering another mount.

    Linear on any shape, in bounded memory and descriptors (`_SizeWalk`). `budget` (seconds) bounds the
    time: past it the walk stops and returns what it counted so far with `complete=False`, reason
    SizeTooSlow. A tree that changes meanwhile is counted approximately, never crashes the walk.
    """
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except OSError:
        return TreeSize(0, 0)
    if not stat.S_ISDIR(st.st_mode):
        return TreeSize(int(st.st_blocks) * 512, 1)
    return _SizeWalk(parent_fd, budget).run(name)


class _Level:
    """One directory on the size walk's stack: the names of its subdirectories still to visit, a batch at a time.

    A level is read once, front to back: its files are counted as they come and its subdirectories' names
    kept (at most `SIZE_NAMES`); a level with more pauses its reader after a batch and goes on from there
    once the batch is measured. Only a paused reader pushed out of the descriptor budget is read again.
    """

    __slots__ = ("done", "fd", "ident", "it", "name", "parent", "taken", "todo")

    def __init__(self, fd: int, name: str, parent: _Level | None, ino: int) -> None:
        self.fd: int | None = fd
        self.name = name
        self.parent = parent
        self.ident = ino  # a reopen through `..` must land on the same directory (and the walk's device, mount)
        self.it: Iterator[os.DirEntry[str]] | None = None  # open only while paused in the middle of a batch
        self.taken = 0  # entries read so far (a paused reader pushed out skips them when read again)
        self.todo: list[str] = []  # subdirectories read and not yet measured
        self.done = False  # read to the end


SIZE_OPEN = 64  # descriptors the size walk holds: one per open level, one more per paused reader
SIZE_NAMES = 16_384  # subdirectory names one level holds at once; more are read in batches
SIZE_HELD = 1 << 20  # subdirectory names all levels hold together (beyond: one per level)
_CLOCK_MASK = 4095  # the clock is read once every 4,096 entries


class _SizeWalk:
    """One measurement: depth-first over an explicit stack of `_Level`s, each directory read once.

    Every directory is opened O_DIRECTORY|O_NOFOLLOW relative to its parent's fd and checked (one statx) to
    be on the walk's mount. At `SIZE_OPEN` descriptors the shallowest open level not paused is closed; on
    the way back up a closed level is reopened through `..` from its child, checked to be the same inode on
    the same mount (else the walk stops: SizeInterrupted), so the stack's top always has its fd. Each
    directory is opened at most twice and read once, except a paused level closed to stay in budget (more
    than `SIZE_OPEN` levels on one path each with more than `SIZE_NAMES` subdirectories), read again.
    """

    def __init__(self, parent_fd: int, budget: float | None) -> None:
        self.parent_fd = parent_fd
        self.buf = ctypes.create_string_buffer(256)  # statx's answer, reused for every directory
        where = identify(parent_fd, self.buf)
        self.dev, self.mnt = where.dev, where.mnt
        self.deadline = None if budget is None or budget <= 0 else time.monotonic() + budget
        self.open: deque[_Level] = deque()  # levels holding a descriptor, shallowest first
        self.fds = 0
        self.held = 0  # names in every level's todo
        self.bytes = self.files = 0
        self.why: Reason | None = None  # the first reason the count is short (a slow walk says so last)

    def run(self, name: str) -> TreeSize:
        stack: list[_Level] = []
        try:
            top = self.enter(None, name)
            if top is not None:
                stack.append(top)
            while stack:
                level = stack[-1]
                if level.todo:
                    child = self.enter(level, level.todo.pop())
                    self.held -= 1
                    if child is not None:
                        stack.append(child)
                    continue
                if not level.done:
                    self.read(level)
                    continue
                stack.pop()
                parent = stack[-1] if stack else None
                fd = self.up(level) if parent is not None and parent.fd is None else None
                self.close(level)
                if parent is not None and fd is not None:  # the way back up: the stack's top always has its fd
                    parent.fd = fd
                    self.open.append(parent)  # still the deepest open level
                    self.fds += 1
                    if self.fds >= SIZE_OPEN:
                        self.trim(parent)
        except _TooSlow:
            self.why = Reason.SIZE_TOO_SLOW
        except (_Moved, OSError):
            self.why = Reason.SIZE_INTERRUPTED
        finally:
            for level in list(self.open):
                self.close(level)
        return TreeSize(self.bytes, self.files, self.why is None, self.why)

    def clock(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _TooSlow

    def here(self, fd: int) -> Ident | None:
        """The directory `fd` as the walk sees it; None (and `fd` closed) when it is on another mount."""
        try:
            ident = identify(fd, self.buf)
        except OSError:
            os.close(fd)
            raise
        if ident.dev != self.dev or self.mnt is None or ident.mnt != self.mnt:
            os.close(fd)
            return None
        return ident

    def enter(self, parent: _Level | None, name: str) -> _Level | None:
        """Open a subdirectory and count its own blocks; a link or a file by now is counted as one, never
        followed; another mount is not counted; None when there is nothing to descend into."""
        self.clock()
        dir_fd = self.parent_fd if parent is None else parent.fd
        assert dir_fd is not None
        try:
            fd = os.open(name, OPEN_DIR, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (E.ELOOP, E.ENOTDIR):  # replaced by a link or a file since it was read
                self.count_one(dir_fd, name)
            elif err.errno != E.ENOENT:  # EACCES...: its own blocks count, what it holds cannot be read
                self.count_one(dir_fd, name, files=0)
                self.why = self.why or Reason.SIZE_UNREADABLE
            return None
        ident = self.here(fd)
        if ident is None:
            return None
        self.bytes += ident.blocks * 512
        level = _Level(fd, name, parent, ident.ino)
        self.open.append(level)  # the deepest open level: the stack's top
        self.fds += 1
        if self.fds >= SIZE_OPEN:
            self.trim(level)
        return level

    def count_one(self, dir_fd: int, name: str, files: int = 1) -> None:
        with contextlib.suppress(OSError):
            self.bytes += os.lstat(name, dir_fd=dir_fd).st_blocks * 512
            self.files += files

    def read(self, level: _Level) -> None:
        """Read `level` on from where it stopped: count its files, keep its subdirectories' names, until the
        end (the reader closes) or a full batch (the reader pauses, holding its place and a descriptor)."""
        it = level.it
        if it is None:
            assert level.fd is not None
            try:
                it = os.scandir(level.fd)
            except OSError:
                level.done = True
                self.why = self.why or Reason.SIZE_UNREADABLE
                return
            for _ in itertools.islice(it, level.taken):  # a paused reader closed to stay in budget: skip
                pass
        else:
            level.it = None  # in hand: the one descriptor the budget leaves for the reader being read
            self.fds -= 1
        todo, blocks, files, taken = level.todo, 0, 0, level.taken
        first, before = taken + 1, len(todo)
        room = max(min(SIZE_NAMES - before, SIZE_HELD - self.held), 1)
        paused = False
        try:
            for taken, entry in enumerate(it, first):  # `taken`: where a pause holds its place
                if not taken & _CLOCK_MASK:
                    self.bytes, self.files, blocks, files = self.bytes + blocks * 512, self.files + files, 0, 0
                    self.clock()
                try:
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.name)
                        room -= 1
                        if room <= 0:
                            paused = True
                            break
                        continue
                    blocks += entry.stat(follow_symlinks=False).st_blocks
                except FileNotFoundError:  # gone since it was read
                    continue
                except OSError:  # EACCES (a directory readable but not searchable)...: not counted, and said
                    self.why = self.why or Reason.SIZE_UNREADABLE
                    continue
                files += 1
        except OSError:  # the directory itself could not be read on (EIO, removed under it...)
            self.why = self.why or Reason.SIZE_UNREADABLE
        finally:
            self.bytes, self.files = self.bytes + blocks * 512, self.files + files
            self.held += len(todo) - before
            level.taken = taken
            if paused:
                level.it = it
                self.fds += 1
            else:
                level.done = True
                it.close()  # type: ignore[attr-defined]
        if self.fds >= SIZE_OPEN:
            self.trim(level)

    # --- the descriptor budget ------------------------------------------------------------------------

    def trim(self, keep: _Level) -> None:
        """At the budget (one descriptor is left for the reader in hand): close the shallowest open levels
        not paused (else paused ones), never `keep`.

        `open` stays shallowest first: a level is opened, or reopened on the way back up, as the stack's top.
        """
        while self.fds >= SIZE_OPEN:
            victim = next((lv for lv in self.open if lv.it is None and lv is not keep), None)
            victim = victim or next((lv for lv in self.open if lv is not keep), None)
            if victim is None:
                return
            self.close(victim)

    def drop_reader(self, level: _Level) -> None:
        if level.it is not None:
            level.it.close()  # type: ignore[attr-defined]
            level.it = None
            self.fds -= 1

    def close(self, level: _Level) -> None:
        self.drop_reader(level)
        if level.fd is not None:
            os.close(level.fd)
            level.fd = None
            self.fds -= 1
            if self.open[-1] is level:
                self.open.pop()
            else:
                self.open.remove(level)

    def up(self, child: _Level) -> int:
        """An fd of `child`'s parent again, through `..`: the same inode on the same mount, or stop."""
        parent = child.parent
        assert parent is not None and child.fd is not None
        fd = os.open("..", OPEN_DIR, dir_fd=child.fd)
        ident = self.here(fd)
        if ident is None or ident.ino != parent.ident:  # moved since: its `..` is another directory now
            if ident is not None:
                os.close(fd)
            raise _Moved
        return fd


def disk_usage(parent_fd: int, name: str) -> int:
    """Allocated bytes of `<parent>/<name>` and everything below it (`tree_size(...).bytes`)."""
    return tree_size(parent_fd, name).bytes
