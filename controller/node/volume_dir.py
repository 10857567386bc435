"""The captured volumes' directory on the node (issue 27): its layout, records, locks and mount checks, shared by
the node service's side (volume_publish.py) and the agent's (volume_keep.py). `capture.Volumes` is both.

See capture.py for the layout and the story; this module holds what both sides read and lock:
- `Record` (record.json) and `State`, read and written atomically (`VolumeDir._read`, `_write`);
- the entry locks: a thread lock per stripe, shared by every `Volumes` of the same directory in the process, and
  a byte of `.lock` (fcntl) between the node service and the agent, which are separate processes;
- the reopen marks: 8 bytes of `.lock` per sandbox slot, bumped under the slot's lock when a reopen is
  recorded, read by the agent before its in-use look and at its rename (`seen`, `unchanged`);
- whether a target is mounted (the mount table, or the target's mount id against its parent's).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as E
import fcntl
import hashlib
import json
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.node import fsdelete, nofollow
from controller.node.store import (
    Root,
    rename_noreplace,
    standalone_id,
    tombstone_name,
    write_atomic,
)
from controller.node.store import errno_of as _errno_of
from controller.node.store import owned_fd as _fd
from controller.rules.contracts import VOLUMES_DIR, WORKSPACE_DIR, Keep
from controller.rules.durations import instant_or_none
from controller.rules.models import NamespaceName, ObjectName, Origin, is_namespace_name, is_object_name
from controller.rules.volume import VolumeError, VolumeRequest

RECORD_NAME = "record.json"
VOLUME_ID_MAX = 1024  # bytes of a volume id (the kubelet's are `csi-<sha256>`, 68)
PATH_MAX = 4096
MAX_RECORD_BYTES = 64 * 1024  # a record is well under 2 KiB; anything this large is not ours
_STRIPES = 64  # locks shared by all entries: bounded, and two entries rarely wait on each other
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_UMOUNT_NOFOLLOW = 0x8
_libc = ctypes.CDLL(None, use_errno=True)


class State(StrEnum):
    PUBLISHED = "published"  # the workspace is (or is being) mounted at the target
    UNPUBLISHED = "unpublished"  # unmounted by the kubelet: the next pass decides
    KEEPING = "keeping"  # decided to keep: being moved into a sandbox (a crash here is finished by `keep`)
    KEPT = "kept"  # moved: only the entry itself is left to remove


class Record(BaseModel):
    """`record.json`: the publish as the kubelet asked for it, where it is in its life, and the decision."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    volume_id: str = Field(alias="volumeId", min_length=1, max_length=VOLUME_ID_MAX)
    target_path: str = Field(alias="targetPath", min_length=1, max_length=PATH_MAX)
    pod_namespace: NamespaceName = Field(alias="podNamespace")
    pod_name: ObjectName = Field(alias="podName")
    pod_uid: str = Field(alias="podUID", max_length=128)
    service_account: str = Field("", alias="serviceAccount", max_length=253)
    keep: Keep = Keep.ALWAYS
    name: str | None = None
    retention_seconds: Annotated[int, Field(ge=0)] | None = Field(None, alias="retentionSeconds")
    read_only: bool = Field(False, alias="readOnly")
    mount_group: int | None = Field(None, alias="mountGroup")
    workspace: tuple[int, int]  # (st_dev, st_ino) of workspace/: how a mount, or a kept sandbox, is known as ours
    published_at: str = Field(alias="publishedAt")
    unpublished_at: str | None = Field(None, alias="unpublishedAt")
    state: State
    decided_at: str | None = Field(None, alias="decidedAt")
    why: str | None = Field(None, max_length=1024)  # the decision in words, once keeping
    origin: Origin | None = None  # once keeping: the manifest's
    kept_as: str | None = Field(None, alias="keptAs")  # `<namespace>/<name>`, once kept
    sandbox: ObjectName | None = None  # a reopen of <podNamespace>/<sandbox>: never kept nor discarded

    def to_json(self) -> bytes:
        return (self.model_dump_json(by_alias=True, indent=2, exclude_none=True) + "\n").encode()

    def ended_at(self) -> datetime | None:
        """When its Pod's end was first seen: the unpublish, else the decision (a volume never unpublished)."""
        return instant_or_none(self.unpublished_at) or instant_or_none(self.decided_at)


