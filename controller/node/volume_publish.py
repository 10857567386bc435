"""The node service's side of captured volumes (issue 27): `publish` and `unpublish`, called by `sandkeep
csi-node` for the kubelet, blocking and idempotent, raising `VolumeError` with the CSI status. A capture gets a
fresh workspace bind-mounted at the target; a reopen mounts a retained sandbox's own workspace. See capture.py.
"""

from __future__ import annotations

import contextlib
import errno as E
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from controller.node import nofollow
from controller.node.store import (
    Present,
    StoreError,
    manifest_in,
)
from controller.node.store import errno_of as _errno_of
from controller.node.store import ident as _ident
from controller.node.store import owned_fd as _fd
from controller.node.volume_dir import (
    O_DIR,
    O_PATH_DIR,
    Record,
    State,
    VolumeDir,
    check_request,
    entry_name,
    mount_syscall,
    split_target,
    umount_syscall,
)
from controller.rules.contracts import WORKSPACE_DIR
from controller.rules.durations import format_instant
from controller.rules.volume import VolumeError, VolumeRequest

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 0x1, 0x2, 0x4, 0x20, 0x1000  # mount(2)'s flags


class VolumePublisher(VolumeDir):
    """The node service's calls: publish and unpublish (idempotent; the kubelet retries them)."""

    def publish(self, req: VolumeRequest) -> None:
        """Give the Pod a fresh workspace at `req.target_path` (idempotent for the same id and target).

        Never refused for space or quota (retention never fails a job): it writes one directory and a record
        of a few hundred bytes, which root's reserved blocks cover on a full ext4. A publish that fails leaves
        nothing behind it made.
        """
        check_request(req)
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
                with _fd(os.open(entry, O_DIR, dir_fd=vols_fd)) as entry_fd:
                    self._mount_workspace(record, entry_fd)
                    if record.state is State.UNPUBLISHED:  # the kubelet mounts a running Pod's volume again
                        self._write(
                            entry_fd, record.model_copy(update={"state": State.PUBLISHED, "unpublished_at": None})
                        )
                return
            with contextlib.suppress(FileExistsError):
                os.mkdir(entry, 0o700, dir_fd=vols_fd)
            try:
                with _fd(os.open(entry, O_DIR, dir_fd=vols_fd)) as entry_fd:
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
                with _fd(os.open(entry, O_DIR, dir_fd=vols_fd)) as entry_fd:
                    if record is None:
                        record = self._record(req, _ident(os.fstat(ws)))
                        self._write(entry_fd, record)
                        # Under the slot's lock, before the mount: an agent about to rename it holds it instead.
                        self._bump(mark)
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
            sandbox_fd = nofollow.open_no_symlinks(self.root.path / namespace / name)
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
                ws = os.open(WORKSPACE_DIR, O_PATH_DIR, dir_fd=sandbox_fd)
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
        with _fd(os.open(WORKSPACE_DIR, O_DIR, dir_fd=entry_fd)) as ws:
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
        with _fd(os.open(WORKSPACE_DIR, O_PATH_DIR, dir_fd=entry_fd)) as ws:
            self._mount(record, ws)

    def _mount(self, record: Record, ws: int) -> None:
        """Bind-mount the workspace at the target, unless it is mounted there already; never through a link.

        Both ends are opened first (the target's own name with O_NOFOLLOW) and mounted by their
        /proc/self/fd names, so a link swapped in after the checks is never followed. Then one remount sets
        nosuid, nodev and (when asked) read-only: a bind mount ignores those flags on its first call.
        """
        parent, leaf, target = split_target(record.target_path)
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
                    mount_syscall(f"/proc/self/fd/{ws}", f"/proc/self/fd/{target_fd}", _MS_BIND)
            with _fd(self._open_target(record, parent_fd, leaf)) as mounted:
                if _ident(os.fstat(mounted)) != record.workspace:
                    raise VolumeError(
                        "INTERNAL", f"volume {record.volume_id}: the mount at {record.target_path} vanished"
                    )
                flags = _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if record.read_only else 0)
                try:
                    mount_syscall(None, f"/proc/self/fd/{mounted}", flags)
                except OSError:  # never left mounted without its flags (read-only, above all)
                    with contextlib.suppress(OSError):
                        umount_syscall(target)
                    raise

    @staticmethod
    def _open_target(record: Record, parent_fd: int, leaf: str) -> int:
        try:
            return os.open(leaf, O_PATH_DIR, dir_fd=parent_fd)
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
                with _fd(os.open(entry, O_DIR, dir_fd=vols_fd)) as entry_fd:
                    now = format_instant(self.clock())
                    self._write(entry_fd, record.model_copy(update={"state": State.UNPUBLISHED, "unpublished_at": now}))

    def _remove_target(self, target_path: str, record: Record | None) -> None:
        """Unmount our workspace from the target (every layer of it), then rmdir the target if it is empty."""
        parent, leaf, target = split_target(target_path)
        try:
            parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return
        with _fd(parent_fd):
            for _ in range(8):
                try:
                    with _fd(os.open(leaf, O_PATH_DIR, dir_fd=parent_fd)) as target_fd:
                        ours = record is not None and _ident(os.fstat(target_fd)) == record.workspace
                except OSError as err:
                    if err.errno in (E.ENOENT, E.ELOOP, E.ENOTDIR):
                        return
                    raise
                if not ours:
                    break
                try:
                    umount_syscall(target)
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
