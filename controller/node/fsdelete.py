"""Safe deletion of a directory tree: fd-relative, never follows a link, never leaves the tree, never crosses a mount.

Public API:

- `delete_tree(parent, name) -> DeleteResult`: delete `<parent>/<name>` (a directory, or a single non-directory
  entry, which is unlinked). Idempotent: an absent name is success.
- `delete_tree_at(parent_fd, name) -> DeleteResult`: the same below an open directory fd.
- `async delete_tree_async(parent, name) -> DeleteResult`: runs it in a worker thread so the calling event loop
  keeps running (the measured stall is in docs/benchmarks.md).
- `DeleteResult(ok, reason, errno, path, files)`: on failure `reason` is DELETE_FAILED or CROSS_DEVICE and
  `path`/`errno` name the first entry that would not go; everything else that could go is gone.
- `mount_id(fd) -> int | None`: the mount a descriptor is on (statx STATX_MNT_ID, else /proc/self/fdinfo);
  `identify(fd) -> Ident`: its device, inode, blocks and mount in one statx (the size walk's check too:
  `treesize.py` measures a tree the same safe way).
- `walk_entries(top_fd, max_depth) -> Iterator[Found]`: every entry below an open directory, depth-first, for a
  caller that may remove what it is handed before asking for the next (the store's exclude globs).
- `open_no_symlinks(path) -> int`: a directory fd for an absolute path with no link in ANY
  component (openat2 RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH from `/`, else one O_NOFOLLOW open per component).

Every directory is opened with O_DIRECTORY|O_NOFOLLOW relative to its parent's fd and read with scandir (whose
d_type spares an lstat per file); links are unlinked like files, never traversed. A directory on another device
or another mount (its mount id differs from the parent's: a bind mount keeps st_dev but not the mount id) is
refused with CROSS_DEVICE instead of entered, and so is one whose mount id cannot be read: unknown is a mount.

With `workers > 1` every level a walk holds open is shared: the process's helper threads (`_Helpers`) take
batches of its entries from its one reader, as the walk itself does, and remove them through the level's fd; a
subdirectory a helper takes becomes one more walk of the same kind, whose levels are shared in turn. A level's
fd stays open, and the level is not left, until no helper works on what it took from it. The unlink of a
synced file waits on the disk (on a `discard` mount, for its blocks' discard), so the disk, not the GIL, sets
how many overlap: the helpers double while levels wait for them and the process leaves CPU idle, up to
`MAX_THREADS` in the process, and one a delete at most `workers - 1` (measured in docs/benchmarks.md).

Memory is a constant per open level, whatever the depth, the width or the names: a level is a small frame
holding its own name, a link to its parent and a lazy directory iterator (never a listing, never a path; paths
are built from the links only for a message), and at most `_BATCH` names in hand per thread. No walk recurses.
The caller's walk keeps at most `_MAX_OPEN` levels open and a helper's `_HELPER_OPEN` (beyond, the shallowest
level no helper works on is closed; a thread that waits on a level helps once more, never twice), two
descriptors each: with the defaults at most 76 per delete in progress and 20 per helper thread. A parent whose
fd was closed is reopened through `..`, checked to be the same inode, and read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno as E
import itertools
import os
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from controller.rules.contracts import Reason

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # every walk's open: never a link, never a file
_MAX_OPEN = 32  # levels held open at once (two fds each: the dir and its iterator); deeper ones reopen via `..`
MAX_THREADS = 32  # deletion helper threads in the process at most, all deletes together (docs/benchmarks.md)
WORKERS = 32  # threads one delete may use at once, its caller's included; 1 = one plain walk
_HELPER_OPEN = 4  # levels a helper's walk holds open (the caller's walk holds _MAX_OPEN)
_MAX_FAILED_DIRS = 1 << 16  # directories that would not go, remembered to skip on a re-read; beyond: stop
_FIRST = 4  # names of non-directories taken from a level at first (a level of fewer is never shared)
_BATCH = 32  # most names of non-directories taken from a level at once, by its walk or a helper
_WINDOW = 0.02  # seconds between two looks at whether more helpers would pay
_IDLE = 10.0  # seconds an idle helper waits for work before it ends


@dataclass(frozen=True)
class DeleteResult:
    ok: bool
    reason: Reason
    errno: int | None = None
    path: str | None = None
    files: int = 0  # non-directory entries removed (files, links, sockets...)

    def describe(self) -> str:
        """Words for a log line or an error: what would not go and why."""
        if self.ok:
            return f"deleted ({self.files} files)"
        why = os.strerror(self.errno) if self.errno is not None else str(self.reason)
        return f"{self.reason}: {self.path or '?'}: {why}"


class _Stop(Exception):
    """The tree changed under the walk in a way that makes going on unsafe (a parent is not what it was)."""


# --- which mount a directory is on ------------------------------------------------------------------------
_AT_EMPTY_PATH = 0x1000
_AT_SYMLINK_NOFOLLOW = 0x100
_STATX_MNT_ID = 0x1000
_STATX_MNT_ID_OFFSET = 144  # struct statx: stx_mnt_id follows stx_dev_minor
_libc = ctypes.CDLL(None, use_errno=True)
_statx = getattr(_libc, "statx", None)


def mount_id(fd: int) -> int | None:
    """The id of the mount `fd` is on, or None when it cannot be known (the caller treats that as a mount).

    statx(STATX_MNT_ID) where the kernel has it (5.8+), else the `mnt_id:` line of /proc/self/fdinfo (3.15+).
    """
    if _statx is not None:
        buf = ctypes.create_string_buffer(256)
        if _statx(fd, b"", _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW, _STATX_MNT_ID, buf) == 0:
            mask = struct.unpack_from("=I", buf, 0)[0]
            if mask & _STATX_MNT_ID:
                return int(struct.unpack_from("=Q", buf, _STATX_MNT_ID_OFFSET)[0])
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


_STATX_BASIC_STATS = 0x7FF
# struct statx: stx_mask, stx_ino (32), stx_blocks (48), stx_dev_major/minor (136), stx_mnt_id (144)
_STATX_FIELDS = struct.Struct("=I28xQ8xQ80xIIQ")


class Ident(NamedTuple):
    dev: tuple[int, int]  # (major, minor) of the filesystem
    ino: int
    blocks: int  # 512-byte blocks allocated
    mnt: int | None  # the mount it is on; None: unknown (the caller treats that as a mount)


def identify(fd: int, buf: ctypes.Array[ctypes.c_char] | None = None) -> Ident:
    """Device, inode, blocks and mount of an open fd in one statx (a walk passes its own `buf`, reused);
    fstat and `mount_id` where statx or its STATX_MNT_ID is missing."""
    if _statx is not None:
        buf = buf if buf is not None else ctypes.create_string_buffer(256)
        if _statx(fd, b"", _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW, _STATX_BASIC_STATS | _STATX_MNT_ID, buf) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        mask, ino, blocks, major, minor, mnt = _STATX_FIELDS.unpack_from(buf)
        return Ident((major, minor), ino, blocks, mnt if mask & _STATX_MNT_ID else mount_id(fd))
    st = os.fstat(fd)
    return Ident((os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino, st.st_blocks, mount_id(fd))


def unescape_mountinfo(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (`\\040`)."""
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 3 < len(text) and text[i + 1 : i + 4].isdigit():
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


