"""The node-side disk store: one root of retained sandboxes, its lock, its manifests and its tombstones.

Layout (DESIGN.md "On disk"):

    <root>/                       owned by this process's uid, mode 0700
      .sandkeep.lock              flock: one process works on a root at a time (`Root.lock`)
      .reap-<id>-<unix-ms>        tombstones: a sandbox renamed aside before it is deleted
      <namespace>/<name>/         one sandbox
        manifest.json             0600, always written atomically
        workspace/                the job's files (moved here by rename, never copied)
        .commands/                records of processes started in the sandbox

Public API (names are stable; the node agent builds on them):

- `RootRefused(StoreError)`: a refusal with `.reason` (a `Reason`), `.errno`, `.path`, and a message naming
  the path, what was refused, why and what to do next. `StoreError` is the base of every store failure.
- `Root(path, *, create=True)`: `.path`, `.lock(wait=None)` (context manager; `wait` seconds, None =
  forever, 0 = once), `.sandbox_path(ns, name)`, `.retain(source, ns, name, *, job_id, created_at,
  retention, node=None, exclude=(), now=None, replace=None) -> Manifest` (`replace: Replace`, a callback
  returning None or a `Refusal`, frees a taken name through the caller's deletion pipeline),
  `.read(ns, name) -> Read`,
  `.read_many(entries) -> {(ns, name): Read}`, `.scan() -> Scan`,
  `.pin(ns, name, until, *, now) -> Manifest` (`until=None` removes the pin), `.tombstone(ns, name, *, id,
  now) -> Tombstone`, `.read_tombstone(t) -> Read`, `.restore(t, ns, name) -> bool`, `.tombstones()`,
  `.delete_tombstone(t) -> fsdelete.DeleteResult` (sync; the agent awaits
  `fsdelete.delete_tree_async(root.path, t.name)` instead), `.remove_stray(stray) -> bool`,
  `.remove_empty_namespace(ns) -> bool`, `.lstat_entry(rel)`, `.tombstone_entry(rel, ident, *, id, now)` (any
  entry a scan names, renamed as a name and only when it is still the inode `ident`), `.read_private(name)` /
  `.write_private(name, data)` (the root's own files beside the lock), `.size(ns, name) -> int` (allocated
  bytes), `.usage(ns, name, budget) -> treesize.TreeSize(bytes, files, complete, reason)` (what the agent's
  size thread reports; linear time and bounded memory on any tree, cut short past `budget` seconds).
  Store failures raise `StoreError` (e.g. RENAME_FAILED with `.errno`); bad names raise ValueError.
- Reads: `Present(manifest, text)`, `Absent(reason)`, `Unparsed(text)`, `Unreadable(errno)`,
  `Transient(errno)`, `Mismatch(manifest, text)`; each has `.reason`. `same_read(a, b)` is the
  byte-for-byte "nothing changed" test the sweep uses before acting.
- Scan: `Scan(sandboxes: list[Entry], strays: list[Stray], tombstones: list[Tombstone], empty_namespaces)`.
- Tombstones: `Tombstone(name, id, made_at, path)` (`.pid`, `.age(now)`), `tombstone_name(id, now)`,
  `parse_tombstone(name, root=None)`, `standalone_id()` (`p<pid>-<hex>`: names the process that made it;
  a cluster uses the object's uid). `retain` stages under a tombstone name too (`p<pid>-<hex>-stage`), so a
  crash mid-retain leaves an ordinary leftover.
- `TRANSIENT_ERRNOS`: the errnos a read reports as `Transient` (held, read again next pass).

Everything below the root is reached fd-relative with O_NOFOLLOW: a symlink planted anywhere in the tree is
never followed to read, write, rename or delete a file elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as E
import fcntl
import fnmatch
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pydantic import ValidationError

from controller.node import fsdelete, treesize
from controller.rules.contracts import (
    COMMANDS_DIR,
    LOCK_NAME,
    MANIFEST_NAME,
    QUARANTINE_FILE,
    TOMBSTONE_PREFIX,
    VOLUMES_DIR,
    WORKSPACE_DIR,
    Reason,
)
from controller.rules.durations import MAX_INSTANT, MIN_INSTANT, format_instant, instant_or_none, shift
from controller.rules.models import Manifest, Origin, is_namespace_name, is_object_name

# A read that failed for a moment: held this pass and read again next pass, never acted on.
TRANSIENT_ERRNOS = frozenset(
    {E.EMFILE, E.ENFILE, E.EIO, E.EAGAIN, E.EINTR, E.ENOMEM, E.EBUSY, E.ESTALE, E.ETIMEDOUT, E.ENOBUFS}
)
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few hundred bytes; anything this large is not ours
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Whole-string matches (fullmatch) and ASCII digits: `$` accepts a final newline, `\d` accepts `３`.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
_TOMBSTONE = re.compile(re.escape(TOMBSTONE_PREFIX) + r"([A-Za-z0-9][A-Za-z0-9-]{0,63})-([0-9]{1,15})")
_STANDALONE_ID = re.compile(r"p([0-9]{1,10})-[0-9a-f]{4,32}(?:-[a-z]{1,8})?")
_STAGE_SUFFIX = "stage"  # staging directories are tombstone-named: a crash mid-retain leaves a plain leftover
# the root's own entries: never a stray, never renamed (VOLUMES_DIR: captured volumes, node/capture.py)
_PRIVATE = frozenset({LOCK_NAME, QUARANTINE_FILE, VOLUMES_DIR})
_FILESYSTEMS = frozenset({"lost+found"})  # the filesystem's own, where the root is a mount point: left alone
MAX_PRIVATE_BYTES = 4 << 20  # a private file read back larger than this is not ours: ignored


class StoreError(Exception):
    """A store operation that did not happen: `.reason`, `.errno` (when a syscall said why), `.path`."""

    def __init__(self, reason: Reason, message: str, *, errno: int | None = None, path: Path | str | None = None):
        super().__init__(message)
        self.reason = reason
        self.errno = errno
        self.path = None if path is None else str(path)


class RootRefused(StoreError):
    """The root itself was refused: owned by another uid, not a directory, or locked by another process."""


# --- reads ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Present:
    manifest: Manifest
    text: str
    reason: Reason = field(default=Reason.RETAINED, compare=False)


@dataclass(frozen=True)
class Absent:
    """No manifest: no file, or the sandbox path is not a directory (a symlink is never followed)."""

    reason: Reason = Reason.MANIFEST_ABSENT


@dataclass(frozen=True)
class Unparsed:
    text: str
    why: str = field(default="", compare=False)
    reason: Reason = field(default=Reason.MANIFEST_UNPARSED, compare=False)


@dataclass(frozen=True)
class Unreadable:
    errno: int
    reason: Reason = field(default=Reason.MANIFEST_UNREADABLE, compare=False)


@dataclass(frozen=True)
class Transient:
    errno: int
    reason: Reason = field(default=Reason.MANIFEST_UNREAD, compare=False)


@dataclass(frozen=True)
class Mismatch:
    """A manifest that names another namespace/name than the path it sits under: refused, never acted on."""

    manifest: Manifest
    text: str
    reason: Reason = field(default=Reason.MANIFEST_MISMATCH, compare=False)


Read = Present | Absent | Unparsed | Unreadable | Transient | Mismatch


def same_read(a: Read, b: Read) -> bool:
    """Whether two reads of one sandbox say the same thing: same kind and, for a file, the same bytes.

    The sweep acts only when a fresh read right before the rename (and one through the tombstone right after
    it) is the same as the read it decided on, so a pin or a replacement in between holds the sandbox.
    Two failures with the same errno are the same; a transient read is never the same as anything.
    """
    if isinstance(a, Transient) or isinstance(b, Transient):
        return False
    if isinstance(a, Absent) or isinstance(b, Absent):
        return isinstance(a, Absent) and isinstance(b, Absent)
    if isinstance(a, Unreadable) or isinstance(b, Unreadable):
        return isinstance(a, Unreadable) and isinstance(b, Unreadable) and a.errno == b.errno
    return type(a) is type(b) and a.text == b.text


# --- tombstones ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tombstone:
    """`<root>/.reap-<id>-<unix-ms>`: a sandbox renamed aside, decided for deletion."""

    name: str
    id: str
    made_at: datetime
    path: Path

    @property
    def pid(self) -> int | None:
        """The pid that made it, when the id is a standalone one (`p<pid>-<hex>`); None for an object uid."""
        m = _STANDALONE_ID.fullmatch(self.id)
        return int(m.group(1)) if m else None

    def age(self, now: datetime) -> timedelta:
        return now - self.made_at

    @property
    def staging(self) -> bool:
        """A retain's staging directory (a crash between its two renames leaves one)."""
        return self.id.endswith(f"-{_STAGE_SUFFIX}")


