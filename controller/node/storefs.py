"""The disk store's common ground: its errors, the root's own entries, and file operations that reach every
entry fd-relative and never follow a link (open, rename without replacing, write all or nothing).

`store.Root` and each of its parts (manifests.py, tombstones.py, scan.py, retain.py) work `AtRoot`: the
root's path, and the root opened as a directory fd.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as E
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from controller.rules.contracts import LOCK_NAME, QUARANTINE_FILE, VOLUMES_DIR, Reason
from controller.rules.models import is_namespace_name, is_object_name

# A read that failed for a moment: held this pass and read again next pass, never acted on.
TRANSIENT_ERRNOS = frozenset(
    {E.EMFILE, E.ENFILE, E.EIO, E.EAGAIN, E.EINTR, E.ENOMEM, E.EBUSY, E.ESTALE, E.ETIMEDOUT, E.ENOBUFS}
)
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # the store's every directory open
# the root's own entries: never a stray, never renamed (VOLUMES_DIR: captured volumes, node/capture.py)
PRIVATE = frozenset({LOCK_NAME, QUARANTINE_FILE, VOLUMES_DIR})
FILESYSTEMS = frozenset({"lost+found"})  # the filesystem's own, where the root is a mount point: left alone


class StoreError(Exception):
    """A store operation that did not happen: `.reason`, `.errno` (when a syscall said why), `.path`."""

    def __init__(self, reason: Reason, message: str, *, errno: int | None = None, path: Path | str | None = None):
        super().__init__(message)
        self.reason = reason
        self.errno = errno
        self.path = None if path is None else str(path)


class RootRefused(StoreError):
    """The root itself was refused: owned by another uid, not a directory, or locked by another process."""


def errno_of(err: OSError) -> int:
    return err.errno if err.errno is not None else E.EIO


def ident(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    return os.open(name, OPEN_DIR, dir_fd=dir_fd)


@contextlib.contextmanager
def held_fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def rename_noreplace(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """rename(2) that fails with EEXIST instead of replacing whatever is at `dst` (renameat2 NOREPLACE).

    A tombstone must never land on an existing name: a plain rename would silently replace an empty
    directory there. Where renameat2 is missing, an lstat first is the (racy, lock-covered) fallback.
    """
    if _renameat2 is not None:
        rc = _renameat2(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (E.ENOSYS, E.EINVAL):
            raise OSError(err, os.strerror(err), dst)
    try:
        os.lstat(dst, dir_fd=dst_fd)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        return
    raise OSError(E.EEXIST, os.strerror(E.EEXIST), dst)


def write_atomic(dir_fd: int, name: str, data: bytes, *, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Write `name` in `dir_fd` all or nothing: an exclusive temp file beside it, fsync, rename, fsync the dir.

    The temp file is created O_EXCL|O_NOFOLLOW so a planted path is never written through, gets `owner` and
    `mode` before the rename (so a pin by root keeps a manifest the agent's uid can read), and is removed on
    every failure path.
    """
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            if owner is not None:
                try:
                    os.fchown(fd, *owner)
                except PermissionError:
                    if owner[0] != os.geteuid():
                        raise
            os.fchmod(fd, mode)  # explicit: the mode given to open() is filtered through the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def check_names(namespace: str, name: str) -> None:
    if not is_namespace_name(namespace):
        raise ValueError(
            f"namespace {namespace!r} is not a DNS-1123 label (lowercase letters, digits and '-', at most 63); "
            "use a Kubernetes namespace name"
        )
    if not is_object_name(name):
        raise ValueError(
            f"name {name!r} is not a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', at most 253); "
            "use a Kubernetes object name"
        )


class AtRoot:
    """What works on one root (`store.Root` and each of its parts): the root's path, and the root opened as a
    directory fd."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _open(self) -> int:
        return open_dir(self.path)
