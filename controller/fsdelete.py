"""Safe deletion of a directory tree: fd-relative, never follows a link, never leaves the tree, never crosses a mount.

Public API:

- `delete_tree(parent, name) -> DeleteResult`: delete `<parent>/<name>` (a directory, or a single non-directory
  entry, which is unlinked). Idempotent: an absent name is success.
- `delete_tree_at(parent_fd, name) -> DeleteResult`: the same below an open directory fd.
- `async delete_tree_async(parent, name) -> DeleteResult`: runs it in a worker thread so the calling event loop
  keeps running (the measured stall is in docs/benchmarks.md).
- `DeleteResult(ok, reason, errno, path, files)`: on failure `reason` is DELETE_FAILED or CROSS_DEVICE and
  `path`/`errno` name the first entry that would not go; everything else that could go is gone.
- `disk_usage(parent_fd, name) -> int`: allocated bytes of a tree, walked the same safe way.

Every directory is opened with O_DIRECTORY|O_NOFOLLOW relative to its parent's fd and listed with scandir
(whose d_type spares an lstat per file); links are unlinked like files, never traversed. A directory on another
device, or a mount point listed in /proc/self/mountinfo (a bind mount keeps the same st_dev), is refused with
CROSS_DEVICE instead of entered. The walk is iterative and keeps at most `_MAX_OPEN` directory fds open, so a
tree of any depth is deleted without recursion or fd exhaustion; a parent whose fd was closed is reopened
through `..` and checked to be the same inode before anything is removed from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as E
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from controller.contracts import Reason

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_OPEN = 48  # directory fds held open at once along the current path; deeper ones reopen via `..`
WORKERS = 4  # subtrees deleted at once (measured in docs/benchmarks.md); 1 = one plain walk
_SPLIT_DEPTH = 3  # how many top levels may be opened to find enough subtrees for the workers


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


@dataclass
class _Frame:
    fd: int | None
    name: str  # the name in its parent directory
    path: str  # the full path, for messages and the mount check
    ident: tuple[int, int]  # (st_dev, st_ino) to verify a reopen through `..`
    entries: list[tuple[str, bool]] = field(default_factory=list)  # (name, is_dir), consumed from the end


class _Stop(Exception):
    """The tree changed under the walk in a way that makes going on unsafe (a parent is not what it was)."""


def _mount_points_under(top: str) -> frozenset[str]:
    """Mount points at or below `top` per /proc/self/mountinfo (a bind mount keeps the same st_dev)."""
    found: set[str] = set()
    prefix = top.rstrip("/") + "/"
    try:
        with Path("/proc/self/mountinfo").open(encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.split(" ", 5)
                if len(parts) < 5:
                    continue
                point = unescape_mountinfo(parts[4])
                if point == top or point.startswith(prefix):
                    found.add(point)
    except OSError:
        pass
    return frozenset(found)


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


class _Walk:
    """One deletion: counts what went, remembers the first failure, and keeps going around it."""

    def __init__(self, parent_fd: int, where: str, dev: int, mounts: frozenset[str]) -> None:
        self.parent_fd = parent_fd
        self.where = where
        self.dev = dev
        self.mounts = mounts
        self.files = 0
        self.failure: tuple[Reason, int | None, str] | None = None

    def fail(self, reason: Reason, code: int | None, path: str) -> None:
        if self.failure is None:
            self.failure = (reason, code, path)

    def result(self) -> DeleteResult:
        if self.failure is None:
            return DeleteResult(True, Reason.DELETED, files=self.files)
        reason, code, path = self.failure
        return DeleteResult(False, reason, code, path, self.files)

    # --- entering a directory ----------------------------------------------------------------------

    def enter(self, parent: _Frame | None, name: str, path: str) -> _Frame | None:
        """Open and list one directory, or deal with what it turned out to be; None when not to descend."""
        dir_fd = self.parent_fd if parent is None else parent.fd
        assert dir_fd is not None
        try:
            fd = os.open(name, _DIR, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (E.ELOOP, E.ENOTDIR):  # a link or a file now: unlink it, never follow it
                self.unlink(dir_fd, name, path)
            elif err.errno == E.EACCES and self.make_searchable(dir_fd, name):
                return self.enter(parent, name, path)
            elif err.errno != E.ENOENT:
                self.fail(Reason.DELETE_FAILED, err.errno, path)
            return None
        try:
            st = os.fstat(fd)
            if st.st_dev != self.dev or (self.mounts and path in self.mounts):
                self.fail(Reason.CROSS_DEVICE, E.EXDEV, path)
                os.close(fd)
                return None
            with os.scandir(fd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except OSError as err:
            os.close(fd)
            self.fail(Reason.DELETE_FAILED, err.errno, path)
            return None
        return _Frame(fd, name, path, (st.st_dev, st.st_ino), entries)

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

    def unlink(self, dir_fd: int, name: str, path: str, frame: _Frame | None = None) -> bool:
        """Unlink one non-directory; False when it turned out to be a directory (the caller descends)."""
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            return False
        except PermissionError as err:
            if frame is not None and err.errno == E.EACCES and self.make_writable(frame):
                return self.unlink(dir_fd, name, path)
            self.fail(Reason.DELETE_FAILED, err.errno, path)
            return True
        except OSError as err:
            self.fail(Reason.DELETE_FAILED, err.errno, path)
            return True
        self.files += 1
        return True

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

    def leave(self, stack: list[_Frame], top: _Frame) -> None:
        """Close a listed-out directory and rmdir it from its parent (reopened through `..` if closed)."""
        parent = stack[-1] if stack else None
        parent_fd = self.parent_fd if parent is None else parent.fd
        try:
            if parent is not None and parent_fd is None:
                assert top.fd is not None
                parent_fd = os.open("..", _DIR, dir_fd=top.fd)
                st = os.fstat(parent_fd)
                if (st.st_dev, st.st_ino) != parent.ident:
                    os.close(parent_fd)
                    self.fail(Reason.DELETE_FAILED, E.ESTALE, parent.path)
                    raise _Stop
                parent.fd = parent_fd
        finally:
            if top.fd is not None:
                os.close(top.fd)
                top.fd = None
        _rmdir(self, parent, top)

    # --- the walk ----------------------------------------------------------------------------------

    def run(self, name: str) -> None:
        top = self.enter(None, name, f"{self.where.rstrip('/')}/{name}")
        if top is None:
            return
        stack = [top]
        try:
            while stack:
                frame = stack[-1]
                if not frame.entries:
                    stack.pop()
                    self.leave(stack, frame)
                    continue
                entry, is_dir = frame.entries.pop()
                path = f"{frame.path}/{entry}"
                assert frame.fd is not None
                if not is_dir and self.unlink(frame.fd, entry, path, frame):
                    continue
                child = self.enter(frame, entry, path)
                if child is not None:
                    stack.append(child)
                    self.trim(stack)
        except _Stop:
            pass
        finally:
            for frame in stack:
                if frame.fd is not None:
                    os.close(frame.fd)

    @staticmethod
    def trim(stack: list[_Frame]) -> None:
        """Close the fd of the frame `_MAX_OPEN` levels up: deep trees never run out of descriptors."""
        i = len(stack) - _MAX_OPEN - 1
        if i >= 0 and stack[i].fd is not None:
            os.close(stack[i].fd)  # type: ignore[arg-type]
            stack[i].fd = None


def delete_tree_at(parent_fd: int, name: str, where: str | None = None, *, workers: int = WORKERS) -> DeleteResult:
    """Delete `name` below the open directory `parent_fd` (see the module docstring)."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"delete_tree: {name!r} is not a single entry name")
    if where is None:
        where = str(Path(f"/proc/self/fd/{parent_fd}").readlink())
    path = f"{where.rstrip('/')}/{name}"
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return DeleteResult(True, Reason.DELETED)
    except OSError as err:
        return DeleteResult(False, Reason.DELETE_FAILED, err.errno, path)
    walk = _Walk(parent_fd, where, os.fstat(parent_fd).st_dev, _mount_points_under(path))
    if not stat.S_ISDIR(st.st_mode):
        walk.unlink(parent_fd, name, path)
        return walk.result()
    if workers <= 1:
        walk.run(name)
        return walk.result()
    return _parallel(walk, name, path, workers)