def standalone_id() -> str:
    """A tombstone id for a process without an object uid: `p<pid>-<8 hex>`, so a sweep can tell whose it is."""
    return f"p{os.getpid()}-{secrets.token_hex(4)}"


def _ms(now: datetime) -> int:
    return int(now.timestamp() * 1000)


def tombstone_name(id: str, now: datetime) -> str:
    """`.reap-<id>-<unix-ms>`: at most 86 bytes whatever the sandbox is called (well inside NAME_MAX)."""
    if not _ID.fullmatch(id):
        raise ValueError(f"tombstone id {id!r} must be 1-64 letters, digits or '-' (an object uid or a short hex)")
    return f"{TOMBSTONE_PREFIX}{id}-{max(_ms(now), 0)}"


def parse_tombstone(name: str, root: Path | None = None) -> Tombstone | None:
    """The tombstone a root entry's name describes, or None when it is not a name this module writes."""
    m = _TOMBSTONE.fullmatch(name)
    if not m:
        return None
    try:
        made = datetime.fromtimestamp(int(m.group(2)) / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return Tombstone(name, m.group(1), made, (root or Path()) / name)


# --- scan ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A sandbox directory found by a scan; its manifest is read separately (`Root.read`), once."""

    namespace: str
    name: str
    path: Path


@dataclass(frozen=True)
class Stray:
    """An entry of the root or a namespace directory that is not a sandbox; never followed.

    `rel` is relative to the root (`ns` or `ns/name`); `is_dir` tells whether `remove_stray` may unlink it
    (only non-directories are removed, as the reference does; a directory with a bad name is only reported).
    """

    rel: str
    path: Path
    reason: Reason
    is_dir: bool


@dataclass
class Scan:
    sandboxes: list[Entry] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)
    tombstones: list[Tombstone] = field(default_factory=list)
    empty_namespaces: list[str] = field(default_factory=list)


# --- helpers -------------------------------------------------------------------------------------------


def _errno_of(err: OSError) -> int:
    return err.errno if err.errno is not None else E.EIO


