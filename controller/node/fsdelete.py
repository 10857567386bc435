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

With `workers > 1` the top levels are split into subtrees deleted by `workers` threads, and every level's
files are unlinked in batches shared out among `HELPERS` more threads (each batch from the level's held fd,
finished before the walk moves on): on a synced tree an unlink is ~90% kernel time, which threads overlap.

Memory is a constant per open level, whatever the depth, the width or the names: a level is a small frame
holding its own name, a link to its parent and a lazy directory iterator (never a listing, never a path; paths
are built from the links only for a message). The walk never recurses and keeps at most `_MAX_OPEN` levels
open; a parent whose fd was closed is reopened through `..`, checked to be the same inode, and read again.
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
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from controller.rules.contracts import Reason

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # every walk's open: never a link, never a file
_MAX_OPEN = 32  # levels held open at once (two fds each: the dir and its iterator); deeper ones reopen via `..`
WORKERS = 4  # subtrees deleted at once (measured in docs/benchmarks.md); 1 = one plain walk
HELPERS = 4  # threads unlinking one level's files beside the walks, shared by all of them (ditto)
_SPLIT_DEPTH = 3  # how many top levels may be opened to find enough subtrees for the workers
_MAX_FAILED_DIRS = 1 << 16  # directories that would not go, remembered to skip on a re-read; beyond: stop
_BATCH = 64  # non-directories of one level unlinked together, shared out among the helper threads
_CHUNK = 8  # fewest names worth handing to a helper (a hand-off costs about one unlink's Python overhead)


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
    """One open level: its name in its parent, the parent, and a lazy reader of its entries."""

    __slots__ = ("again", "fd", "ident", "it", "name", "parent")

    def __init__(self, fd: int, name: str, parent: _Frame | None, ident: tuple[int, int]) -> None:
        self.fd: int | None = fd
        self.name = name
        self.parent = parent
        self.ident = ident  # (st_dev, st_ino) to verify a reopen through `..`
        self.it: Iterator[os.DirEntry[str]] | None = None
        self.again = False  # a batched name turned out to be a directory: read this level again before leaving

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

    def __init__(self, parent_fd: int, where: str) -> None:
        self.parent_fd = parent_fd
        self.where = where
        st = os.fstat(parent_fd)
        self.dev = st.st_dev
        self.mnt = mount_id(parent_fd)
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
        frame = _Frame(fd, name, parent, (st.st_dev, st.st_ino))
        if not same:
            frame.close()
            return frame, None, False
        self.push(frame)
        return frame, None, True

    def push(self, frame: _Frame) -> None:
        self.open.append(frame)
        if len(self.open) > _MAX_OPEN:
            self.open.popleft().close()

    def next_entry(self, frame: _Frame) -> os.DirEntry[str] | None:
        """The next entry of `frame`, reading it again from the start if its reader was closed."""
        assert frame.fd is not None
        if frame.it is None:
            frame.it = os.scandir(frame.fd)
        return next(frame.it, None)

    def back_to_parent(self, frame: _Frame) -> None:
        """Close `frame`; make sure its parent is open again (through `..`, checked), ready to go on."""
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
            frame.close()

    def close_all(self) -> None:
        while self.open:
            self.open.pop().close()


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False  # unknown: unlinking it tells (EISDIR for a directory)


