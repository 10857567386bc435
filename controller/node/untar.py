"""Unpacking a tar stream below one directory and nowhere else: what `kubectl sandkeep cp` writes with.

Python's tarfile is not used: before the CVE-2025-4517 fixes its `data` filter let a crafted stream write
outside the destination (a link laid down by one copy, walked through by the next). Here nothing is ever
followed, neither a link on disk nor one in the stream: every member is created relative to an fd on DEST,
one path component at a time, directories opened with O_DIRECTORY|O_NOFOLLOW and files created with
O_CREAT|O_EXCL|O_NOFOLLOW, so an existing name of any kind is refused, never opened or overwritten.

Public API:

- `check_dest(path, merge)`: refuses a DEST that is a symbolic link, not a directory, not empty (unless
  `merge`), or missing with its parent missing too. Run before a session is opened.
- `open_dest(path, merge) -> int`: the same checks, DEST created when missing; an fd on it.
- `extract(stream, dest_fd, warn) -> Extracted(written, refused)`: unpacks regular files and directories;
  every other member (links, devices, fifos, absolute names, `..`, NUL, over-long names, names that exist)
  is skipped and `warn(name, why)` is called once for it.
- `UntarError`: the copy cannot go on (DEST refused, the stream unreadable or cut short, the disk failing);
  its message is one line for a person. No other exception leaves this module for a hostile stream.

Reads ustar, GNU long names ('L', 'K') and pax headers ('x', 'g': path, linkpath, size, mtime). Memory is
bounded whatever the stream: file data is copied in CHUNK pieces and an extended header's data is held only
up to MAX_EXTENDED bytes. Modes lose setuid, setgid, sticky and group/other write; owners are not restored.
"""

from __future__ import annotations

import contextlib
import errno as E
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

BLOCK = 512
CHUNK = 1 << 16  # file data is copied in pieces of this size, never held whole
MAX_EXTENDED = 1 << 20  # a pax or GNU long-name header's data held in memory; a larger one is refused
MAX_NAME = 4096  # PATH_MAX: a longer member name is refused
MAX_COMPONENT = 255  # NAME_MAX
MAX_STAMPED_DIRS = 1 << 16  # directories whose mtime is set at the end; past that they keep the copy's time

MAX_MTIME = 1e11  # seconds either side of 1970 a member's mtime may be; past that it is not set

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Errors that would fail every member after this one too: the copy stops with one error instead.
_FATAL = frozenset({E.ENOSPC, E.EDQUOT, E.EIO, E.EROFS, E.EMFILE, E.ENFILE, E.ENOMEM})
_ZERO = bytes(BLOCK)
_SPARSE = b"GNU.sparse"
_PAX_KEYS = frozenset({b"path", b"linkpath", b"size", b"mtime", _SPARSE})
_MTIME = re.compile(rb"-?[0-9]{1,20}(\.[0-9]{1,20})?")

REGULAR, CONTIGUOUS, OLD_REGULAR = b"0", b"7", b"\0"
HARDLINK, SYMLINK, CHAR, BLOCKDEV, DIRECTORY, FIFO = b"1", b"2", b"3", b"4", b"5", b"6"
GNU_LONGNAME, GNU_LONGLINK, GNU_SPARSE, PAX, PAX_GLOBAL = b"L", b"K", b"S", b"x", b"g"
# Members that never carry data, whatever their size field says (as tarfile and GNU tar read them).
_NO_DATA = frozenset({HARDLINK, SYMLINK, CHAR, BLOCKDEV, DIRECTORY, FIFO})
_REFUSED_KINDS = {
    HARDLINK: "a hard link",
    SYMLINK: "a symbolic link",
    CHAR: "a character device",
    BLOCKDEV: "a block device",
    FIFO: "a fifo",
    GNU_SPARSE: "a sparse file",
}


class UntarError(Exception):
    """The copy cannot go on; the message is the one line a person reads after `error: `."""


class Readable(Protocol):
    def read(self, n: int = ..., /) -> bytes: ...