# --- the walk ------------------------------------------------------------------------------------------
class _Frame:
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
        self, fd: int, name: str, parent: _Frame | None, ident: tuple[int, int], delete: _Delete | None = None
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


class _Walker:
    """What the delete walk and `walk_entries` share: entering a level safely, reading it lazily, the fd budget.

    `open` holds the deepest levels with open fds, shallowest first; a level pushed out of it is closed and
    is read again from the start when the walk comes back to it.
    """

    budget = _MAX_OPEN

    def __init__(self, parent_fd: int, where: str, place: tuple[int, int | None] | None = None) -> None:
        self.parent_fd = parent_fd
        self.where = where
        if place is None:
            place = (os.fstat(parent_fd).st_dev, mount_id(parent_fd))
        self.dev, self.mnt = place  # the device and mount every directory entered must be on
        self.open: deque[_Frame] = deque()

    def path_of(self, frame: _Frame | None, name: str | None = None) -> str:
        """The path of `frame` (or of `name` in it), built from the parent links: for messages only."""
        names = [] if name is None else [name]
        while frame is not None:
            names.append(frame.name)
            frame = frame.parent
        return "/".join([self.where.rstrip("/"), *reversed(names)])

    def open_dir(self, parent: _Frame | None, name: str) -> tuple[_Frame | None, OSError | None, bool]:
        """(frame, None, same mount) for a directory; (None, error, _) when it cannot be opened."""
        dir_fd = self.parent_fd if parent is None else parent.fd
        assert dir_fd is not None
        try:
            fd = os.open(name, OPEN_DIR, dir_fd=dir_fd)
        except OSError as err:
            return None, err, True
        try:
            st = os.fstat(fd)
        except OSError as err:
            os.close(fd)
            return None, err, True
        same = st.st_dev == self.dev and self.mnt is not None and mount_id(fd) == self.mnt
        frame = _Frame(fd, name, parent, (st.st_dev, st.st_ino), self.shared())
        if not same:
            frame.close()
            return frame, None, False
        self.push(frame)
        return frame, None, True

    def shared(self) -> _Delete | None:
        return None

    def push(self, frame: _Frame) -> None:
        self.open.append(frame)
        if len(self.open) > self.budget:
            self.shed()

    def shed(self) -> None:
        """Over budget: close the shallowest open level."""
        self.open.popleft().close()

    def next_entry(self, frame: _Frame) -> os.DirEntry[str] | None:
        """The next entry of `frame`, reading it again from the start if its reader was closed."""
        assert frame.fd is not None
        if frame.it is None:
            frame.it = os.scandir(frame.fd)
        return next(frame.it, None)

    def back_to_parent(self, frame: _Frame) -> None:
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
                    raise _Stop(E.ESTALE, parent)
                parent.fd = fd
                self.open.appendleft(parent)
        finally:
            if self.open and self.open[-1] is frame:
                self.open.pop()

    def close_all(self) -> None:
        while self.open:
            self.open.pop().close()


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False  # unknown: unlinking it tells (EISDIR for a directory)


