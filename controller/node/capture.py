"""Captured volumes on the node (issue 27): a Pod's fresh workspace on the root's filesystem, bind-mounted at
its CSI volume's target path while the Pod runs, then kept as a sandbox by rename, or deleted.

Layout (the root's own directory: its scan skips it, nothing in it is a sandbox):

    <root>/.sandkeep-volumes/                 0700, root's: no other account on the node reaches below it
      <sha256(volume id)[:32]>/               0700, one entry per volume (ids are the kubelet's, any string)
        record.json                           0600, written atomically: the request, the state, the decision
        workspace/                            the Pod's files, bind-mounted (nosuid, nodev) at the target path

A record goes published -> unpublished -> keeping -> kept, then its entry is tombstoned and deleted.

A reopen (`sandbox` set: a Pod's volume naming a retained sandbox of its own namespace) has a record and no
workspace of its own: the sandbox's `workspace/` is bind-mounted at the target (read-only unless asked), its
(st_dev, st_ino) in the record. Its record is published until the unpublish, which unmounts and removes the
entry entirely: nothing is ever kept or discarded from a reopen, and while its record exists (or its target is
still mounted) the agent holds the sandbox (`reopened`). The CSI
node service calls `publish` and `unpublish` (blocking, idempotent, raising `VolumeError` with the CSI status);
the agent's pass decides (controller/rules/capture.py) and calls `keep` or `discard`, never on a volume whose
target is still mounted. Both sides take one lock per entry, so a pass never acts on a publish in progress: a
thread lock (shared by every `Volumes` of the same root in the process) and a byte of `.lock` (fcntl), since the
node service (`sandkeep csi-node`) and the agent are separate processes.

Who may write the workspace: a CSI driver is not told the Pod's uid. With the Pod's fsGroup (the kubelet's
`volume_mount_group`) the workspace is root:<fsGroup> mode 2775 (setgid: what the Pod creates stays in its
group); without one it is 1777 (sticky, as /tmp). World-writable is safe here: the only way to the directory
is the Pod's own mount, since every directory above it is 0700 and root's.

Crash safety: every step is a rename or an atomic record write, and each one's redo is this module's own:
`keep` again finds a sandbox already placed (by the workspace's inode), or moves the workspace back out of a
retain's staging directory a crash left behind, so a killed agent ends with exactly one sandbox; a discard is
one rename to a root tombstone, which the leftover-tombstone pass deletes if this process could not.
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
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.node import fsdelete
from controller.node.store import (
    Present,
    Root,
    StoreError,
    manifest_in,
    parse_tombstone,
    rename_noreplace,
    standalone_id,
    tombstone_name,
    write_atomic,
)
from controller.node.store import errno_of as _errno_of
from controller.node.store import ident as _ident
from controller.node.store import owned_fd as _fd
from controller.rules.capture import job_id_of, kept_names
from controller.rules.contracts import VOLUMES_DIR, WORKSPACE_DIR, Keep, Reason
from controller.rules.durations import format_instant, instant_or_none
from controller.rules.models import NamespaceName, ObjectName, Origin, is_namespace_name, is_object_name
from controller.rules.volume import VolumeError, VolumeRequest

RECORD_NAME = "record.json"
VOLUME_ID_MAX = 1024  # bytes of a volume id (the kubelet's are `csi-<sha256>`, 68)
PATH_MAX = 4096
MAX_RECORD_BYTES = 64 * 1024  # a record is well under 2 KiB; anything this large is not ours
_STRIPES = 64  # locks shared by all entries: bounded, and two entries rarely wait on each other
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 0x1, 0x2, 0x4, 0x20, 0x1000
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
_MARK = 8

_LOCK_FDS: dict[Path, int] = {}  # one open lock file per volumes directory for the process's life: fcntl locks
# are the process's and closing any fd of the file drops them all, so it is never closed


def _lock_fd(vols: Path) -> int:
    with _ALL_LOCKS_LOCK:
        if vols not in _LOCK_FDS:
            _LOCK_FDS[vols] = os.open(vols / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return _LOCK_FDS[vols]


def _syscall_mount(source: str | None, target: str, flags: int) -> None:
    src = None if source is None else os.fsencode(source)
    if _libc.mount(src, os.fsencode(target), None, ctypes.c_ulong(flags), None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount: {os.strerror(code)}", target)


def _syscall_umount(target: str) -> None:
    if _libc.umount2(os.fsencode(target), _UMOUNT_NOFOLLOW) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"umount: {os.strerror(code)}", target)


def mount_points(mountinfo: Path) -> Iterator[str]:
    """Every mount point of this mount namespace, read line by line (a node with many Pods has thousands)."""
    with mountinfo.open("rb") as lines:
        for line in lines:
            parts = line.split(b" ", 5)
            if len(parts) > 4:
                yield fsdelete.unescape_mountinfo(os.fsdecode(parts[4]))


def _target(path: str) -> tuple[str, str, str]:
    """The target's parent resolved as the kernel resolves it, its own name (never followed), and the two
    joined: the path mountinfo shows for a mount there."""
    parent, _, leaf = path.rstrip("/").rpartition("/")
    real = os.path.realpath(parent or "/")
    return real, leaf, str(Path(real) / leaf)


def _check(req: VolumeRequest) -> None:
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


class Volumes:
    """The captured volumes under one root; safe to call from the node service's threads and the agent's."""

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
            fd = _lock_fd(self.path)
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, stripe)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, stripe)

    @contextlib.contextmanager
    def _volumes(self, *, create: bool) -> Iterator[int | None]:
        """The volumes directory, open (made 0700 on first use); None when there is none yet."""
        with _fd(os.open(self.root.path, _DIR)) as root_fd:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(VOLUMES_DIR, 0o700, dir_fd=root_fd)
            try:
                fd = os.open(VOLUMES_DIR, _DIR, dir_fd=root_fd)
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
        digest = hashlib.sha256("/".join(key).encode(errors="surrogateescape")).digest()
        offset = _SLOT_BASE + int.from_bytes(digest[:4]) % _SLOTS * _MARK
        with self._volumes(create=True):
            fd = _lock_fd(self.path)
            fcntl.lockf(fd, op, _MARK, offset)
            try:
                yield offset
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, _MARK, offset)

    def _mark(self, offset: int) -> int:
        return int.from_bytes(os.pread(_lock_fd(self.path), _MARK, offset).ljust(_MARK, b"\0"))

    def seen(self, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Each sandbox's reopen mark now (the agent reads it before its in-use look)."""
        out = {}
        for key in keys:
            with self._slot(key, fcntl.LOCK_SH) as offset:
                out[key] = self._mark(offset)
        return out

    @contextlib.contextmanager
    def unchanged(self, key: tuple[str, str], seen: int) -> Iterator[bool]:
        """Held across the agent's rename of the sandbox: whether no reopen was recorded since `seen` was read.
        csi-node records a reopen under the same lock, so it lands before (and shows here) or after (and finds
        the sandbox renamed away)."""
        with self._slot(key, fcntl.LOCK_EX) as offset:
            yield self._mark(offset) == seen

    # --- the node service's two calls -------------------------------------------------------------------

    def publish(self, req: VolumeRequest) -> None:
        """Give the Pod a fresh workspace at `req.target_path` (idempotent for the same id and target).

        Never refused for space or quota (retention never fails a job): it writes one directory and a record
        of a few hundred bytes, which root's reserved blocks cover on a full ext4. A publish that fails leaves
        nothing behind it made.
        """
        _check(req)
        entry = entry_name(req.volume_id)
        with self._lock(entry):
            try:
                if req.sandbox is not None:
                    self._publish_reopen(req, req.sandbox, entry)
                else:
                    self._publish(req, entry)
            except OSError as err:
                raise VolumeError(
                    "INTERNAL",
                    f"volume {req.volume_id}: could not publish it at {req.target_path} "
                    f"({os.strerror(_errno_of(err))}{f' at {err.filename}' if err.filename else ''}); "
                    "the kubelet retries",
                ) from err

    def _publish(self, req: VolumeRequest, entry: str) -> None:
        with self._volumes(create=True) as vols_fd:
            assert vols_fd is not None
            volume = self._read(vols_fd, entry)
            record = volume.record if volume is not None else None
            if volume is not None and record is None and self.workspace_empty(entry) is False:
                raise VolumeError(
                    "INTERNAL", f"volume {req.volume_id}: {volume.why}, and its workspace holds files; left as it is"
                )
            if record is not None:
                self._republish(req, record)
                with _fd(os.open(entry, _DIR, dir_fd=vols_fd)) as entry_fd:
                    self._mount_workspace(record, entry_fd)
                    if record.state is State.UNPUBLISHED:  # the kubelet mounts a running Pod's volume again
                        self._write(
                            entry_fd, record.model_copy(update={"state": State.PUBLISHED, "unpublished_at": None})
                        )
                return
            with contextlib.suppress(FileExistsError):
                os.mkdir(entry, 0o700, dir_fd=vols_fd)
            try:
                with _fd(os.open(entry, _DIR, dir_fd=vols_fd)) as entry_fd:
                    record = self._new_record(req, entry_fd)
                    self._mount_workspace(record, entry_fd)
            except BaseException:  # nothing is mounted and nothing was written in it: it goes, never to be decided on
                with contextlib.suppress(OSError, StoreError):
                    self._remove(vols_fd, entry)
                raise

    def _publish_reopen(self, req: VolumeRequest, sandbox: str, entry: str) -> None:
        """Mount the workspace of the sandbox <Pod's namespace>/<sandbox> at the target (idempotent): opened with
        no link followed in any component, its manifest naming it; the record first, then the mount."""
        ns = req.pod_namespace
        with (
            self._slot((ns, sandbox), fcntl.LOCK_EX) as mark,
            self._volumes(create=True) as vols_fd,
            self._reopened(ns, sandbox, req.volume_id) as ws,
        ):
            assert vols_fd is not None
            volume = self._read(vols_fd, entry)
            record = volume.record if volume is not None else None
            if record is not None:
                self._republish(req, record)
                if (record.pod_namespace, record.sandbox, record.workspace) != (ns, sandbox, _ident(os.fstat(ws))):
                    raise VolumeError(
                        "FAILED_PRECONDITION",
                        f"volume {req.volume_id}: RetainedSandbox {ns}/{sandbox} is not the one it was published "
                        "from (replaced since); a new Pod gets a new volume",
                    )
            with contextlib.suppress(FileExistsError):
                os.mkdir(entry, 0o700, dir_fd=vols_fd)
            try:
                with _fd(os.open(entry, _DIR, dir_fd=vols_fd)) as entry_fd:
                    if record is None:
                        record = self._record(req, _ident(os.fstat(ws)))
                        self._write(entry_fd, record)
                        # Under the slot's lock, before the mount: an agent about to rename it holds it instead.
                        os.pwrite(_lock_fd(self.path), ((self._mark(mark) + 1) % 2**64).to_bytes(_MARK), mark)
                    self._mount(record, ws)
            except BaseException:
                if volume is None:  # a first publish that failed leaves nothing: no mount, no hold
                    with contextlib.suppress(OSError):
                        self._forget(vols_fd, entry)
                raise

    @contextlib.contextmanager
    def _reopened(self, namespace: str, name: str, volume_id: str) -> Iterator[int]:
        """An O_PATH fd of the sandbox's workspace/, reached with no link followed, its manifest naming it."""
        ref = f"RetainedSandbox {namespace}/{name}"
        try:
            sandbox_fd = fsdelete.open_no_symlinks(self.root.path / namespace / name)
        except FileNotFoundError as err:
            raise VolumeError("NOT_FOUND", f"{ref}: its directory is not on this node's root") from err
        except OSError as err:
            if err.errno not in (E.ELOOP, E.ENOTDIR):
                raise
            raise VolumeError(
                "FAILED_PRECONDITION", f"{ref}: a link or a file on its path on this node; a link is never followed"
            ) from err
        with _fd(sandbox_fd):
            read = manifest_in(sandbox_fd, namespace, name)
            if not isinstance(read, Present):
                raise VolumeError(
                    "FAILED_PRECONDITION",
                    f"{ref}: its manifest on this node does not name it ({read.reason}); see `kubectl sandkeep doctor`",
                )
            try:
                ws = os.open(WORKSPACE_DIR, _PATH, dir_fd=sandbox_fd)
            except OSError as err:
                raise VolumeError(
                    "FAILED_PRECONDITION",
                    f"{ref}: its workspace/ cannot be opened ({os.strerror(_errno_of(err))}); a link is never followed",
                ) from err
            with _fd(ws):
                yield ws

    def _record(self, req: VolumeRequest, workspace: tuple[int, int]) -> Record:
        """A new publish's record: the request as the kubelet made it, the workspace's identity, published now."""
        return Record(
            volume_id=req.volume_id,
            target_path=req.target_path,
            pod_namespace=req.pod_namespace,
            pod_name=req.pod_name,
            pod_uid=req.pod_uid,
            service_account=req.service_account,
            keep=req.keep,
            name=req.name,
            retention_seconds=None if req.retention is None else int(req.retention.total_seconds()),
            read_only=req.read_only,
            mount_group=req.mount_group,
            workspace=workspace,
            published_at=format_instant(self.clock()),
            state=State.PUBLISHED,
            sandbox=req.sandbox,
        )

    @staticmethod
    def _forget(vols_fd: int, entry: str) -> None:
        """Remove a reopen's entry (its record alone: the workspace it mounted is the sandbox's, never here)."""
        with _fd(os.open(entry, _DIR, dir_fd=vols_fd)) as entry_fd:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(RECORD_NAME, dir_fd=entry_fd)
            os.fsync(entry_fd)
        os.rmdir(entry, dir_fd=vols_fd)
        os.fsync(vols_fd)

    def _republish(self, req: VolumeRequest, record: Record) -> None:
        """Refuse a publish of a known volume that is not the same one again."""
        if record.volume_id != req.volume_id:
            raise VolumeError("INTERNAL", f"volume {req.volume_id}: its entry holds volume {record.volume_id}")
        if record.target_path != req.target_path:
            raise VolumeError(
                "ALREADY_EXISTS",
                f"volume {req.volume_id} is already published at {record.target_path}; one volume is published at "
                f"one path, not also at {req.target_path}",
            )
        if record.state not in (State.PUBLISHED, State.UNPUBLISHED):
            raise VolumeError(
                "FAILED_PRECONDITION",
                f"volume {req.volume_id}: its Pod ended and its workspace is being kept; a new Pod gets a new volume",
            )

    def _new_record(self, req: VolumeRequest, entry_fd: int) -> Record:
        """The empty workspace, writable by the Pod (see the module's note), then its record."""
        with contextlib.suppress(FileExistsError):  # a publish that crashed before its record: start again
            os.mkdir(WORKSPACE_DIR, 0o700, dir_fd=entry_fd)
        with _fd(os.open(WORKSPACE_DIR, _DIR, dir_fd=entry_fd)) as ws:
            if req.mount_group is not None:
                os.fchown(ws, -1, req.mount_group)
                os.fchmod(ws, 0o2775)
            else:
                os.fchmod(ws, 0o1777)
            ident = _ident(os.fstat(ws))
        record = self._record(req, ident)
        self._write(entry_fd, record)
        return record

    def _mount_workspace(self, record: Record, entry_fd: int) -> None:
        with _fd(os.open(WORKSPACE_DIR, _PATH, dir_fd=entry_fd)) as ws:
            self._mount(record, ws)

    def _mount(self, record: Record, ws: int) -> None:
        """Bind-mount the workspace at the target, unless it is mounted there already; never through a link.

        Both ends are opened first (the target's own name with O_NOFOLLOW) and mounted by their
        /proc/self/fd names, so a link swapped in after the checks is never followed. Then one remount sets
        nosuid, nodev and (when asked) read-only: a bind mount ignores those flags on its first call.
        """
        parent, leaf, target = _target(record.target_path)
        Path(parent).mkdir(0o750, parents=True, exist_ok=True)
        with _fd(os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)) as parent_fd:
            with contextlib.suppress(FileExistsError):
                os.mkdir(leaf, 0o750, dir_fd=parent_fd)
            with _fd(self._open_target(record, parent_fd, leaf)) as target_fd:
                if _ident(os.fstat(target_fd)) != record.workspace:
                    if self._mounted_on(target_fd, parent_fd, target):
                        raise VolumeError(
                            "FAILED_PRECONDITION",
                            f"volume {record.volume_id}: something else is mounted at {record.target_path}",
                        )
                    _syscall_mount(f"/proc/self/fd/{ws}", f"/proc/self/fd/{target_fd}", _MS_BIND)
            with _fd(self._open_target(record, parent_fd, leaf)) as mounted:
                if _ident(os.fstat(mounted)) != record.workspace:
                    raise VolumeError(
                        "INTERNAL", f"volume {record.volume_id}: the mount at {record.target_path} vanished"
                    )
                flags = _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if record.read_only else 0)
                try:
                    _syscall_mount(None, f"/proc/self/fd/{mounted}", flags)
                except OSError:  # never left mounted without its flags (read-only, above all)
                    with contextlib.suppress(OSError):
                        _syscall_umount(target)
                    raise

    @staticmethod
    def _open_target(record: Record, parent_fd: int, leaf: str) -> int:
        try:
            return os.open(leaf, _PATH, dir_fd=parent_fd)
        except OSError as err:
            if err.errno in (E.ELOOP, E.ENOTDIR):
                raise VolumeError(
                    "INVALID_ARGUMENT",
                    f"volume {record.volume_id}: the target path {record.target_path} is a symlink or not a directory; "
                    "it is never followed",
                ) from err
            raise

    def unpublish(self, volume_id: str, target_path: str) -> None:
        """Unmount the workspace from `target_path`, remove the target directory, mark the record unpublished.

        Fast and idempotent: the keep decision is the agent's next pass (the Pod's final status may not have
        reached the API yet). An unknown volume, or a target it was never published at, succeeds.
        """
        entry = entry_name(volume_id)
        with self._lock(entry):
            try:
                self._unpublish(volume_id, target_path, entry)
            except OSError as err:
                raise VolumeError(
                    "INTERNAL",
                    f"volume {volume_id}: could not unpublish it from {target_path} ({os.strerror(_errno_of(err))}); "
                    "the kubelet retries",
                ) from err

    def _unpublish(self, volume_id: str, target_path: str, entry: str) -> None:
        with self._volumes(create=False) as vols_fd:
            volume = None if vols_fd is None else self._read(vols_fd, entry)
            record = volume.record if volume is not None else None
            if vols_fd is None or record is None or (record.volume_id, record.target_path) != (volume_id, target_path):
                self._remove_target(target_path, None)  # only an empty, unmounted directory: never ours to mount
                return
            self._remove_target(target_path, record)
            if record.sandbox is not None:  # a reopen: nothing to keep, the entry goes and with it the hold
                self._forget(vols_fd, entry)
            elif record.state is State.PUBLISHED:
                with _fd(os.open(entry, _DIR, dir_fd=vols_fd)) as entry_fd:
                    now = format_instant(self.clock())
                    self._write(entry_fd, record.model_copy(update={"state": State.UNPUBLISHED, "unpublished_at": now}))

    def _remove_target(self, target_path: str, record: Record | None) -> None:
        """Unmount our workspace from the target (every layer of it), then rmdir the target if it is empty."""
        parent, leaf, target = _target(target_path)
        try:
            parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return
        with _fd(parent_fd):
            for _ in range(8):
                try:
                    with _fd(os.open(leaf, _PATH, dir_fd=parent_fd)) as target_fd:
                        ours = record is not None and _ident(os.fstat(target_fd)) == record.workspace
                except OSError as err:
                    if err.errno in (E.ENOENT, E.ELOOP, E.ENOTDIR):
                        return
                    raise
                if not ours:
                    break
                try:
                    _syscall_umount(target)
                except OSError as err:
                    if err.errno == E.EINVAL:  # not a mount point after all
                        break
                    if err.errno == E.EBUSY:
                        raise VolumeError(
                            "INTERNAL", f"volume at {target_path}: the mount is busy (a process still uses it); retried"
                        ) from err
                    raise
            if self._mounted_at(parent_fd, leaf, target):
                if record is None:
                    return  # not ours: left as it is
                raise VolumeError(
                    "FAILED_PRECONDITION",
                    f"volume {record.volume_id}: something else is mounted at {target_path} on top of its workspace; "
                    "unmount it first",
                )
            with contextlib.suppress(OSError):  # gone already, or not empty: not ours to remove then
                os.rmdir(leaf, dir_fd=parent_fd)

    # --- what the agent's pass reads and does ------------------------------------------------------------

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

    def reopened(self) -> tuple[list[tuple[str, Path]], list[str]]:
        """What reopens hold: (holder, the sandbox's path) of every reopen record, published or still mounted,
        and the entries that may be a reopen whose record cannot be read (no record and no workspace of their
        own): those name no sandbox, so each holds every sandbox of the node until its entry is cleared."""
        holds: list[tuple[str, Path]] = []
        unknown: list[str] = []
        points = self.mount_points()
        for volume in self.records():
            record = volume.record
            if record is None:
                if not (self.path / volume.entry / WORKSPACE_DIR).exists():
                    unknown.append(f"volume entry {volume.entry}: {volume.why}")
            elif record.sandbox is not None and (record.state is State.PUBLISHED or self.mounted(record, points)):
                where = self.root.path / record.pod_namespace / record.sandbox
                holds.append((f"pod {record.pod_namespace}/{record.pod_name} (reopen volume)", where))
        return holds, unknown

    def mounted(self, record: Record, points: Collection[str] | None = None) -> bool:
        """Whether anything is mounted at the record's target: it is in use, never kept or discarded.
        `points`: this namespace's mount points read once for many records (`mount_points`)."""
        target = _target(record.target_path)[2]
        return target in points if points is not None else self._is_mount_point(target)

    def mount_points(self) -> frozenset[str]:
        return frozenset(mount_points(self.mountinfo))

    def _is_mount_point(self, path: str) -> bool:
        return any(point == path for point in mount_points(self.mountinfo))

    def _mounted_on(self, target_fd: int, parent_fd: int, target: str) -> bool:
        """Whether the target (`target_fd`, opened from `parent_fd`) is a mount's root: its mount id against its
        parent's, one statx each. Not the mount table: its read costs 3.5 ms of CPU at 1,000 mounts, and 50
        publishes at once beside 1,000 other mounts took p99 0.95 s with it, 0.15-0.17 s without (hack/bench/csi.py)."""
        mine, parents = fsdelete.mount_id(target_fd), fsdelete.mount_id(parent_fd)
        if mine is None or parents is None:  # a kernel that tells no mount id (before 3.15)
            return self._is_mount_point(target)
        return mine != parents

    def _mounted_at(self, parent_fd: int, leaf: str, target: str) -> bool:
        try:
            target_fd = os.open(leaf, _PATH, dir_fd=parent_fd)
        except OSError as err:
            if err.errno in (E.ENOENT, E.ELOOP, E.ENOTDIR):  # nothing there, or a link: nothing is mounted on it
                return False
            return self._is_mount_point(target)
        with _fd(target_fd):
            return self._mounted_on(target_fd, parent_fd, target)

    def workspace_empty(self, entry: str) -> bool | None:
        """Whether an entry's workspace holds nothing (None: it has none, or it cannot be read)."""
        try:
            with _fd(os.open(self.path / entry / WORKSPACE_DIR, _DIR)) as ws, os.scandir(ws) as it:
                return next(it, None) is None
        except OSError:
            return None

    def forget(self, entry: str) -> bool | Busy:
        """Remove a reopen's entry whose unpublish never came (its Pod is gone): never one whose target is still
        mounted (Busy), never a capture's entry (False: not a reopen). True: removed, or already gone."""
        with self._lock(entry), self._volumes(create=False) as vols_fd:
            volume = None if vols_fd is None else self._read(vols_fd, entry)
            if vols_fd is None or volume is None:
                return True
            if volume.record is None or volume.record.sandbox is None:
                return False
            if self.mounted(volume.record):
                return Busy(volume.record.target_path)
            self._forget(vols_fd, entry)  # its record alone: an entry holding anything else is not removed
            return True

    def keep(self, entry: str, origin: Origin, why: str) -> KeepResult:
        """Keep a volume's workspace as `<root>/<its Pod's namespace>/<name>` (Root.retain_volume: a rename,
        never a copy, a manifest carrying `origin`), under the first free name of `kept_names`; then the entry
        goes. The decision is recorded first (state keeping): a keep run again, after a crash anywhere,
        finishes the same one (a sandbox already placed is found by the workspace's inode; a workspace a crash
        left in a retain's staging directory is moved back first), so there is never a second sandbox.
        """
        with self._lock(entry), self._volumes(create=False) as vols_fd:
            if vols_fd is None:
                return None
            volume = self._read(vols_fd, entry)
            record = volume.record if volume is not None else None
            if record is None:
                return None
            if self.mounted(record):
                return Busy(record.target_path)
            with _fd(os.open(entry, _DIR, dir_fd=vols_fd)) as entry_fd:
                result = self._keep(entry, entry_fd, record, origin, why)
            if result is not None:
                self._remove(vols_fd, entry)
            return result

    def _keep(self, entry: str, entry_fd: int, record: Record, origin: Origin, why: str) -> Kept | Lost | None:
        """Record the decision (once: a redo keeps the first), place the workspace, record where it went."""
        if record.state in (State.PUBLISHED, State.UNPUBLISHED):
            now = format_instant(self.clock())
            record = record.model_copy(update={"state": State.KEEPING, "decided_at": now, "why": why, "origin": origin})
            self._write(entry_fd, record)
        if record.state is State.KEPT and record.kept_as:
            ns, _, name = record.kept_as.partition("/")
            return Kept(ns, name, recovered=True)
        if record.state is not State.KEEPING:
            return None
        result = self._kept(entry, entry_fd, record)
        if isinstance(result, Kept):
            self._write(
                entry_fd,
                record.model_copy(update={"state": State.KEPT, "kept_as": f"{result.namespace}/{result.name}"}),
            )
        return result

    def _kept(self, entry: str, entry_fd: int, record: Record) -> Kept | Lost:
        names = kept_names(record.name, record.pod_name, record.pod_uid, record.volume_id)
        ns = record.pod_namespace
        try:
            os.lstat(WORKSPACE_DIR, dir_fd=entry_fd)
        except FileNotFoundError:
            placed = self._placed(record, names)
            if placed is not None:
                return Kept(ns, placed, recovered=True)
            if not self._rescue(entry_fd, record):
                return Lost(f"its workspace is neither in {self.path / entry} nor in a sandbox of {ns}")
        origin = record.origin
        assert origin is not None
        created = record.ended_at() or self.clock()
        retention = None if record.retention_seconds is None else timedelta(seconds=record.retention_seconds)
        for name in names:
            try:
                self.root.retain_volume(
                    entry,
                    ns,
                    name,
                    job_id=job_id_of(origin),
                    created_at=created,
                    retention=retention,
                    node=origin.node,
                    origin=origin,
                    now=self.clock(),
                )
            except StoreError as err:
                if err.reason is Reason.PINNED or err.errno == E.EEXIST:
                    continue  # taken by another sandbox: the next name
                raise
            return Kept(ns, name)
        raise StoreError(Reason.RENAME_FAILED, f"sandbox names {names} of {ns} are all taken", errno=E.EEXIST)

    def _placed(self, record: Record, names: list[str]) -> str | None:
        """The name under which an interrupted keep already placed this workspace (same inode, same Pod)."""
        for name in names:
            sandbox = self.root.path / record.pod_namespace / name
            try:
                st = os.lstat(sandbox / WORKSPACE_DIR)
            except OSError:
                continue
            if st.st_ino != record.workspace[1]:  # the inode alone: a reboot may number the device anew
                continue
            # the inode is the proof (ours left the entry by that rename); a manifest of another Pod refutes it
            read = self.root.read(record.pod_namespace, name)
            origin = read.manifest.origin if isinstance(read, Present) else None
            if origin is None or origin.pod_uid == record.pod_uid:
                return name
        return None

    def _rescue(self, entry_fd: int, record: Record) -> bool:
        """Move the workspace back from a retain's staging directory a crash left in the root (its inode says
        which), before the leftover-tombstone pass deletes that directory with it."""
        with _fd(os.open(self.root.path, _DIR)) as root_fd, os.scandir(root_fd) as entries:
            for e in entries:
                t = parse_tombstone(e.name)
                if t is None or not t.staging:
                    continue
                try:
                    with _fd(os.open(e.name, _DIR, dir_fd=root_fd)) as stage_fd:
                        if os.lstat(WORKSPACE_DIR, dir_fd=stage_fd).st_ino != record.workspace[1]:
                            continue
                        rename_noreplace(stage_fd, WORKSPACE_DIR, entry_fd, WORKSPACE_DIR)
                        os.fsync(entry_fd)
                        return True
                except OSError:
                    continue
        return False

    def discard(self, entry: str) -> fsdelete.DeleteResult | Busy | None:
        """Delete a volume's entry, workspace and all: renamed to a root tombstone first (one rename: from then
        on it is an ordinary leftover the agent's pass finishes if this delete cannot), then deleted.
        Never one whose target is still mounted (Busy); None: no such entry."""
        with self._lock(entry), self._volumes(create=False) as vols_fd:
            volume = None if vols_fd is None else self._read(vols_fd, entry)
            if vols_fd is None or volume is None:
                return None
            if volume.record is not None and self.mounted(volume.record):
                return Busy(volume.record.target_path)
            return self._remove(vols_fd, entry)

    def _remove(self, vols_fd: int, entry: str) -> fsdelete.DeleteResult:
        tomb = tombstone_name(standalone_id(), self.clock())
        with _fd(os.open(self.root.path, _DIR)) as root_fd:
            rename_noreplace(vols_fd, entry, root_fd, tomb)
            os.fsync(root_fd)
        return fsdelete.delete_tree(self.root.path, tomb)

    # --- records on disk ---------------------------------------------------------------------------------

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
            with _fd(os.open(entry, _DIR, dir_fd=vols_fd)) as entry_fd:
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