@dataclass
class Extracted:
    written: int = 0  # files and directories created (an existing directory entered is not counted)
    refused: int = 0  # members skipped, each with one warning


class _Refuse(Exception):
    """One member is skipped; the stream goes on."""


# --- DEST ------------------------------------------------------------------------------------------------
def check_dest(path: Path, *, merge: bool) -> None:
    """DEST is a directory that is not a link and is empty (unless `merge`), or is missing with its parent there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise UntarError(
                f"{path.parent} does not exist; create it first (cp creates DEST, not its parents)"
            ) from None
        return
    except OSError as err:
        raise UntarError(f"cannot read {path}: {err.strerror}") from err
    if stat.S_ISLNK(st.st_mode):
        raise UntarError(
            f"{path} is a symbolic link; cp never writes through a link: give the directory itself or a new one"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UntarError(f"{path} exists and is not a directory; give a new or empty directory")
    if not merge and _has_entries(path):
        raise UntarError(f"{path} is not empty; give a new or empty directory, or --merge to add to it")


def open_dest(path: Path, *, merge: bool) -> int:
    """An fd on DEST, created when missing, after `check_dest`'s checks (repeated on the fd itself)."""
    check_dest(path, merge=merge)
    try:
        path.mkdir(mode=0o755, exist_ok=True)
        fd = os.open(path, _DIR)  # O_NOFOLLOW: a link put there since the check is refused
    except OSError as err:
        raise UntarError(f"cannot open {path}: {_why(err, path)}") from err
    if not merge and _has_entries(fd):
        os.close(fd)
        raise UntarError(f"{path} is not empty; give a new or empty directory, or --merge to add to it")
    return fd


def _has_entries(directory: Path | int) -> bool:
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except OSError as err:
        raise UntarError(f"cannot read {directory}: {err.strerror}") from err


def _why(err: OSError, path: Path) -> str:
    if err.errno in (E.ENOTDIR, E.ELOOP) and path.is_symlink():
        return "it is a symbolic link"
    return err.strerror or str(err)


# --- the stream -------------------------------------------------------------------------------------------
class _Reader:
    """Blocks of the stream, and one member's data at a time in pieces; a short read is the stream cut short."""

    def __init__(self, stream: Readable) -> None:
        self.stream = stream
        self.left = 0  # data bytes of the current member not read yet
        self.pad = 0  # then this many bytes to its next block boundary
        self.what = ""

    def read(self, n: int) -> bytes:
        """Up to n bytes; fewer only at the end of the stream."""
        pieces: list[bytes] = []
        got = 0
        while got < n:
            try:
                piece = self.stream.read(n - got)
            except OSError as err:
                raise UntarError(f"cannot read the tar stream: {err.strerror or err}") from err
            if not piece:
                break
            pieces.append(piece)
            got += len(piece)
        return b"".join(pieces)

    def exactly(self, n: int, what: str) -> bytes:
        data = self.read(n)
        if len(data) < n:
            raise UntarError(f"the tar stream ends inside {what}: it was cut short")
        return data

    def begin(self, size: int, what: str) -> None:
        self.left, self.pad, self.what = size, -size % BLOCK, what

    def chunks(self) -> Iterator[bytes]:
        while self.left:
            data = self.exactly(min(CHUNK, self.left), self.what)
            self.left -= len(data)
            yield data

    def finish(self) -> None:
        """Skips what the member's handler did not read, and the padding."""
        for _ in self.chunks():
            pass
        self.exactly(self.pad, self.what)
        self.pad = 0

    def drain(self) -> None:
        """After the end-of-archive block: tar's padding to its record size (tar must not die of a closed pipe)."""
        while self.read(CHUNK):
            pass


@dataclass
class _Header:
    name: bytes
    linkname: bytes
    size: int
    mode: int
    mtime: int | None
    kind: bytes
    extension: bool  # an old-GNU sparse header followed by more sparse-map blocks