def _open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    return os.open(name, _DIR, dir_fd=dir_fd)


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def _rename_noreplace(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
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


def _write_atomic(dir_fd: int, name: str, data: bytes, *, mode: int, owner: tuple[int, int] | None = None) -> None:
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


def _read_manifest_at(parent_fd: int, name: str) -> Read:
    """Read `<parent>/<name>/manifest.json` without following a link anywhere; the namespace is not checked."""
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except OSError as err:
        return _failed_read(err)
    if stat.S_ISLNK(st.st_mode):
        return Absent(Reason.SYMLINK)
    if not stat.S_ISDIR(st.st_mode):
        return Absent(Reason.NOT_A_DIRECTORY)
    try:
        with _fd(_open_dir(name, parent_fd)) as dir_fd:
            return _read_manifest_in(dir_fd)
    except OSError as err:
        return _failed_read(err)


def _failed_read(err: OSError) -> Read:
    """What a failed step of reading a manifest means: held (transient), absent, or unreadable."""
    code = _errno_of(err)
    if code in TRANSIENT_ERRNOS:
        return Transient(code)
    return Absent() if code in (E.ENOENT, E.ENOTDIR) else Unreadable(code)


def _claimed(read: Read, namespace: str, name: str) -> Read:
    """A manifest that names another sandbox than the path it sits under is a Mismatch, never Present."""
    if isinstance(read, Present) and (read.manifest.namespace, read.manifest.name) != (namespace, name):
        return Mismatch(read.manifest, read.text)
    return read


def _read_manifest_in(dir_fd: int) -> Read:
    """Read `manifest.json` of the open sandbox directory `dir_fd` (never through a link, never a FIFO)."""
    try:
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        with _fd(fd):
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return Unreadable(E.EINVAL)
            chunks: list[bytes] = []
            size = 0
            while size <= MAX_MANIFEST_BYTES:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except OSError as err:
        return _failed_read(err)
    raw = b"".join(chunks)
    text = raw.decode("utf-8", errors="surrogateescape")
    if size > MAX_MANIFEST_BYTES:
        return Unparsed(text[:200], f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return Present(Manifest.model_validate(json.loads(raw)), text)
    except (ValueError, ValidationError) as err:
        return Unparsed(text, str(err).splitlines()[0])


def _check_names(namespace: str, name: str) -> None:
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


def _relpath_matches(rel: str, base: str, patterns: Sequence[str]) -> bool:
    """A glob matches a path relative to the source, or (without a '/') any entry's own name at any depth."""
    return any(fnmatch.fnmatchcase(rel, p) or ("/" not in p and fnmatch.fnmatchcase(base, p)) for p in patterns)


# --- the root ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """A retain's source, held open: its parent (no link on the way), its name there, itself, and its inode."""

    path: Path  # for messages only: everything is done through the fds
    parent_fd: int
    name: str
    fd: int
    ident: tuple[int, int]


@dataclass(frozen=True)
class Refusal:
    """Why a replacing retain's deletion pipeline left the previous sandbox in place, and what to do next."""

    reason: Reason
    why: str  # who or what holds it, e.g. "in use: pid 4242 (sleep) cwd"
    next: str = "Retry once it is released, or retain under another name"


# Frees `<ns>/<name>` for a replacing retain the way a deletion would (the caller's pipeline: root lock,
# recorded orphans reaped, in-use check, tombstone, delete), given the read the store refused a pin on (the
# claim: any change since holds it); returns None once the name is free, else why it was not freed.
Replace = Callable[[str, str, Read], Refusal | None]
_EXCLUDE_MAX_DEPTH = 256  # levels --exclude walks (one open directory each); deeper sources are refused whole


class Root:
    """One root of retained sandboxes. Every method is safe to call from a process that does not hold the lock
    (the sweep's re-reads and tombstone read-backs are what make a concurrent pin or retain safe), but only one
    process at a time should sweep a root (`lock`)."""

    def __init__(self, path: Path | str, *, create: bool = True) -> None:
        given = Path(path)
        if create:
            try:
                given.mkdir(mode=0o700, parents=True)
                given.chmod(0o700)  # mkdir's mode passes through the umask
            except FileExistsError:
                pass
            except OSError as err:
                raise RootRefused(
                    Reason.NOT_A_DIRECTORY,
                    f"root {given}: could not create it ({os.strerror(_errno_of(err))}); "
                    "create it as this process's user with mode 0700, or pick another --root",
                    errno=_errno_of(err),
                    path=given,
                ) from err
        self.path = Path(os.path.realpath(given))
        self._check_owner()

    def _check_owner(self) -> None:
        """Refuse a root this uid does not own: whoever owns it could swap a sandbox for a link of their own."""
        try:
            st = os.lstat(self.path)
        except OSError as err:
            raise RootRefused(
                Reason.NOT_A_DIRECTORY,
                f"root {self.path}: cannot use it ({os.strerror(_errno_of(err))}); create it or pick another --root",
                errno=_errno_of(err),
                path=self.path,
            ) from err
        if not stat.S_ISDIR(st.st_mode):
            raise RootRefused(
                Reason.NOT_A_DIRECTORY,
                f"root {self.path}: refused, it is not a directory; pick a directory for --root",
                path=self.path,
            )
        if st.st_uid != os.geteuid():
            raise RootRefused(
                Reason.ROOT_FOREIGN_OWNER,
                f"root {self.path}: refused, it is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}); "
                "another account could swap sandboxes for links of its own. Run as its owner, or chown it to "
                f"uid {os.geteuid()} if it is yours",
                path=self.path,
            )

    def _open(self) -> int:
        return _open_dir(self.path)

    # --- the lock ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, wait: float | None = None) -> Iterator[None]:
        """Hold `<root>/.sandkeep.lock` (flock) for the block; wait up to `wait` s (None: forever, 0: once).

        Raises RootRefused(ROOT_LOCKED) naming the holder's pid when the wait runs out. The lock file records
        the holder's pid for that message; the lock itself is the flock, released when the fd closes (also
        when the holder dies), so a stale pid in the file never blocks anyone.
        """
        with _fd(self._open()) as root_fd:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
        try:
            deadline = None if wait is None else time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise self._locked(fd, wait) from None
                    time.sleep(0.05 if deadline is None else min(0.05, max(deadline - time.monotonic(), 0.001)))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    def _locked(self, fd: int, wait: float | None) -> RootRefused:
        try:
            holder = os.pread(fd, 32, 0).decode().strip()
        except OSError:
            holder = ""
        who = f"process {holder}" if holder.isdigit() else "another process"
        waited = f" after waiting {wait:g}s" if wait else ""
        return RootRefused(
            Reason.ROOT_LOCKED,
            f"root {self.path}: {who} holds {LOCK_NAME}{waited}; only one sandkeep process may work on a root at "
            "a time. Wait for it to finish (or stop it), or pass a longer wait",
            path=self.path / LOCK_NAME,
        )

    # --- names -------------------------------------------------------------------------------------

    def sandbox_path(self, namespace: str, name: str) -> Path:
        """`<root>/<ns>/<name>`; ValueError when either is not a Kubernetes name (so never a dot name)."""
        _check_names(namespace, name)
        return self.path / namespace / name

    # --- read --------------------------------------------------------------------------------------

    def read(self, namespace: str, name: str) -> Read:
        """Read one sandbox's manifest (lstat first, never following a link); a foreign manifest is Mismatch."""
        _check_names(namespace, name)
        try:
            with _fd(self._open()) as root_fd, _fd(_open_dir(namespace, root_fd)) as ns_fd:
                result = _read_manifest_at(ns_fd, name)
        except OSError as err:
            code = _errno_of(err)
            if code in TRANSIENT_ERRNOS:
                return Transient(code)
            return Absent(Reason.SYMLINK if code == E.ELOOP else Reason.MANIFEST_ABSENT)
        return _claimed(result, namespace, name)

    def read_many(self, entries: Iterable[Entry]) -> dict[tuple[str, str], Read]:
        """`read` for many sandboxes (a scan's), opening the root and each namespace directory once."""
        by_ns: dict[str, list[str]] = {}
        for e in entries:
            by_ns.setdefault(e.namespace, []).append(e.name)
        out: dict[tuple[str, str], Read] = {}
        with _fd(self._open()) as root_fd:
            for ns, names in by_ns.items():
                try:
                    ns_fd = _open_dir(ns, root_fd)
                except OSError as err:
                    code = _errno_of(err)
                    failed: Read = Transient(code) if code in TRANSIENT_ERRNOS else Absent()
                    out.update({(ns, n): failed for n in names})
                    continue
                with _fd(ns_fd):
                    for name in names:
                        out[(ns, name)] = _claimed(_read_manifest_at(ns_fd, name), ns, name)
        return out

    def read_tombstone(self, t: Tombstone) -> Read:
        """Read the manifest inside a tombstone (it keeps the namespace/name of the sandbox it was)."""
        try:
            with _fd(self._open()) as root_fd:
                return _read_manifest_at(root_fd, t.name)
        except OSError as err:
            code = _errno_of(err)
            return Transient(code) if code in TRANSIENT_ERRNOS else Unreadable(code)

    # --- scan --------------------------------------------------------------------------------------

    def scan(self) -> Scan:
        """One listing of the root and its namespace directories; reads no manifest and follows no link."""
        out = Scan()
        with _fd(self._open()) as root_fd, os.scandir(root_fd) as entries:
            for entry in entries:
                self._scan_root_entry(root_fd, entry, out)
        out.sandboxes.sort(key=lambda e: (e.namespace, e.name))
        out.tombstones.sort(key=lambda t: (t.made_at, t.name))
        return out

    def _scan_root_entry(self, root_fd: int, entry: os.DirEntry[str], out: Scan) -> None:
        name = entry.name
        if name in _PRIVATE or name in _FILESYSTEMS:
            return
        if name.startswith("."):
            t = parse_tombstone(name, self.path)
            if t is not None:
                out.tombstones.append(t)
            else:
                out.strays.append(Stray(name, self.path / name, Reason.BAD_NAME, entry.is_dir(follow_symlinks=False)))
            return
        stray = _stray_reason(entry, is_namespace_name(name))
        if stray is not None:
            out.strays.append(Stray(name, self.path / name, stray, entry.is_dir(follow_symlinks=False)))
            return
        try:
            ns_fd = _open_dir(name, root_fd)
        except OSError:
            return  # gone (or replaced) since the listing: the next scan sees what it is now
        count = 0
        with _fd(ns_fd), os.scandir(ns_fd) as subs:
            for sub in subs:
                count += 1
                rel = f"{name}/{sub.name}"
                reason = _stray_reason(sub, is_object_name(sub.name))
                if reason is not None:
                    is_dir = sub.is_dir(follow_symlinks=False)
                    out.strays.append(Stray(rel, self.path / name / sub.name, reason, is_dir))
                else:
                    out.sandboxes.append(Entry(name, sub.name, self.path / name / sub.name))
        if count == 0:
            out.empty_namespaces.append(name)

    def tombstones(self) -> list[Tombstone]:
        return self.scan().tombstones

    def remove_stray(self, stray: Stray) -> bool:
        """Unlink a non-directory stray (a symlink or a file) without following it; directories are kept."""
        if stray.is_dir:
            return False
        parent, _, base = stray.rel.rpartition("/")
        try:
            with _fd(self._open()) as root_fd:
                if not parent:
                    os.unlink(base, dir_fd=root_fd)
                else:
                    with _fd(_open_dir(parent, root_fd)) as p_fd:
                        os.unlink(base, dir_fd=p_fd)
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            return False
        return True

    def remove_empty_namespace(self, namespace: str) -> bool:
        """rmdir a namespace directory that holds nothing (rmdir never removes anything else)."""
        if not is_namespace_name(namespace):
            return False
        try:
            with _fd(self._open()) as root_fd:
                os.rmdir(namespace, dir_fd=root_fd)
        except OSError:
            return False
        return True

    # --- the root's own files and any entry by its scan name ----------------------------------------

    def read_private(self, name: str) -> bytes | None:
        """One of the root's own files (`.sandkeep-quarantine.json`): None when absent, not a regular file,
        unreadable or larger than MAX_PRIVATE_BYTES (never through a link, never a FIFO)."""
        if name not in _PRIVATE:
            raise ValueError(f"{name!r} is not one of the root's own files")
        try:
            with _fd(self._open()) as root_fd:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root_fd)
            with _fd(fd):
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                data = os.read(fd, MAX_PRIVATE_BYTES + 1)
        except OSError:
            return None
        return data if len(data) <= MAX_PRIVATE_BYTES else None

    def write_private(self, name: str, data: bytes) -> None:
        """Replace one of the root's own files atomically (0600, beside the lock; never through a link)."""
        if name not in _PRIVATE or name in (LOCK_NAME, VOLUMES_DIR):
            raise ValueError(f"{name!r} is not one of the root's own files")
        with _fd(self._open()) as root_fd:
            _write_atomic(root_fd, name, data, mode=0o600)

    def lstat_entry(self, rel: str) -> os.stat_result | None:
        """lstat of a root entry named as a scan names it (`ns` or `ns/name`); None when it is gone."""
        parent, base = _split_rel(rel)
        try:
            with _fd(self._open()) as root_fd, _fd(_open_dir(parent, root_fd) if parent else os.dup(root_fd)) as p_fd:
                return os.lstat(base, dir_fd=p_fd)
        except FileNotFoundError:
            return None

    def tombstone_entry(self, rel: str, ident: tuple[int, int], *, id: str, now: datetime) -> Tombstone:
        """Rename the root entry `rel` (`ns` or `ns/name`, as a scan names it) to a tombstone, as a name.

        A link or a file is renamed itself, never followed. Only the inode `ident` (st_dev, st_ino) is
        renamed: checked before the rename and on the tombstone after it, and one swapped in between is
        put back. Raises StoreError: MANIFEST_CHANGED when the entry is another one, else RENAME_FAILED.
        """
        parent, base = _split_rel(rel)
        tname = tombstone_name(id, now)
        where = self.path / rel
        try:
            with _fd(self._open()) as root_fd, _fd(_open_dir(parent, root_fd) if parent else os.dup(root_fd)) as p_fd:
                if _ident(os.lstat(base, dir_fd=p_fd)) != ident:
                    raise StoreError(Reason.MANIFEST_CHANGED, f"{where}: replaced since it was decided on", path=where)
                _rename_noreplace(p_fd, base, root_fd, tname)
                if _ident(os.lstat(tname, dir_fd=root_fd)) != ident:
                    with contextlib.suppress(OSError):
                        _rename_noreplace(root_fd, tname, p_fd, base)
                    raise StoreError(Reason.MANIFEST_CHANGED, f"{where}: swapped during the rename", path=where)
                os.fsync(root_fd)
        except OSError as err:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"{where}: could not rename it to tombstone {tname} ({os.strerror(_errno_of(err))}); "
                "it stays under its own name and is retried next pass",
                errno=_errno_of(err),
                path=where,
            ) from err
        parsed = parse_tombstone(tname, self.path)
        assert parsed is not None
        return parsed

    # --- tombstones --------------------------------------------------------------------------------

    def tombstone(self, namespace: str, name: str, *, id: str, now: datetime) -> Tombstone:
        """Rename `<root>/<ns>/<name>` to `<root>/.reap-<id>-<ms>` in one rename (never onto an existing name).

        From the rename on, every open, pin and read of the sandbox finds nothing, which is the truth; the
        slow delete then works on the tombstone. Raises StoreError(RENAME_FAILED) with the errno.
        """
        _check_names(namespace, name)
        tname = tombstone_name(id, now)
        try:
            with _fd(self._open()) as root_fd, _fd(_open_dir(namespace, root_fd)) as ns_fd:
                st = os.lstat(name, dir_fd=ns_fd)
                if not stat.S_ISDIR(st.st_mode):
                    raise StoreError(
                        Reason.RENAME_FAILED,
                        f"sandbox {namespace}/{name}: refused to tombstone it, it is not a directory",
                        errno=E.ENOTDIR,
                        path=self.path / namespace / name,
                    )
                _rename_noreplace(ns_fd, name, root_fd, tname)
                os.fsync(root_fd)
        except OSError as err:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"sandbox {namespace}/{name}: could not rename it to tombstone {tname} "
                f"({os.strerror(_errno_of(err))}); it stays under its own name and is retried next pass",
                errno=_errno_of(err),
                path=self.path / namespace / name,
            ) from err
        parsed = parse_tombstone(tname, self.path)
        assert parsed is not None
        return parsed

    def restore(self, t: Tombstone, namespace: str, name: str) -> bool:
        """Put a tombstone back under `<ns>/<name>`. Only a free name or an EMPTY directory is displaced.

        rename(2) of a directory replaces an empty directory atomically and fails on anything else (a file,
        a link, a non-empty directory), which is exactly the rule: nothing but an empty directory is lost.
        """
        _check_names(namespace, name)
        try:
            with _fd(self._open()) as root_fd:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(namespace, 0o700, dir_fd=root_fd)
                with _fd(_open_dir(namespace, root_fd)) as ns_fd:
                    os.rename(t.name, name, src_dir_fd=root_fd, dst_dir_fd=ns_fd)
                    os.fsync(ns_fd)
        except OSError:
            return False
        return True

    def delete_tombstone(self, t: Tombstone) -> fsdelete.DeleteResult:
        """Delete a tombstone's tree safely (fsdelete: never follows a link, never crosses a mount)."""
        return fsdelete.delete_tree(self.path, t.name)

    # --- pin ---------------------------------------------------------------------------------------

    def pin(self, namespace: str, name: str, until: datetime | None, *, now: datetime) -> Manifest:
        """Set (or with `until=None` remove) a standalone pin: `keepUntil` + `pinnedAt`, rewritten atomically.

        The rewrite keeps every key already in the manifest and the file's owner and mode, so a pin taken by
        root leaves a manifest the sweeping uid can still read. Raises StoreError when there is no readable
        manifest of this sandbox to pin.
        """
        _check_names(namespace, name)
        where = self.path / namespace / name / MANIFEST_NAME
        try:
            with (
                _fd(self._open()) as root_fd,
                _fd(_open_dir(namespace, root_fd)) as ns_fd,
                _fd(_open_dir(name, ns_fd)) as dir_fd,
            ):
                # Read and rewrite through ONE directory fd: a retry that replaces the sandbox in between
                # never gets the old run's manifest written over its own.
                read = _claimed(_read_manifest_in(dir_fd), namespace, name)
                if not isinstance(read, Present):
                    raise StoreError(
                        read.reason,
                        f"sandbox {namespace}/{name}: cannot pin it, its manifest is {type(read).__name__.lower()} "
                        f"({read.reason}); check `sandkeep ls` for what is there",
                        errno=getattr(read, "errno", None),
                        path=where,
                    )
                body = json.loads(read.text)
                if until is None:
                    body["keepUntil"], body["pinnedAt"] = None, None
                else:
                    body["keepUntil"], body["pinnedAt"] = format_instant(until), format_instant(now)
                data = (json.dumps(body, indent=2) + "\n").encode()
                st = os.stat(MANIFEST_NAME, dir_fd=dir_fd, follow_symlinks=False)
                _write_atomic(dir_fd, MANIFEST_NAME, data, mode=stat.S_IMODE(st.st_mode), owner=(st.st_uid, st.st_gid))
        except OSError as err:
            code = _errno_of(err)
            raise StoreError(
                Reason.MANIFEST_ABSENT if code in (E.ENOENT, E.ELOOP, E.ENOTDIR) else Reason.MANIFEST_UNREADABLE,
                f"sandbox {namespace}/{name}: cannot pin it ({os.strerror(code)}); nothing was changed. "
                "Check `sandkeep ls` for what is there",
                errno=code,
                path=where,
            ) from err
        return Manifest.model_validate(body)

    # --- retain ------------------------------------------------------------------------------------

    def retain(
        self,
        source: Path,
        namespace: str,
        name: str,
        *,
        job_id: str,
        created_at: datetime,
        retention: timedelta | None,
        node: str | None = None,
        exclude: Sequence[str] = (),
        now: datetime | None = None,
        replace: Replace | None = None,
        origin: Origin | None = None,
    ) -> Manifest:
        """Move a finished job directory into `<root>/<ns>/<name>/workspace` by rename and write its manifest.

        The sandbox is built complete (workspace + manifest) in a tombstone-named staging directory of the root
        and then renamed into place, so no reader ever sees a sandbox without its manifest, and a crash leaves
        a plain leftover tombstone the next sweep clears. A previous attempt at the same name is replaced (last
        attempt wins) only as a deletion would delete it: never a pinned one (StoreError PINNED, refused before
        anything is done to the source), and only through `replace(ns, name, read)`, the caller's deletion
        pipeline (root lock, recorded orphans reaped, in-use check, tombstone), which frees the name or says
        why not (a `Refusal`, raised as StoreError with its reason: InUse, OrphanSurvivor, RootLocked...).
        Without `replace` a taken name is refused (StoreError RenameFailed, EEXIST). `origin` goes into the
        manifest (`retain --outcome` records the outcome there, as a capture does). Exclude globs are removed
        before the staging. On any failure nothing is left in the root and the source is where it was (minus
        excluded files).
        """
        _check_names(namespace, name)
        if not MIN_INSTANT <= created_at <= MAX_INSTANT:
            raise ValueError(
                f"createdAt {created_at.isoformat()} is out of range; sandkeep takes times from "
                f"{MIN_INSTANT.year} to {MAX_INSTANT.year} (give the job's real start time)"
            )
        now = now or datetime.now(UTC)
        src = Path(os.path.abspath(source))  # noqa: PTH100 (lexical; then opened with no link in any component)
        with self._open_source(src) as held:
            self._refuse_pinned(self.read(namespace, name), namespace, name, now)
            if exclude:
                _remove_excluded(held, exclude)
            return self._retain_held(held, namespace, name, job_id, created_at, retention, node, now, replace, origin)

    def retain_volume(
        self,
        entry: str,
        namespace: str,
        name: str,
        *,
        job_id: str,
        created_at: datetime,
        retention: timedelta | None,
        node: str | None,
        origin: Origin,
        now: datetime,
    ) -> Manifest:
        """`retain` of a captured volume's workspace, `<root>/.sandkeep-volumes/<entry>/workspace` (node/capture.py),
        with its origin in the manifest: the one source inside the root a retain takes. A taken name is never
        replaced (StoreError PINNED, or RENAME_FAILED with errno EEXIST): the caller keeps it under another name."""
        if not entry or entry.startswith(".") or "/" in entry or "\0" in entry:
            raise ValueError(f"{entry!r} is not an entry of {VOLUMES_DIR}")
        _check_names(namespace, name)
        src = self.path / VOLUMES_DIR / entry / WORKSPACE_DIR
        with self._open_source(src, volume=True) as held:
            return self._retain_held(held, namespace, name, job_id, created_at, retention, node, now, None, origin)

    def _retain_held(
        self,
        held: _Source,
        namespace: str,
        name: str,
        job_id: str,
        created_at: datetime,
        retention: timedelta | None,
        node: str | None,
        now: datetime,
        replace: Replace | None,
        origin: Origin | None = None,
    ) -> Manifest:
        src = held.path
        manifest = Manifest.model_validate(
            {
                "namespace": namespace,
                "name": name,
                "jobId": job_id,
                "createdAt": _instant_ms(created_at),
                "retainUntil": None if retention is None else _instant_ms(shift(created_at, retention)),
                "keepUntil": None,
                "pinnedAt": None,
                "node": node,
                "workspace": WORKSPACE_DIR,
                "origin": origin,
            }
        )
        with _fd(self._open()) as root_fd:
            stage = tombstone_name(f"{standalone_id()}-{_STAGE_SUFFIX}"[:64], now)
            os.mkdir(stage, 0o700, dir_fd=root_fd)
            try:
                self._fill_stage(root_fd, stage, held, manifest)
                self._place(root_fd, stage, namespace, name, now, replace)
            except BaseException as err:
                self._undo_stage(root_fd, stage, held)
                if isinstance(err, OSError):
                    raise StoreError(
                        Reason.RENAME_FAILED,
                        f"sandbox {namespace}/{name}: could not retain {src} ({os.strerror(_errno_of(err))} at "
                        f"{err.filename or self.path}); nothing was retained and the source is where it was",
                        errno=_errno_of(err),
                        path=self.path / namespace / name,
                    ) from err
                raise
        return manifest

    @contextlib.contextmanager
    def _open_source(self, src: Path, *, volume: bool = False) -> Iterator[_Source]:
        """Hold the source: its parent opened with no link in ANY component, itself opened O_NOFOLLOW from it.

        Everything after (exclude globs, the rename into the root, the undo) goes through these fds, so a
        user who owns a directory on the way and swaps a component for a link cannot aim root's retain at
        another directory: a link anywhere is refused, and the rename is checked to have moved this inode.
        """
        try:
            parent_fd = fsdelete.open_no_symlinks(src.parent)
        except OSError as err:
            code = _errno_of(err)
            link = _symlink_on(src.parent) if code in (E.ELOOP, E.ENOTDIR) else None
            symlink = link is not None
            why = f"{link} on its path is a symlink, and sandkeep never follows one; pass the real path"
            raise StoreError(
                Reason.SYMLINK if symlink else Reason.MANIFEST_ABSENT,
                f"source {src}: cannot retain it ({why if symlink else os.strerror(code)}); "
                + ("nothing was retained" if symlink else "pass the finished job's directory"),
                errno=code,
                path=src,
            ) from err
        try:
            try:
                st = os.stat(src.name, dir_fd=parent_fd, follow_symlinks=False)
                fd = _open_dir(src.name, parent_fd) if stat.S_ISDIR(st.st_mode) else -1
            except OSError as err:
                raise StoreError(
                    Reason.SYMLINK if err.errno == E.ELOOP else Reason.MANIFEST_ABSENT,
                    f"source {src}: cannot retain it ({os.strerror(_errno_of(err))}); pass the finished job's "
                    "directory",
                    errno=_errno_of(err),
                    path=src,
                ) from err
            if fd < 0:
                reason = Reason.SYMLINK if stat.S_ISLNK(st.st_mode) else Reason.NOT_A_DIRECTORY
                raise StoreError(
                    reason,
                    f"source {src}: refused, it is {'a symlink' if reason is Reason.SYMLINK else 'not a directory'}; "
                    "pass the job's directory itself",
                    path=src,
                )
            with _fd(fd):
                held = _Source(src, parent_fd, src.name, fd, (st.st_dev, st.st_ino))
                self._check_source(held, volume)
                yield held
        finally:
            os.close(parent_fd)

    def _check_source(self, held: _Source, volume: bool = False) -> None:
        src = held.path
        st = os.fstat(held.fd)
        root = self.path.stat()
        if (st.st_dev, st.st_ino) != held.ident:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"source {src}: it was replaced while being opened; nothing was retained, retain it again",
                path=src,
            )
        # The path has no link in it (open_no_symlinks), so the lexical comparison is the real one.
        inside = src == self.path or self.path in src.parents or src in self.path.parents
        if inside and not (volume and src.parent.parent == self.path / VOLUMES_DIR):
            raise StoreError(
                Reason.PATH_OUTSIDE_ROOT,
                f"source {src}: refused, it is the root {self.path}, inside it or above it; "
                "pass a finished job's directory outside the root",
                path=src,
            )
        if st.st_dev != root.st_dev:
            raise StoreError(
                Reason.CROSS_DEVICE,
                f"source {src}: refused, it is on another filesystem than the root {self.path}, and sandkeep "
                "retains by rename, never by copy; put job directories on the root's filesystem",
                errno=E.EXDEV,
                path=src,
            )

    def _fill_stage(self, root_fd: int, stage: str, held: _Source, manifest: Manifest) -> None:
        src = held.path
        with _fd(_open_dir(stage, root_fd)) as stage_fd:
            try:
                _rename_noreplace(held.parent_fd, held.name, stage_fd, WORKSPACE_DIR)
            except OSError as err:
                code = _errno_of(err)
                raise StoreError(
                    Reason.CROSS_DEVICE if code == E.EXDEV else Reason.RENAME_FAILED,
                    f"source {src}: could not move it into the root {self.path} ({os.strerror(code)}); "
                    + (
                        "sandkeep retains by rename, never by copy: put job directories on the root's filesystem"
                        if code == E.EXDEV
                        else "nothing was retained; fix the cause and retain again"
                    ),
                    errno=code,
                    path=src,
                ) from err
            moved = os.stat(WORKSPACE_DIR, dir_fd=stage_fd, follow_symlinks=False)
            if (moved.st_dev, moved.st_ino) != held.ident:
                raise StoreError(  # swapped between the open and the rename: _undo_stage puts it back
                    Reason.RENAME_FAILED,
                    f"source {src}: it was replaced while being retained; nothing was retained, retain it again",
                    path=src,
                )
            os.mkdir(COMMANDS_DIR, 0o700, dir_fd=stage_fd)
            _write_atomic(stage_fd, MANIFEST_NAME, manifest.to_json().encode(), mode=0o600)

    def _place(
        self, root_fd: int, stage: str, namespace: str, name: str, now: datetime, replace: Replace | None
    ) -> None:
        """Rename the staged sandbox to `<ns>/<name>`, tombstoning (and deleting) a previous attempt first."""
        for _ in range(8):
            with contextlib.suppress(FileExistsError):
                os.mkdir(namespace, 0o700, dir_fd=root_fd)
            try:
                with _fd(_open_dir(namespace, root_fd)) as ns_fd:
                    # never onto anything, not even an empty directory (someone's cwd): a taken name is replaced
                    # only by _replace_previous, which keeps a deletion's rules
                    _rename_noreplace(root_fd, stage, ns_fd, name)
                    os.fsync(ns_fd)
                    return
            except FileNotFoundError:
                continue  # the namespace directory was removed as empty meanwhile: make it again
            except OSError as err:
                if err.errno not in (E.ENOTEMPTY, E.EEXIST, E.ENOTDIR, E.EISDIR):
                    raise
            self._replace_previous(namespace, name, now, replace)
        raise StoreError(
            Reason.RENAME_FAILED,
            f"sandbox {namespace}/{name}: the name kept being taken while retaining; nothing was retained",
            path=self.path / namespace / name,
        )

    def _replace_previous(self, namespace: str, name: str, now: datetime, replace: Replace | None) -> None:
        """Free the name for the staged sandbox: a replacement is a deletion, so it keeps a deletion's rules.

        A link or a file at the name is unlinked (never followed; it is no sandbox). A directory with a live
        pin is never replaced, and any other goes only through `replace`, the caller's deletion pipeline
        (root lock, orphans, in-use, tombstone), which frees the name or refuses; without it, nothing is.
        """
        where = self.path / namespace / name
        with _fd(self._open()) as root_fd, _fd(_open_dir(namespace, root_fd)) as ns_fd:
            try:
                st = os.lstat(name, dir_fd=ns_fd)
            except FileNotFoundError:
                return
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=ns_fd)
                return
        read = self.read(namespace, name)
        self._refuse_pinned(read, namespace, name, now)
        if replace is None:
            raise StoreError(
                Reason.RENAME_FAILED,
                f"sandbox {namespace}/{name}: refused to replace it, replacing a sandbox deletes it and this caller "
                "has no deletion pipeline to do that; nothing was retained and the source is where it was",
                errno=E.EEXIST,
                path=where,
            )
        refused = replace(namespace, name, read)
        if refused is not None:
            raise StoreError(
                refused.reason,
                f"sandbox {namespace}/{name}: refused to replace it ({refused.why}); nothing was retained and the "
                f"source is where it was. {refused.next}",
                path=where,
            )

    def _refuse_pinned(self, read: Read, namespace: str, name: str, now: datetime) -> None:
        """A previous sandbox with a live pin is never replaced: StoreError PINNED."""
        pinned = _live_pin(read.manifest, now) if isinstance(read, Present) else None
        if pinned is not None:
            raise StoreError(
                Reason.PINNED,
                f"sandbox {namespace}/{name}: refused to replace it, it is pinned until {format_instant(pinned)} "
                "and a pinned sandbox is never deleted; nothing was retained and the source is where it was. "
                "Unpin it (`sandkeep pin --clear`) or retain under another name",
                path=self.path / namespace / name,
            )

    def _undo_stage(self, root_fd: int, stage: str, held: _Source) -> None:
        """Put the source back where it was (renameat between held fds, never onto anything) and remove the stage."""
        with contextlib.suppress(OSError), _fd(_open_dir(stage, root_fd)) as stage_fd:
            _rename_noreplace(stage_fd, WORKSPACE_DIR, held.parent_fd, held.name)
        fsdelete.delete_tree(self.path, stage)

    # --- size --------------------------------------------------------------------------------------

    def size(self, namespace: str, name: str) -> int:
        """Bytes on disk under a sandbox (allocated blocks), walked fd-relative without following links."""
        return self.usage(namespace, name).bytes

    def usage(self, namespace: str, name: str, budget: float | None = None) -> treesize.TreeSize:
        """(allocated bytes, files, complete) under a sandbox: `treesize.tree_size`, linear time and bounded
        memory on any tree; past `budget` seconds, what was counted so far (`complete=False`)."""
        _check_names(namespace, name)
        try:
            with _fd(self._open()) as root_fd, _fd(_open_dir(namespace, root_fd)) as ns_fd:
                return treesize.tree_size(ns_fd, name, budget=budget)
        except OSError:
            return treesize.TreeSize(0, 0)


