"""The agent's side of captured volumes (issue 27): once a capture's target is no longer mounted, `keep` it as a
sandbox by rename or `discard` it through a tombstone, as the pass decided (controller/rules/capture.py); what
reopens hold (`reopened`) and `forget` a reopen whose unpublish never came. See capture.py.
"""

from __future__ import annotations

import errno as E
import os
from datetime import timedelta
from pathlib import Path

from controller.node import fsdelete
from controller.node.store import (
    Present,
    StoreError,
    parse_tombstone,
    rename_noreplace,
)
from controller.node.store import owned_fd as _fd
from controller.node.volume_dir import (
    O_DIR,
    Busy,
    KeepResult,
    Kept,
    Lost,
    Record,
    State,
    VolumeDir,
)
from controller.rules.capture import job_id_of, kept_names
from controller.rules.contracts import WORKSPACE_DIR, Reason
from controller.rules.durations import format_instant
from controller.rules.models import Origin
from controller.rules.objects import reopen_holder


class VolumeKeeper(VolumeDir):
    """The agent pass's calls: keep, discard, forget, and what reopens hold."""

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
                holds.append((reopen_holder(record.pod_namespace, record.pod_name), where))
        return holds, unknown

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
            with _fd(os.open(entry, O_DIR, dir_fd=vols_fd)) as entry_fd:
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
        with _fd(os.open(self.root.path, O_DIR)) as root_fd, os.scandir(root_fd) as entries:
            for e in entries:
                t = parse_tombstone(e.name)
                if t is None or not t.staging:
                    continue
                try:
                    with _fd(os.open(e.name, O_DIR, dir_fd=root_fd)) as stage_fd:
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