def _parallel(walk: _Walk, name: str, path: str, workers: int) -> DeleteResult:
    """Split the top levels into subtrees and delete those in `workers` threads, then the top levels.

    A synced tree deletes at the speed of the disk's metadata I/O, not of Python: several walks in
    different directories keep several of those I/Os in flight (unlink releases the GIL). Each subtree walk
    is the same safe walk, from an fd of its parent held open here until every worker is done.
    """
    top = walk.enter(None, name, path)
    if top is None:
        return walk.result()
    uppers: list[tuple[_Frame | None, _Frame]] = [(None, top)]
    walk.make_writable(top)
    pending = _unlink_files(walk, top)
    for _ in range(_SPLIT_DEPTH):
        if len(pending) >= 4 * workers or not pending:
            break
        expanded: list[tuple[_Frame, str]] = []
        for parent, entry in pending:
            frame = walk.enter(parent, entry, f"{parent.path}/{entry}")
            if frame is not None:
                uppers.append((parent, frame))
                walk.make_writable(frame)  # the workers rmdir in it and cannot chmod a frame they do not own
                expanded.extend(_unlink_files(walk, frame))
        pending = expanded
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fsdelete") as pool:
            for sub in pool.map(lambda item: _subtree(walk, *item), pending):
                walk.files += sub.files
                if sub.failure is not None and walk.failure is None:
                    walk.failure = sub.failure
        for above, frame in reversed(uppers):
            assert frame.fd is not None
            os.close(frame.fd)
            frame.fd = None
            _rmdir(walk, above, frame)
    finally:
        for _, frame in uppers:
            if frame.fd is not None:
                os.close(frame.fd)
    return walk.result()