class _Delete:
    """What every thread of one delete shares: where it started, what went, the first failure, the directories
    that stay, and how many helpers may work on it at once."""

    def __init__(self, parent_fd: int, where: str, helpers: int) -> None:
        self.parent_fd, self.where = parent_fd, where
        self.place = (os.fstat(parent_fd).st_dev, mount_id(parent_fd))
        self.helpers = helpers  # helper threads at once on its levels; 0: its caller walks it alone
        self.helping = 0  # under the helpers' lock
        self.lock = threading.Lock()
        self.files = 0
        self.failure: tuple[Reason, int | None, str] | None = None
        self.failed_dirs: set[int] = set()  # inodes of directories that stay: skipped when a level is read again
        self.stopped = False  # a walk met a tree it cannot safely go on in: every thread winds down

    def result(self) -> DeleteResult:
        if self.failure is None:
            return DeleteResult(True, Reason.DELETED, files=self.files)
        reason, code, path = self.failure
        return DeleteResult(False, reason, code, path, self.files)


class _Walk(_Walker):
    """One thread's part of a deletion: it removes what it takes, counts what went, records the first failure
    in the shared `_Delete`, and keeps going around it."""

    def __init__(self, delete: _Delete, budget: int = _MAX_OPEN) -> None:
        super().__init__(delete.parent_fd, delete.where, delete.place)
        self.delete = delete
        self.budget = budget
        self.files = 0

    def shared(self) -> _Delete | None:
        return self.delete if self.delete.helpers else None

    def fail(self, reason: Reason, code: int | None, frame: _Frame | None, name: str | None = None) -> None:
        with self.delete.lock:
            if self.delete.failure is None:
                self.delete.failure = (reason, code, self.path_of(frame, name))

    def stays(self, ino: int) -> None:
        self.delete.failed_dirs.add(ino)
        if len(self.delete.failed_dirs) > _MAX_FAILED_DIRS:
            raise _Stop(None, None)

    def count(self) -> None:
        """Add what this walk removed to the delete's count."""
        with self.delete.lock:
            self.delete.files += self.files
        self.files = 0

    # --- entering a directory ----------------------------------------------------------------------

    def enter(self, parent: _Frame | None, name: str, ino: int | None = None) -> _Frame | None:
        """Open one directory, or deal with what it turned out to be; None when not to descend."""
        dir_fd = self.parent_fd if parent is None else parent.fd
        assert dir_fd is not None
        frame, err, same = self.open_dir(parent, name)
        if err is not None:
            if err.errno in (E.ELOOP, E.ENOTDIR):  # a link or a file now: unlink it, never follow it
                self.unlink(parent, name)
            elif err.errno == E.EACCES and self.make_searchable(dir_fd, name):
                return self.enter(parent, name, ino)
            elif err.errno != E.ENOENT:
                self.fail(Reason.DELETE_FAILED, err.errno, parent, name)
                if ino is not None:
                    self.stays(ino)
            return None
        assert frame is not None
        if not same:
            self.fail(Reason.CROSS_DEVICE, E.EXDEV, parent, name)
            self.stays(frame.ident[1] if ino is None else ino)
            return None
        return frame

    def make_searchable(self, dir_fd: int, name: str) -> bool:
        """A directory this uid owns but cannot read (mode 0, 0300...): give it u+rwx, through an O_PATH fd."""
        try:
            fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o700 == 0o700:
                return False
            Path(f"/proc/self/fd/{fd}").chmod(stat.S_IMODE(st.st_mode) | 0o700)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    # --- reading a level, shared with the helpers --------------------------------------------------

    def take(self, frame: _Frame) -> tuple[list[str], tuple[str, int] | None]:
        """The next entries of a level this walk holds: up to `_BATCH` names of non-directories, or those read
        before a subdirectory and the subdirectory (name, inode); ([], None) once it is read out.

        A reader closed by the fd budget is opened again from the start; a new reader is shared with the
        helpers (`_HELPERS`), which take from it as this walk does.
        """
        with frame.lock:
            if frame.stash is not None:
                sub, frame.stash = frame.stash, None
                return [], sub
            if frame.it is None:
                if frame.done:
                    return [], None
                assert frame.fd is not None
                try:
                    frame.it = os.scandir(frame.fd)
                except OSError as err:
                    self.fail(Reason.DELETE_FAILED, err.errno, frame)
                    frame.done = True
                    return [], None
            taken = self.read(frame, mine=True)
            if frame.it is not None and not frame.shared and frame.delete is not None:
                _HELPERS.share(frame)  # more than one batch: worth sharing
            return taken

    def read(self, frame: _Frame, mine: bool) -> tuple[list[str], tuple[str, int] | None]:
        """`take`'s reading, under `frame.lock` with its reader open (`mine`: by the level's own walk).

        Batches start at `_FIRST` names and grow to `_BATCH` as the level keeps giving, so a small level is
        shared out too. The first subdirectory a helper meets is left to the level's walk (a chain stays with the
        walk that holds the most levels open); the next ones it takes. The thread that reads the last entry
        closes the reader and stops sharing it.
        """
        assert frame.it is not None
        names: list[str] = []
        want = min(_BATCH, max(_FIRST, frame.taken >> 2))
        sub = None
        if not self.delete.stopped:
            try:
                for entry in frame.it:
                    if not _is_dir(entry):
                        names.append(entry.name)
                        if len(names) < want:
                            continue
                        break
                    if not mine and frame.stash is None:
                        frame.stash = (entry.name, entry.inode())
                        continue
                    sub = (entry.name, entry.inode())
                    break
                else:
                    self.read_out(frame)
            except OSError as err:
                self.fail(Reason.DELETE_FAILED, err.errno, frame)
                self.read_out(frame)
        else:
            self.read_out(frame)
        frame.taken += len(names)
        return names, sub

    @staticmethod
    def read_out(frame: _Frame) -> None:
        """The level's reader reached its end: close it and stop sharing the level (under `frame.lock`)."""
        if frame.it is not None:
            frame.it.close()  # type: ignore[attr-defined]
            frame.it = None
        frame.done = True
        _HELPERS.unshare(frame)

    def settle(self, frame: _Frame) -> None:
        """Stop sharing `frame` and wait until no helper works on what it took from it (its fd stays
        valid until then: closing it earlier could let a helper unlink in whatever reuses the number).

        Meanwhile this thread helps with the delete's other shared levels, once: what it takes there never
        has it help again while it waits, so the waits nest at most two deep.
        """
        while True:
            with frame.lock:
                if frame.it is not None:
                    frame.it.close()  # type: ignore[attr-defined]
                    frame.it = None
                    frame.stash = None
                    _HELPERS.unshare(frame)
                if not frame.users:
                    return
                other = None if _waiting.helping else _HELPERS.pick(self.delete)
                if other is None:
                    if frame.cond is None:
                        frame.cond = threading.Condition(frame.lock)
                    while frame.users:
                        frame.cond.wait()
                    return
            _waiting.helping = True
            try:
                _help(other)
            finally:
                _waiting.helping = False

    def shed(self) -> None:
        """Over budget: close the shallowest open level no helper works on (the deepest is never closed)."""
        for frame in itertools.islice(self.open, len(self.open) - 1):
            with frame.lock:
                if frame.users:
                    continue
                _HELPERS.unshare(frame)
                frame.close()
                if not frame.done:
                    frame.stash = None  # read again from the start, it is met again (read out: it is kept)
            self.open.remove(frame)
            return

    def close_all(self) -> None:
        while self.open:
            frame = self.open.pop()
            self.settle(frame)
            frame.close()

    # --- removing ----------------------------------------------------------------------------------

    def unlink(self, frame: _Frame | None, name: str, retry: bool = True) -> bool:
        """Unlink one non-directory; False when it turned out to be a directory (the caller descends)."""
        dir_fd = self.parent_fd if frame is None else frame.fd
        assert dir_fd is not None
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            return False
        except PermissionError as err:
            if frame is not None and retry and err.errno == E.EACCES and self.make_writable(frame):
                return self.unlink(frame, name, retry=False)
            self.fail(Reason.DELETE_FAILED, err.errno, frame, name)
            return True
        except OSError as err:
            self.fail(Reason.DELETE_FAILED, err.errno, frame, name)
            return True
        self.files += 1
        return True

    def unlink_names(self, frame: _Frame, names: list[str]) -> None:
        """Unlink names of non-directories taken from `frame`; a name that fails goes again through `unlink`,
        with its usual handling (a directory now: the level is read again before it is left)."""
        assert frame.fd is not None
        done, redo = _unlink_names(frame.fd, names)
        self.files += done
        for name in redo:
            if not self.unlink(frame, name):
                frame.again = True
        if frame.delete is not None:
            _HELPERS.pace()

    def make_writable(self, frame: _Frame) -> bool:
        """A read-only directory this uid owns (0500...) gets u+rwx so its entries can be removed."""
        if frame.fd is None:
            return False
        try:
            st = os.fstat(frame.fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o700 == 0o700:
                return False
            os.fchmod(frame.fd, stat.S_IMODE(st.st_mode) | 0o700)
        except OSError:
            return False
        return True

    def leave(self, frame: _Frame) -> None:
        """rmdir a read-out directory from its parent (reopened through `..` if closed), then close it."""
        parent = frame.parent
        try:
            self.back_to_parent(frame)
        except _Stop:
            frame.close()
            self.fail(Reason.DELETE_FAILED, E.ESTALE, parent)
            raise
        try:
            _rmdir(self, frame)
        finally:
            frame.close()

    # --- the walk ----------------------------------------------------------------------------------

    def run(self, name: str) -> None:
        top = self.enter(None, name)
        if top is not None:
            self.drain(top)

    def drain(self, top: _Frame) -> None:
        """Delete everything below `top`, then `top` itself: depth-first, a batch of names in hand at a time.

        Each level is left only once no helper works on what it took from it; a level read again (a batched
        name was a directory) is shared again.
        """
        frame = top
        try:
            while True:
                names, sub = self.take(frame)
                if names:
                    self.unlink_names(frame, names)
                if sub is not None:
                    name, ino = sub
                    if ino not in self.delete.failed_dirs:
                        child = self.enter(frame, name, ino)
                        if child is not None:
                            frame = child
                    continue
                if names:
                    continue
                self.settle(frame)
                if frame.again:  # a batched name was a directory: read the level again to descend into it
                    frame.again = frame.done = False
                    continue
                parent = frame.parent
                self.leave(frame)
                if frame is top or parent is None:
                    return
                frame = parent
        except _Stop:
            self.delete.stopped = True
        finally:
            self.close_all()
            self.count()


def _help(frame: _Frame) -> None:
    """A helper's turn on a shared level: take a batch of its entries and remove them (a subdirectory as one
    more walk below it, whose own levels are shared in turn)."""
    delete = frame.delete
    assert delete is not None
    walk = _Walk(delete, _HELPER_OPEN)
    with frame.lock:
        if frame.it is None:
            return
        names, sub = walk.read(frame, mine=False)
        if not names and sub is None:
            return
        frame.users += 1
    try:
        if names:
            walk.unlink_names(frame, names)
        if sub is not None and sub[1] not in delete.failed_dirs:
            child = walk.enter(frame, sub[0], sub[1])
            if child is not None:
                walk.drain(child)
    except _Stop:
        delete.stopped = True
    finally:
        walk.close_all()
        walk.count()
        with frame.lock:
            frame.users -= 1
            if not frame.users and frame.cond is not None:
                frame.cond.notify_all()


def helpers_wanted(threads: int, busy: float, cores: int, waiting: bool, idle: int) -> int:
    """How many helpers to start (> 0) or end (-1) after a window in which the process kept `busy` of its
    `cores` busy, `waiting` levels had entries no helper took and `idle` helpers had nothing to do.

    A disk that makes unlinks wait leaves the CPU idle while levels wait: double, up to MAX_THREADS. A
    process that keeps every core busy gains nothing from one more thread: one ends. Between, keep.
    """
    if busy >= cores - 0.25 and threads > 1:
        return -1
    if busy < cores - 0.5 and waiting and not idle and threads < MAX_THREADS:
        return min(max(threads, 1), MAX_THREADS - threads)
    return 0


class _Helpers:
    """The process's deletion helpers: threads that take entries from the levels deletes in progress share,
    the oldest level first, each delete's own limit kept.

    Their number adapts to the disk: while levels wait for a helper and the process leaves CPU idle (its
    threads wait on the disk, not on the CPU or the GIL), every `_WINDOW` it doubles, up to `MAX_THREADS`;
    while the process keeps every core busy one retires each window; an idle helper leaves after `_IDLE`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.levels: dict[_Frame, None] = {}  # shared levels with a reader open, oldest first
        self.threads = self.idle = self.retire = 0
        self.serial = itertools.count()
        self.cores = len(os.sched_getaffinity(0))
        self.since, self.cpu = time.monotonic(), time.process_time()
        self.look_at = 0.0

    def share(self, frame: _Frame) -> None:
        """Let helpers take from `frame`'s reader (under `frame.lock`)."""
        frame.shared = True
        with self.lock:
            self.levels[frame] = None
            if self.idle:
                self.wake.notify()
            new = [] if self.threads else self.spawn(1)
        for thread in new:
            thread.start()

    def unshare(self, frame: _Frame) -> None:
        """No more (under `frame.lock`): its reader is read out or closed."""
        if frame.shared:
            frame.shared = False
            with self.lock:
                del self.levels[frame]

    def pace(self) -> None:
        """Every `_WINDOW`: one more doubling while levels wait for a helper and the CPU is not what limits."""
        now = time.monotonic()
        if now < self.look_at:
            return
        new: list[threading.Thread] = []
        with self.lock:
            if now < self.look_at:
                return
            cpu = time.process_time()
            busy = (cpu - self.cpu) / max(now - self.since, 1e-6)  # cores this process kept busy
            self.look_at, self.since, self.cpu = now + _WINDOW, now, cpu
            change = helpers_wanted(self.threads - self.retire, busy, self.cores, bool(self.levels), self.idle)
            if change < 0:
                self.retire += 1  # the next helper between two batches ends
            elif change > 0:
                new = self.spawn(change)
        for thread in new:
            thread.start()

    def spawn(self, count: int) -> list[threading.Thread]:
        """`count` more helpers, counted (under `lock`) and started by the caller once it lets go of it."""
        self.threads += count
        return [
            threading.Thread(target=self.run, name=f"fsdelete_{next(self.serial)}", daemon=True) for _ in range(count)
        ]

    def next(self) -> _Frame | None:
        """The oldest shared level whose delete may have one more helper, counted (under `lock`)."""
        for frame in self.levels:
            delete = frame.delete
            assert delete is not None
            if delete.helping < delete.helpers:
                delete.helping += 1
                return frame
        return None

    def pick(self, delete: _Delete) -> _Frame | None:
        """The oldest level `delete` shares, for one of its own threads waiting on another level."""
        with self.lock:
            return next((frame for frame in self.levels if frame.delete is delete), None)

    def run(self) -> None:
        while True:
            with self.lock:
                frame = None if self.retire else self.next()
                while frame is None:
                    if self.retire:
                        self.retire -= 1
                        self.threads -= 1
                        return
                    self.idle += 1
                    woken = self.wake.wait(_IDLE)
                    self.idle -= 1
                    frame = self.next()
                    if frame is None and not woken:
                        self.threads -= 1
                        return
            assert frame.delete is not None
            try:
                _help(frame)
            except Exception as err:  # a helper is never lost: the delete says what went wrong, as a failure
                _Walk(frame.delete).fail(Reason.DELETE_FAILED, getattr(err, "errno", None), frame)
            finally:
                with self.lock:
                    frame.delete.helping -= 1
                    if self.idle and self.levels:
                        self.wake.notify()


_HELPERS = _Helpers()


class _Waiting(threading.local):
    helping = False  # this thread is helping with other levels while it waits on one of its own


_waiting = _Waiting()


def _forget_helpers() -> None:
    global _HELPERS
    _HELPERS = _Helpers()


os.register_at_fork(after_in_child=_forget_helpers)  # a forked child has none of the parent's threads


def delete_tree_at(parent_fd: int, name: str, where: str | None = None, *, workers: int = WORKERS) -> DeleteResult:
    """Delete `name` below the open directory `parent_fd` (see the module docstring)."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"delete_tree: {name!r} is not a single entry name")
    if where is None:
        where = str(Path(f"/proc/self/fd/{parent_fd}").readlink())
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return DeleteResult(True, Reason.DELETED)
    except OSError as err:
        return DeleteResult(False, Reason.DELETE_FAILED, err.errno, f"{where.rstrip('/')}/{name}")
    delete = _Delete(parent_fd, where, max(workers - 1, 0))
    walk = _Walk(delete)
    if not stat.S_ISDIR(st.st_mode):
        walk.unlink(None, name)
        walk.count()
    else:
        walk.run(name)
    return delete.result()


def _unlink_names(dir_fd: int, names: list[str]) -> tuple[int, list[str]]:
    """(how many went, the names that failed for any reason but being gone already): one batch's unlinks."""
    done, redo = 0, []
    for name in names:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError:
            redo.append(name)
            continue
        done += 1
    return done, redo


def _rmdir(walk: _Walk, frame: _Frame) -> None:
    """rmdir a read-out `frame` from its parent; a parent without write permission (ours) is made writable once."""
    parent = frame.parent
    parent_fd = walk.parent_fd if parent is None else parent.fd
    assert parent_fd is not None
    try:
        os.rmdir(frame.name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno == E.EACCES and parent is not None and walk.make_writable(parent):
            with contextlib.suppress(OSError):
                os.rmdir(frame.name, dir_fd=parent_fd)
                return
        if walk.delete.failure is None or err.errno != E.ENOTEMPTY:
            walk.fail(Reason.DELETE_FAILED, err.errno, frame)
        walk.stays(frame.ident[1])


def delete_tree(parent: Path | str, name: str, *, workers: int = WORKERS) -> DeleteResult:
    """Delete `<parent>/<name>`; `parent` is trusted (resolved once), nothing below it is followed."""
    where = os.path.realpath(parent)
    try:
        fd = os.open(where, OPEN_DIR)
    except OSError as err:
        return DeleteResult(False, Reason.DELETE_FAILED, err.errno, where)
    try:
        return delete_tree_at(fd, name, where, workers=workers)
    finally:
        os.close(fd)


async def delete_tree_async(parent: Path | str, name: str, *, workers: int = WORKERS) -> DeleteResult:
    """`delete_tree` in a worker thread: the event loop keeps ticking while a large tree goes."""
    return await asyncio.to_thread(delete_tree, parent, name, workers=workers)


# --- walking for a caller that acts on each entry ----------------------------------------------------------
class TooDeep(Exception):
    """`walk_entries` met a tree deeper than it keeps open: the caller refuses rather than walk it partly."""


class Found:
    """One entry handed out by `walk_entries`: remove it (or not) through `dir_fd` before taking the next."""

    __slots__ = ("dir_fd", "frame", "is_dir", "name")

    def __init__(self, dir_fd: int, name: str, is_dir: bool, frame: _Frame) -> None:
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
    walker = _Walker(top_fd, "")
    top = _Frame(os.dup(top_fd), "", None, (walker.dev, os.fstat(top_fd).st_ino))
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
            found = Found(frame.fd, entry.name, _is_dir(entry), frame)
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
            frame, depth = _Frame(fd, found.name, frame, (st.st_dev, st.st_ino)), depth + 1
    finally:
        while frame is not top:
            parent = frame.parent
            frame.close()
            assert parent is not None
            frame = parent
        top.close()


_SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_no_symlinks(path: str | Path) -> int:
    """A directory fd for the absolute `path`, refusing (ELOOP) if ANY component is a symlink.

    `lstat` or `O_NOFOLLOW` by path only checks the last component: whoever owns a directory on the way can
    swap a child for a link and aim the caller elsewhere. openat2(RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH) from
    `/` where the kernel has it (5.6+), else an O_NOFOLLOW open of one component at a time.
    """
    text = os.fspath(path)
    if not text.startswith("/"):
        raise ValueError(f"open_no_symlinks: {text!r} is not an absolute path")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"open_no_symlinks: {text!r} has a '..' component")
    root = os.open("/", OPEN_DIR)
    try:
        if not parts:
            return os.dup(root)
        how = _OpenHow(OPEN_DIR, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_BENEATH)
        fd = _libc.syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_long(root),
            ctypes.c_char_p(os.fsencode("/".join(parts))),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )  # every argument as wide as syscall(2) reads it
        if fd >= 0:
            return int(fd)
        code = ctypes.get_errno()
        if code not in (E.ENOSYS, E.EINVAL, E.E2BIG, E.EPERM):
            raise OSError(code, os.strerror(code), text)
        fd = os.dup(root)
        for part in parts:
            try:
                child = os.open(part, OPEN_DIR, dir_fd=fd)
            finally:
                os.close(fd)
            fd = child
        return fd
    finally:
        os.close(root)