@dataclass(frozen=True)
class Volume:
    """One entry of the volumes directory: its record, or None with why (then `changed` dates the entry)."""

    entry: str
    record: Record | None
    why: str = ""
    changed: datetime | None = None


@dataclass(frozen=True)
class Kept:
    namespace: str
    name: str
    recovered: bool = False  # placed by an earlier, interrupted keep; this one only finished it


@dataclass(frozen=True)
class Busy:
    """Its target is still mounted: in use, never kept or discarded."""

    target: str


@dataclass(frozen=True)
class Lost:
    """Neither in its entry, nor in a sandbox, nor in a staging directory: removed by hand."""

    why: str


KeepResult = Kept | Busy | Lost | None  # None: no such entry (already done)


def entry_name(volume_id: str) -> str:
    """A volume's entry name: 32 hex of sha256 of its id (bounded and safe whatever the id; 128 bits)."""
    return hashlib.sha256(volume_id.encode(errors="surrogateescape")).hexdigest()[:32]


_ALL_LOCKS: dict[Path, tuple[threading.Lock, ...]] = {}
_ALL_LOCKS_LOCK = threading.Lock()
LOCK_FILE = ".lock"  # in the volumes directory: byte n is stripe n's lock between processes (fcntl)


def _locks_of(path: Path) -> tuple[threading.Lock, ...]:
    """One set of entry locks per volumes directory in this process, however many `Volumes` are made over it
    (the node service's and the agent's pass may each hold one): a pass never acts on a publish in progress."""
    with _ALL_LOCKS_LOCK:
        return _ALL_LOCKS.setdefault(path, tuple(threading.Lock() for _ in range(_STRIPES)))


# A sandbox's reopen mark: 8 bytes of the lock file per slot (a hash of its namespace/name), after the stripes'
# bytes. csi-node adds one to it, under the slot's lock, for each reopen it records; the agent reads it before
# its in-use look and again, under the lock, at the rename (`seen`, `unchanged`). A shared slot only holds more.
_SLOTS = 4096
_SLOT_BASE = 4096
MARK_BYTES = 8

_LOCK_FDS: dict[Path, int] = {}  # one open lock file per volumes directory for the process's life: fcntl locks
# are the process's and closing any fd of the file drops them all, so it is never closed