def _instant_ms(when: datetime) -> str:
    """RFC 3339 UTC with milliseconds: two retentions of one job a moment apart never write the same bytes."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _live_pin(manifest: Manifest, now: datetime) -> datetime | None:
    """The manifest's standalone pin when it is valid and not yet lapsed."""
    until = instant_or_none(manifest.keep_until)
    return until if until is not None and until > now else None


def _symlink_on(path: Path) -> Path | None:
    """The first component of `path` that is a symlink (lstat of each prefix): for a refusal's message only."""
    for prefix in (*reversed(path.parents), path):
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(prefix).st_mode):
                return prefix
    return None


def _remove_excluded(held: _Source, patterns: Sequence[str]) -> None:
    """Delete what the exclude globs match under the held source (e.g. transcripts) before anything is retained.

    Walks from the source's fd (fsdelete.walk_entries: never a link, never a mount, memory a constant per
    level); a matched directory is deleted whole with the safe delete. A tree deeper than the walk keeps
    open is refused whole rather than retained with an exclusion missed.
    """
    by_path = any("/" in p for p in patterns)
    try:
        for found in fsdelete.walk_entries(held.fd, _EXCLUDE_MAX_DEPTH):
            rel = found.rel() if by_path else found.name
            if not _relpath_matches(rel, found.name, patterns):
                continue
            rel = found.rel()
            if found.is_dir:
                result = fsdelete.delete_tree_at(found.dir_fd, found.name, f"{held.path}/{rel.rpartition('/')[0]}")
                if not result.ok:
                    raise StoreError(
                        Reason.DELETE_FAILED,
                        f"source {held.path}: could not remove excluded {rel} ({result.describe()}); "
                        "nothing was retained",
                        errno=result.errno,
                        path=held.path / rel,
                    )
            else:
                os.unlink(found.name, dir_fd=found.dir_fd)
    except fsdelete.TooDeep as err:
        raise StoreError(
            Reason.DELETE_FAILED,
            f"source {held.path}: refused, it is {err} below it, too deep to apply --exclude to it all; "
            "nothing was retained. Retain it without --exclude, or remove the excluded files first",
            path=held.path,
        ) from err