class _Walk(_Walker):
    """One deletion: counts what went, remembers the first failure, and keeps going around it."""

    def __init__(self, parent_fd: int, where: str, helpers: tuple[ThreadPoolExecutor, int] | None = None) -> None:
        super().__init__(parent_fd, where)
        self.helpers = helpers  # threads (and how many) that unlink a batch beside this walk; None: one plain walk
        self.files = 0
        self.failure: tuple[Reason, int | None, str] | None = None
        self.failed_dirs: set[int] = set()  # inodes of directories that stay: skipped when a level is re-read

    def fail(self, reason: Reason, code: int | None, frame: _Frame | None, name: str | None = None) -> None:
        if self.failure is None:
            self.failure = (reason, code, self.path_of(frame, name))

    def stays(self, ino: int) -> None:
        self.failed_dirs.add(ino)
        if len(self.failed_dirs) > _MAX_FAILED_DIRS:
            raise _Stop(None, None)

    def result(self) -> DeleteResult:
        if self.failure is None:
            return DeleteResult(True, Reason.DELETED, files=self.files)
        reason, code, path = self.failure
        return DeleteResult(False, reason, code, path, self.files)

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

    def unlink_batch(self, frame: _Frame, names: list[str]) -> None:
        """Unlink names of non-directories in `frame`, shared out among the helpers; back only when all are done.

        On a synced tree an unlink is ~90% kernel time (freeing the inode and its blocks, mostly outside the
        directory's lock), so helpers unlinking in the same directory overlap it even under the GIL. The
        helpers use `frame.fd`, held open here until every one of them has returned. A name that fails in a
        helper goes again through `unlink` here, with its usual handling (a directory now: read the level again).
        """
        fd = frame.fd
        assert fd is not None
        if self.helpers is None or len(names) < 2 * _CHUNK:
            results = [_unlink_names(fd, names)]
        else:
            pool, count = self.helpers
            step = max(_CHUNK, -(-len(names) // (count + 1)))
            chunks = [names[i : i + step] for i in range(0, len(names), step)]
            futures = [pool.submit(_unlink_names, fd, chunk) for chunk in chunks[1:]]
            try:
                results = [_unlink_names(fd, chunks[0]), *(f.result() for f in futures)]
            finally:
                wait(futures)  # never return (and let `fd` be closed) while a helper may still use it
        for done, redo in results:
            self.files += done
            for name in redo:
                if not self.unlink(frame, name):
                    frame.again = True

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
        """Close a read-out directory and rmdir it from its parent (reopened through `..` if closed)."""
        parent = frame.parent
        try:
            self.back_to_parent(frame)
        except _Stop:
            self.fail(Reason.DELETE_FAILED, E.ESTALE, parent)
            raise
        _rmdir(self, frame)

    # --- the walk ----------------------------------------------------------------------------------

    def run(self, name: str) -> None:
        top = self.enter(None, name)
        if top is not None:
            self.drain(top)

    def drain(self, top: _Frame) -> None:
        """Delete everything below `top`, then `top` itself: depth-first, one entry in hand at a time."""
        frame = top
        batch: list[str] = []  # non-directories of `frame` read but not yet unlinked (flushed before moving)
        try:
            while True:
                try:
                    entry = self.next_entry(frame)
                except OSError as err:
                    self.fail(Reason.DELETE_FAILED, err.errno, frame)
                    entry = None
                if entry is None:
                    if batch:
                        self.unlink_batch(frame, batch)
                        batch = []
                    if frame.again:  # a batched name was a directory: read the level again to descend into it
                        frame.again = False
                        if frame.it is not None:
                            frame.it.close()  # type: ignore[attr-defined]
                            frame.it = None
                        continue
                    parent = frame.parent
                    self.leave(frame)
                    if frame is top or parent is None:
                        return
                    frame = parent
                    continue
                name, is_dir, ino = entry.name, _is_dir(entry), entry.inode()
                del entry
                if not is_dir:
                    if self.helpers is not None:
                        batch.append(name)
                        if len(batch) >= _BATCH:
                            self.unlink_batch(frame, batch)
                            batch = []
                        continue
                    if self.unlink(frame, name):
                        continue
                if batch:  # before descending: the budget may close `frame`'s fd below
                    self.unlink_batch(frame, batch)
                    batch = []
                if ino in self.failed_dirs:
                    continue
                child = self.enter(frame, name, ino)
                if child is not None:
                    frame = child
        except _Stop:
            pass
        finally:
            self.close_all()


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
    walk = _Walk(parent_fd, where)
    if not stat.S_ISDIR(st.st_mode):
        walk.unlink(None, name)
        return walk.result()
    if workers <= 1:
        walk.run(name)
        return walk.result()
    return _parallel(walk, name, workers)


def _parallel(walk: _Walk, name: str, workers: int) -> DeleteResult:
    """Split the top levels into subtrees and delete those in `workers` threads, then the top levels.

    A synced tree deletes at the speed of the disk's metadata I/O, not of Python: several walks in
    different directories keep several of those I/Os in flight (unlink releases the GIL). Each subtree walk
    is the same safe walk, from an fd of its parent held open here until every worker is done. Subtrees are
    handed out as the workers ask, read lazily from the lowest split level, so a wide directory costs no
    more memory here than in one walk.
    """
    with ThreadPoolExecutor(max_workers=HELPERS, thread_name_prefix="fsdelete-unlink") as helpers:
        walk.helpers = (helpers, HELPERS)
        return _split_and_delete(walk, name, workers)


def _split_and_delete(walk: _Walk, name: str, workers: int) -> DeleteResult:
    top = walk.enter(None, name)
    if top is None:
        return walk.result()
    walk.open.clear()  # the top levels stay open until the end: the workers delete below their fds
    uppers, level = [top], [top]
    want = 4 * workers
    try:
        walk.make_writable(top)
        pending = _split(walk, top, want)
        for _ in range(_SPLIT_DEPTH):
            if len(pending) >= want or not pending:
                break
            level, expanded = [], list[tuple[_Frame, str]]()
            for parent, entry in pending:  # fewer than `want`, and their levels are read out
                frame = walk.enter(parent, entry)
                walk.open.clear()
                if frame is not None:
                    uppers.append(frame)
                    level.append(frame)
                    walk.make_writable(frame)  # the workers rmdir in it and cannot chmod a frame they do not own
                    expanded.extend(_split(walk, frame, want - len(expanded)))
            pending = expanded
        work = itertools.chain(pending, _rest(walk, level))
        lock = threading.Lock()

        def worker() -> list[_Walk]:
            done: list[_Walk] = []
            while True:
                with lock:  # the split levels' readers and `walk` are only touched under the lock
                    item = next(work, None)
                if item is None:
                    return done
                done.append(_subtree(walk, *item))

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fsdelete") as pool:
            for subs in pool.map(lambda _: worker(), range(workers)):
                for sub in subs:
                    walk.files += sub.files
                    walk.failed_dirs |= sub.failed_dirs
                    if sub.failure is not None and walk.failure is None:
                        walk.failure = sub.failure
        for frame in reversed(uppers):  # deepest first: each drains what is left (what would not go), then goes
            if frame.it is not None:
                frame.it.close()  # type: ignore[attr-defined]
                frame.it = None
            if frame.fd is not None:
                walk.drain(frame)
    except _Stop:
        pass
    finally:
        for frame in uppers:
            frame.close()
    return walk.result()


def _split(walk: _Walk, frame: _Frame, limit: int) -> list[tuple[_Frame, str]]:
    """Unlink a level's non-directories and take up to `limit` of its subdirectories (its reader stays open)."""
    dirs: list[tuple[_Frame, str]] = []
    batch: list[str] = []
    while len(dirs) < limit:
        entry = walk.next_entry(frame)
        if entry is None:
            break
        if _is_dir(entry):
            dirs.append((frame, entry.name))
            continue
        batch.append(entry.name)
        if len(batch) >= _BATCH:
            walk.unlink_batch(frame, batch)
            batch = []
    if batch:
        walk.unlink_batch(frame, batch)
    if frame.again:  # a name was a directory after all: the last drain of this level reads it again
        frame.again = False
    return dirs


def _rest(walk: _Walk, level: list[_Frame]) -> Iterator[tuple[_Frame, str]]:
    """The subdirectories the split levels hold beyond the first ones taken, read on demand."""
    for frame in level:
        while frame.it is not None or frame.fd is not None:
            dirs = _split(walk, frame, 1)
            if not dirs:
                break
            yield dirs[0]


def _unlink_names(dir_fd: int, names: list[str]) -> tuple[int, list[str]]:
    """(how many went, the names that failed for any reason but being gone already): a helper's share."""
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


def _subtree(parent_walk: _Walk, parent: _Frame, name: str) -> _Walk:
    assert parent.fd is not None
    walk = _Walk(parent.fd, parent_walk.path_of(parent), parent_walk.helpers)
    walk.run(name)
    return walk


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
        if walk.failure is None or err.errno != E.ENOTEMPTY:
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