def lock_fd(vols: Path) -> int:
    with _ALL_LOCKS_LOCK:
        if vols not in _LOCK_FDS:
            _LOCK_FDS[vols] = os.open(vols / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return _LOCK_FDS[vols]


def mount_syscall(source: str | None, target: str, flags: int) -> None:
    src = None if source is None else os.fsencode(source)
    if _libc.mount(src, os.fsencode(target), None, ctypes.c_ulong(flags), None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount: {os.strerror(code)}", target)


def umount_syscall(target: str) -> None:
    if _libc.umount2(os.fsencode(target), _UMOUNT_NOFOLLOW) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"umount: {os.strerror(code)}", target)


def mount_points(mountinfo: Path) -> Iterator[str]:
    """Every mount point of this mount namespace, read line by line (a node with many Pods has thousands)."""
    with mountinfo.open("rb") as lines:
        for line in lines:
            parts = line.split(b" ", 5)
            if len(parts) > 4:
                yield nofollow.unescape_mountinfo(os.fsdecode(parts[4]))


def split_target(path: str) -> tuple[str, str, str]:
    """The target's parent resolved as the kernel resolves it, its own name (never followed), and the two
    joined: the path mountinfo shows for a mount there."""
    parent, _, leaf = path.rstrip("/").rpartition("/")
    real = os.path.realpath(parent or "/")
    return real, leaf, str(Path(real) / leaf)


def check_request(req: VolumeRequest) -> None:
    """What `publish` refuses before anything is made (INVALID_ARGUMENT): the node service checked it all
    already (rules/volume.py); this is the last line, so no request can aim a mount outside what it names."""
    t = req.target_path
    problems = [
        (not req.volume_id or len(req.volume_id.encode(errors="surrogateescape")) > VOLUME_ID_MAX, "volume id"),
        ("\0" in req.volume_id, "volume id"),
        (not t.startswith("/") or len(t) > PATH_MAX or "\0" in t or ".." in t.split("/"), "target path"),
        (t.rstrip("/") in ("", "/"), "target path"),
        (not is_namespace_name(req.pod_namespace), "Pod namespace"),
        (not is_object_name(req.pod_name), "Pod name"),
        (not req.pod_uid or len(req.pod_uid) > 128, "Pod uid"),
        (req.sandbox is not None and not is_object_name(req.sandbox), "sandbox name"),
    ]
    for bad, what in problems:
        if bad:
            raise VolumeError("INVALID_ARGUMENT", f"volume {req.volume_id[:128]!r}: the {what} is not usable")


class VolumeDir:
    """The captured volumes' directory of one root: records, locks and mount checks (both sides build on it)."""

    def __init__(
        self,
        root: Root,
        *,
        mountinfo: Path = Path("/proc/self/mountinfo"),
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.root = root
        self.path = root.path / VOLUMES_DIR
        self.mountinfo = mountinfo
        self.clock = clock
        self._locks = _locks_of(self.path)

    @contextlib.contextmanager
    def _lock(self, entry: str) -> Iterator[None]:
        """The entry's lock, against this process's threads and the other process (csi-node or the agent)."""
        stripe = int(entry[:8], 16) % _STRIPES
        with self._locks[stripe], self._volumes(create=True):
            fd = lock_fd(self.path)
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, stripe)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, stripe)

    @contextlib.contextmanager
    def _volumes(self, *, create: bool) -> Iterator[int | None]:
        """The volumes directory, open (made 0700 on first use); None when there is none yet."""
        with _fd(os.open(self.root.path, O_DIR)) as root_fd:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(VOLUMES_DIR, 0o700, dir_fd=root_fd)
            try:
                fd = os.open(VOLUMES_DIR, O_DIR, dir_fd=root_fd)
            except FileNotFoundError:
                fd = None
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @contextlib.contextmanager
    def _slot(self, key: tuple[str, str], op: int) -> Iterator[int]:
        """The lock file, with the sandbox's slot locked (`op`: LOCK_SH or LOCK_EX); yields the slot's offset."""
        with self._volumes(create=True), self._locked(key, op) as offset:
            yield offset

    @contextlib.contextmanager
    def _locked(self, key: tuple[str, str], op: int) -> Iterator[int]:
        """The slot locked, the volumes directory (and so the lock file) known to exist; yields its offset."""
        digest = hashlib.sha256("/".join(key).encode(errors="surrogateescape")).digest()
        offset = _SLOT_BASE + int.from_bytes(digest[:4]) % _SLOTS * MARK_BYTES
        fd = lock_fd(self.path)
        fcntl.lockf(fd, op, MARK_BYTES, offset)
        try:
            yield offset
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, MARK_BYTES, offset)

    def _mark(self, offset: int) -> int:
        return int.from_bytes(os.pread(lock_fd(self.path), MARK_BYTES, offset).ljust(MARK_BYTES, b"\0"))

    def _bump(self, offset: int) -> None:
        """Add one to the slot's mark (under its exclusive lock): a reopen was recorded."""
        os.pwrite(lock_fd(self.path), ((self._mark(offset) + 1) % 2**64).to_bytes(MARK_BYTES), offset)

    def seen(self, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Each sandbox's reopen mark now (the agent reads it before its in-use look); the directory is made
        once for all of them, on the reaper's path of a whole wave."""
        out = {}
        with self._volumes(create=True):
            for key in keys:
                with self._locked(key, fcntl.LOCK_SH) as offset:
                    out[key] = self._mark(offset)
        return out

    @contextlib.contextmanager
    def unchanged(self, key: tuple[str, str], seen: int) -> Iterator[bool]:
        """Held across the agent's rename of the sandbox: whether no reopen was recorded since `seen` was read.
        csi-node records a reopen under the same lock, so it lands before (and shows here) or after (and finds
        the sandbox renamed away)."""
        with self._slot(key, fcntl.LOCK_EX) as offset:
            yield self._mark(offset) == seen

    def records(self) -> Iterator[Volume]:
        """Every entry and its record, one at a time (memory: one record, whatever the number of volumes)."""
        with self._volumes(create=False) as vols_fd:
            if vols_fd is None:
                return
            yield from self._each(vols_fd)

    def _each(self, vols_fd: int) -> Iterator[Volume]:
        with os.scandir(vols_fd) as entries:
            for e in entries:
                if e.name.startswith("."):
                    continue
                volume = self._read(vols_fd, e.name)
                if volume is not None:
                    yield volume

    def mounted(self, record: Record, points: Collection[str] | None = None) -> bool:
        """Whether anything is mounted at the record's target: it is in use, never kept or discarded.
        `points`: this namespace's mount points read once for many records (`mount_points`)."""
        target = split_target(record.target_path)[2]
        return target in points if points is not None else self._is_mount_point(target)

    def mount_points(self) -> frozenset[str]:
        return frozenset(mount_points(self.mountinfo))

    def _is_mount_point(self, path: str) -> bool:
        return any(point == path for point in mount_points(self.mountinfo))

    def _mounted_on(self, target_fd: int, parent_fd: int, target: str) -> bool:
        """Whether the target (`target_fd`, opened from `parent_fd`) is a mount's root: its mount id against its
        parent's, one statx each. Not the mount table: its read costs 3.5 ms of CPU at 1,000 mounts, and 50
        publishes at once beside 1,000 other mounts took p99 0.95 s with it, 0.15-0.17 s without (hack/bench/csi.py)."""
        mine, parents = nofollow.mount_id(target_fd), nofollow.mount_id(parent_fd)
        if mine is None or parents is None:  # a kernel that tells no mount id (before 3.15)
            return self._is_mount_point(target)
        return mine != parents

    def _mounted_at(self, parent_fd: int, leaf: str, target: str) -> bool:
        try:
            target_fd = os.open(leaf, O_PATH_DIR, dir_fd=parent_fd)
        except OSError as err:
            if err.errno in (E.ENOENT, E.ELOOP, E.ENOTDIR):  # nothing there, or a link: nothing is mounted on it
                return False
            return self._is_mount_point(target)
        with _fd(target_fd):
            return self._mounted_on(target_fd, parent_fd, target)

    def workspace_empty(self, entry: str) -> bool | None:
        """Whether an entry's workspace holds nothing (None: it has none, or it cannot be read)."""
        try:
            with _fd(os.open(self.path / entry / WORKSPACE_DIR, O_DIR)) as ws, os.scandir(ws) as it:
                return next(it, None) is None
        except OSError:
            return None

    @staticmethod
    def _forget(vols_fd: int, entry: str) -> None:
        """Remove a reopen's entry (its record alone: the workspace it mounted is the sandbox's, never here)."""
        with _fd(os.open(entry, O_DIR, dir_fd=vols_fd)) as entry_fd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(RECORD_NAME, dir_fd=entry_fd)
            os.fsync(entry_fd)
        os.rmdir(entry, dir_fd=vols_fd)
        os.fsync(vols_fd)

    def _read(self, vols_fd: int, entry: str) -> Volume | None:
        """The entry's record; None when there is no such entry (a link or a file there is no entry either)."""
        try:
            st = os.lstat(entry, dir_fd=vols_fd)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        changed = datetime.fromtimestamp(st.st_mtime, UTC)
        try:
            with _fd(os.open(entry, O_DIR, dir_fd=vols_fd)) as entry_fd:
                fd = os.open(RECORD_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=entry_fd)
                with _fd(fd):
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        return Volume(entry, None, "its record is not a regular file", changed)
                    raw = os.read(fd, MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return Volume(entry, None, "it has no record (a publish stopped before writing it)", changed)
        except OSError as err:
            return Volume(entry, None, f"its record cannot be read ({os.strerror(_errno_of(err))})", changed)
        if len(raw) > MAX_RECORD_BYTES:
            return Volume(entry, None, f"its record is larger than {MAX_RECORD_BYTES} bytes", changed)
        try:
            return Volume(entry, Record.model_validate(json.loads(raw)), changed=changed)
        except (ValueError, ValidationError) as err:
            return Volume(entry, None, f"its record does not parse ({str(err).splitlines()[0][:200]})", changed)

    @staticmethod
    def _write(entry_fd: int, record: Record) -> None:
        write_atomic(entry_fd, RECORD_NAME, record.to_json(), mode=0o600)

    def _remove(self, vols_fd: int, entry: str) -> fsdelete.DeleteResult:
        tomb = tombstone_name(standalone_id(), self.clock())
        with _fd(os.open(self.root.path, O_DIR)) as root_fd:
            rename_noreplace(vols_fd, entry, root_fd, tomb)
            os.fsync(root_fd)
        return fsdelete.delete_tree(self.root.path, tomb)