def _number(raw: bytes, what: str) -> int:
    """An octal field, or GNU's base-256 for values that do not fit (first byte 0x80)."""
    if raw[:1] == b"\x80":
        return int.from_bytes(raw[1:], "big")
    if raw and raw[0] & 0x80:
        raise UntarError(f"a corrupt tar header: its {what} is negative or not a number")
    text = raw.split(b"\0", 1)[0].strip(b" ")
    if text and not text.strip(b"01234567"):
        return int(text, 8)
    if not text:
        return 0
    raise UntarError(f"a corrupt tar header: its {what} {text!r} is not an octal number")


def _mtime(raw: bytes) -> int | None:
    """A member's mtime, or None (the copy's own time) for one this reader does not take (before 1970)."""
    try:
        return _number(raw, "mtime")
    except UntarError:
        return None


def _nts(raw: bytes) -> bytes:
    return raw.split(b"\0", 1)[0]


def _header(block: bytes) -> _Header:
    expected = _number(block[148:156], "checksum")
    unsigned = sum(block[:148]) + sum(block[156:]) + 8 * 32
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b & 0x80)
    if expected not in (unsigned, signed):
        raise UntarError("not a tar stream, or a corrupt tar header (its checksum does not match)")
    name = _nts(block[0:100])
    prefix = _nts(block[345:500])
    if block[257:265] == b"ustar\x0000" and prefix:  # POSIX ustar splits a long name; GNU's field is other data
        name = prefix + b"/" + name
    kind = block[156:157]
    if kind == OLD_REGULAR and name.endswith(b"/"):  # old tar's way of writing a directory
        kind = DIRECTORY
    return _Header(
        name=name,
        linkname=_nts(block[157:257]),
        size=_number(block[124:136], "size"),
        mode=_number(block[100:108], "mode") & 0o7777,
        mtime=_mtime(block[136:148]),
        kind=kind,
        extension=kind == GNU_SPARSE and block[482] != 0,
    )


def _pax(data: bytes) -> dict[bytes, bytes]:
    """The records of a pax header (`LENGTH KEY=VALUE\\n`) that this reader uses, so that any number of
    headers hold at most _PAX_KEYS values; GNU's sparse keys are kept as one. Anything else is corrupt."""
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        end = pos + int(digits) if digits.isdigit() else -1
        if end <= space or end > len(data) or data[end - 1 : end] != b"\n":
            raise UntarError("a corrupt pax header in the tar stream")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq or not key:
            raise UntarError("a corrupt pax header in the tar stream")
        if key.startswith(b"GNU.sparse."):
            key, value = _SPARSE, b"1"
        if key in _PAX_KEYS:
            records[key] = value
        pos = end
    return records


def _pax_size(value: bytes) -> int:
    if not value.isdigit() or len(value) > 20:
        raise UntarError(f"a corrupt pax header in the tar stream: size {value[:40]!r}")
    return int(value)


def show(name: bytes) -> str:
    """A member's name for a message (repr'd by the caller, so control characters cannot reach a terminal)."""
    return name.decode("utf-8", "backslashreplace")


# --- names and paths ----------------------------------------------------------------------------------------
def _parts(name: bytes) -> tuple[bytes, ...]:
    """The components of a member's name below DEST, or _Refuse; () is DEST itself (tar's `./`)."""
    if not name:
        raise _Refuse("an empty name")
    if b"\0" in name:
        raise _Refuse("a NUL byte in its name")
    if len(name) > MAX_NAME:
        raise _Refuse(f"a name of {len(name)} bytes (the limit is {MAX_NAME})")
    if name.startswith(b"/"):
        raise _Refuse("an absolute path")
    parts = tuple(p for p in name.split(b"/") if p not in (b"", b"."))
    if b".." in parts:
        raise _Refuse("a '..' component")
    if any(len(p) > MAX_COMPONENT for p in parts):
        raise _Refuse(f"a name component over {MAX_COMPONENT} bytes")
    return parts


