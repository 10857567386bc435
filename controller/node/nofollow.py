"""Opening a directory without following a link, and knowing which mount it is on: what every walk of the
node's trees (the delete, the size walk, the store, the orphan records, capture) stands on.

- `OPEN_DIR`: the flags every walk opens a directory with (O_DIRECTORY|O_NOFOLLOW): never a link, never a file.
- `open_no_symlinks(path) -> int`: a directory fd for an absolute path with no link in ANY component
  (openat2 RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH from `/`, else one O_NOFOLLOW open per component).
- `mount_id(fd) -> int | None`: the mount a descriptor is on (statx STATX_MNT_ID, else /proc/self/fdinfo);
  `identify(fd) -> Ident`: its device, inode, blocks and mount in one statx. A bind mount keeps st_dev but
  not the mount id; an unknown mount id is treated as a mount by every caller.
- `unescape_mountinfo(text)`: a path as /proc/<pid>/mountinfo writes it, unescaped.
"""

from __future__ import annotations

import ctypes
import errno as E
import os
import struct
from pathlib import Path
from typing import NamedTuple

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # every walk's open: never a link, never a file


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
