"""A unix socket's file, put in place and taken away safely: where the kubelet finds the plugin and the registrar.

- The server binds inside a fresh 0700 directory beside the final path, the socket is made 0600, then renamed
  onto the final path: there is no moment at which another user can connect, and a rename never follows a link.
- What is already at the path is looked at with lstat, never followed: nothing, or a socket that refuses
  connections (left by a process that died), is replaced; a socket something still answers on, a link, or any
  other file is refused with a message saying what is there.
- On stop the path is removed only while it is still this socket (same device and inode): a successor's stays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAX_PATH = 107  # sun_path is 108 bytes with its NUL: a longer path cannot be bound or connected to
_PROBE_TIMEOUT = 1.0


class SocketRefused(Exception):
    """The socket's path cannot be served on: the message says what is there and what to do."""


@dataclass(frozen=True)
class Placed:
    """A socket this process serves on, known by its device and inode."""

    path: Path
    dev: int
    ino: int

    def is_ours(self) -> bool:
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == (self.dev, self.ino)

    def remove(self) -> None:
        """Unlink the path if it is still this socket (a successor may have replaced it meanwhile)."""
        if self.is_ours():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def place(path: Path, bind: Callable[[str], object]) -> Placed:
    """Serve on `path`: `bind("unix:<private path>")` binds the server there, then the socket is moved onto `path`."""
    if len(os.fsencode(path)) > MAX_PATH:
        raise SocketRefused(f"{path}: a unix socket's path is at most {MAX_PATH} bytes")
    _check_free(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A dot name: the kubelet's plugin watcher ignores entries whose names start with '.'.
    private = path.parent / f".{path.name}.{secrets.token_hex(4)}"
    private.mkdir(mode=0o700)
    try:
        bound = private / "s"
        bind(f"unix:{bound}")
        bound.chmod(0o600)
        st = os.lstat(bound)
        bound.rename(path)
    finally:
        with contextlib.suppress(OSError):
            (private / "s").unlink()
        with contextlib.suppress(OSError):
            private.rmdir()
    return Placed(path, st.st_dev, st.st_ino)


def _check_free(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        what = (
            "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
        )
        raise SocketRefused(f"{path} is {what}, not a socket: remove it if it is not needed, or pick another path")
    if answers(path):
        raise SocketRefused(f"{path}: another process is serving on it; stop it first (one plugin per node)")


def answers(path: Path) -> bool:
    """Whether something accepts connections on the socket at `path` (refused or gone: a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT)
        try:
            probe.connect(os.fspath(path))
        except OSError as err:
            if err.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise SocketRefused(f"{path}: cannot tell whether another process serves on it: {err}") from err
    return True