def _refusal(parent_fd: int, parts: tuple[bytes, ...], err: OSError) -> _Refuse:
    """Why a component could not be used, naming it: a link or file already in DEST is never followed."""
    where = show(b"/".join(parts))
    with contextlib.suppress(OSError):
        mode = os.lstat(parts[-1], dir_fd=parent_fd).st_mode
        if stat.S_ISLNK(mode):
            return _Refuse(f"{where!r} is a symbolic link in DEST (never followed or replaced)")
        if err.errno in (E.EEXIST, E.ENOTDIR):
            return _Refuse(f"{where!r} already exists in DEST (never overwritten)")
    return _Refuse(f"{where!r}: {err.strerror}")


@contextlib.contextmanager
def _directory(dest_fd: int, parts: tuple[bytes, ...]) -> Iterator[int]:
    """An fd on DEST/parts, each missing component made (0o755), none followed if it is a link."""
    fd = dest_fd
    try:
        for i, part in enumerate(parts):
            parent = fd
            try:
                fd = _enter(parent, part)
            except OSError as err:
                if err.errno in _FATAL:
                    raise
                raise _refusal(parent, parts[: i + 1], err) from err
            finally:
                if parent != dest_fd and fd != parent:
                    os.close(parent)
        yield fd
    finally:
        if fd != dest_fd:
            os.close(fd)