def _unlink_files(walk: _Walk, frame: _Frame) -> list[tuple[_Frame, str]]:
    """Unlink a listed directory's non-directories; return its subdirectories for the split."""
    assert frame.fd is not None
    dirs = []
    for entry, is_dir in frame.entries:
        if is_dir or not walk.unlink(frame.fd, entry, f"{frame.path}/{entry}", frame):
            dirs.append((frame, entry))
    frame.entries = []
    return dirs


def _subtree(parent_walk: _Walk, parent: _Frame, name: str) -> _Walk:
    assert parent.fd is not None
    walk = _Walk(parent.fd, parent.path, parent_walk.dev, parent_walk.mounts)
    walk.run(name)
    return walk


def _rmdir(walk: _Walk, parent: _Frame | None, frame: _Frame) -> None:
    """rmdir a listed-out `frame` from its parent; a parent without write permission (ours) is made writable once."""
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
            walk.fail(Reason.DELETE_FAILED, err.errno, frame.path)


def delete_tree(parent: Path | str, name: str, *, workers: int = WORKERS) -> DeleteResult:
    """Delete `<parent>/<name>`; `parent` is trusted (resolved once), nothing below it is followed."""
    where = os.path.realpath(parent)
    try:
        fd = os.open(where, _DIR)
    except OSError as err:
        return DeleteResult(False, Reason.DELETE_FAILED, err.errno, where)
    try:
        return delete_tree_at(fd, name, where, workers=workers)
    finally:
        os.close(fd)


async def delete_tree_async(parent: Path | str, name: str, *, workers: int = WORKERS) -> DeleteResult:
    """`delete_tree` in a worker thread: the event loop keeps ticking while a large tree goes."""
    return await asyncio.to_thread(delete_tree, parent, name, workers=workers)


def disk_usage(parent_fd: int, name: str) -> int:
    """Allocated bytes of `<parent>/<name>` and everything below it, without following links or crossing devices."""
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return int(st.st_blocks) * 512
    total = [int(st.st_blocks) * 512]

    def listing(fd: int) -> list[str]:
        subs: list[str] = []
        with os.scandir(fd) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    est = e.stat(follow_symlinks=False)
                    total[0] += est.st_blocks * 512
                    if stat.S_ISDIR(est.st_mode) and est.st_dev == st.st_dev:
                        subs.append(e.name)
        return subs

    stack: list[tuple[int, list[str]]] = []
    try:
        top = os.open(name, _DIR, dir_fd=parent_fd)
        stack.append((top, listing(top)))
        while stack:
            fd, subs = stack[-1]
            if not subs:
                os.close(fd)
                stack.pop()
                continue
            try:
                child = os.open(subs.pop(), _DIR, dir_fd=fd)
            except OSError:
                continue
            try:
                stack.append((child, listing(child)))
            except OSError:
                os.close(child)
    except OSError:
        pass
    finally:
        for fd, _ in stack:
            os.close(fd)
    return total[0]