def _ident(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _split_rel(rel: str) -> tuple[str | None, str]:
    """(namespace directory or None, entry name) of a root entry as a scan names it; ValueError otherwise.

    Never one of the root's own files, never a tombstone, never `.`/`..`: only what a scan can report.
    """
    parts = rel.split("/")
    bad = (
        len(parts) > 2
        or any(not p or p in (".", "..") or "\0" in p for p in parts)
        or (len(parts) == 2 and not is_namespace_name(parts[0]))
        or (len(parts) == 1 and (rel in _PRIVATE | _FILESYSTEMS or parse_tombstone(rel) is not None))
    )
    if bad:
        raise ValueError(f"{rel!r} is not a root entry a scan reports")
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def _stray_reason(entry: os.DirEntry[str], good_name: bool) -> Reason | None:
    if entry.is_symlink():
        return Reason.SYMLINK
    if not entry.is_dir(follow_symlinks=False):
        return Reason.NOT_A_DIRECTORY
    if not good_name:
        return Reason.BAD_NAME
    return None


# The primitives node/capture.py builds its volume entries with, so both write the root one way.
write_atomic = _write_atomic
rename_noreplace = _rename_noreplace
owned_fd = _fd
errno_of = _errno_of
ident = _ident


def manifest_in(dir_fd: int, namespace: str, name: str) -> Read:
    """The manifest of the open sandbox directory `dir_fd`, Present only when it names namespace/name."""
    return _claimed(_read_manifest_in(dir_fd), namespace, name)