def _enter(parent_fd: int, name: bytes) -> int:
    try:
        return os.open(name, _DIR, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    with contextlib.suppress(FileExistsError):  # made meanwhile: the open below judges what is there
        os.mkdir(name, 0o755, dir_fd=parent_fd)
    return os.open(name, _DIR, dir_fd=parent_fd)


# --- members -----------------------------------------------------------------------------------------------
@dataclass
class _Unpacker:
    reader: _Reader
    dest_fd: int
    warn: Callable[[str, str], None]
    done: Extracted = field(default_factory=Extracted)
    stamps: list[tuple[tuple[bytes, ...], float]] = field(default_factory=list)

    def member(self, header: _Header, name: bytes, mtime: float | None, refused: str | None) -> None:
        """One member, whose data the reader is positioned at; refused ones are skipped with a warning."""
        try:
            if refused:
                raise _Refuse(refused)
            if header.kind in _REFUSED_KINDS:
                link = f" (to {show(header.linkname)!r})" if header.kind in (HARDLINK, SYMLINK) else ""
                raise _Refuse(f"{_REFUSED_KINDS[header.kind]}{link}; cp copies files and directories only")
            parts = _parts(name)
            if header.kind == DIRECTORY:
                self.directory(parts, header.mode, mtime)
            elif header.kind in (REGULAR, OLD_REGULAR, CONTIGUOUS):
                self.file(parts, header.mode, mtime)
            else:
                raise _Refuse(f"tar type {show(header.kind)!r}; cp copies files and directories only")
        except _Refuse as why:
            self.done.refused += 1
            self.warn(show(name), str(why))
        except OSError as err:
            if err.errno in _FATAL:
                raise UntarError(f"cannot write {show(name)!r}: {err.strerror}") from err
            self.done.refused += 1
            self.warn(show(name), err.strerror or str(err))

    def directory(self, parts: tuple[bytes, ...], mode: int, mtime: float | None) -> None:
        if not parts:
            return  # `./`: DEST itself, left as it is
        with self._parent(parts) as parent:
            try:
                os.mkdir(parts[-1], (mode & 0o755) | 0o700, dir_fd=parent)
            except FileExistsError:
                with _directory(self.dest_fd, parts):  # an existing directory is entered, a link or file refused
                    return
        self.done.written += 1
        if mtime is not None and len(self.stamps) < MAX_STAMPED_DIRS:
            self.stamps.append((parts, mtime))

    def file(self, parts: tuple[bytes, ...], mode: int, mtime: float | None) -> None:
        if not parts:
            raise _Refuse("a file named like DEST itself")
        with self._parent(parts) as parent:
            try:
                fd = os.open(parts[-1], _NEW_FILE, mode & 0o755, dir_fd=parent)
            except OSError as err:
                if err.errno in _FATAL:
                    raise
                raise _refusal(parent, parts, err) from err
        try:
            for data in self.reader.chunks():
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            if mtime is not None:
                os.utime(fd, (mtime, mtime))
        except OSError as err:
            raise UntarError(f"cannot write {show(b'/'.join(parts))!r}: {err.strerror}") from err
        finally:
            os.close(fd)
        self.done.written += 1

    @contextlib.contextmanager
    def _parent(self, parts: tuple[bytes, ...]) -> Iterator[int]:
        with _directory(self.dest_fd, parts[:-1]) as fd:
            yield fd

    def stamp_directories(self) -> None:
        """Directory mtimes last: writing their contents changed them. Best effort."""
        for parts, mtime in self.stamps:
            with contextlib.suppress(OSError, _Refuse), _directory(self.dest_fd, parts) as fd:
                os.utime(fd, (mtime, mtime))


def extract(stream: Readable, dest_fd: int, warn: Callable[[str, str], None]) -> Extracted:
    """Unpacks the tar `stream` below the directory `dest_fd`; refused members are skipped with `warn(name, why)`.

    Raises UntarError, and nothing else, when the copy cannot go on; what was written until then stays."""
    reader = _Reader(stream)
    unpacker = _Unpacker(reader, dest_fd, warn)
    globals_: dict[bytes, bytes] = {}
    pending: dict[bytes, bytes] = {}  # from 'x', 'L' and 'K' headers, for the next member only
    refused: str | None = None
    while True:
        block = reader.read(BLOCK)
        if not block:
            raise UntarError("the tar stream ends without tar's end-of-archive block: it was cut short")
        if len(block) < BLOCK:
            raise UntarError("the tar stream ends inside a header: it was cut short")
        if block == _ZERO:
            reader.drain()
            break
        header = _header(block)
        if header.kind in (PAX, PAX_GLOBAL):
            # A pax header may carry the next member's size: one too big to read leaves no way on.
            if header.size > MAX_EXTENDED:
                raise UntarError(f"a pax header of {header.size} bytes (the limit is {MAX_EXTENDED})")
            records = _pax(reader.exactly(header.size + -header.size % BLOCK, "a pax header")[: header.size])
            if header.kind == PAX:
                pending.update(records)
            else:
                globals_.update(records)
            continue
        if header.kind in (GNU_LONGNAME, GNU_LONGLINK):
            key = b"path" if header.kind == GNU_LONGNAME else b"linkpath"
            reader.begin(header.size, "a GNU long name")
            if header.size > MAX_EXTENDED:
                refused = f"a GNU long name of {header.size} bytes (the limit is {MAX_NAME})"
            else:
                pending[key] = _nts(b"".join(reader.chunks()))
            reader.finish()
            continue
        if header.extension:  # old-GNU sparse: more map blocks follow, each saying whether another does
            while reader.exactly(BLOCK, "a sparse map")[504]:
                pass
        fields = {k: v for k, v in {**globals_, **pending}.items() if v}  # an empty pax value unsets a key
        name = fields.get(b"path", header.name)
        header.linkname = fields.get(b"linkpath", header.linkname)
        size = _pax_size(fields[b"size"]) if b"size" in fields else header.size
        mtime: float | None = header.mtime
        if b"mtime" in fields:
            mtime = float(fields[b"mtime"]) if _MTIME.fullmatch(fields[b"mtime"]) else None
        if mtime is not None and not -MAX_MTIME < mtime < MAX_MTIME:
            mtime = None  # past what utime takes: the copy's own time
        if _SPARSE in fields:
            refused = refused or "a sparse file; cp copies files and directories only"
        reader.begin(0 if header.kind in _NO_DATA else size, f"the data of {show(name)!r}")
        unpacker.member(header, name, mtime, refused)
        reader.finish()
        pending, refused = {}, None
    unpacker.stamp_directories()
    return unpacker.done
