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

from controller.node.volume_dir import (
    LOCK_FILE,
    RECORD_NAME,
    Busy,
    KeepResult,
    Kept,
    Lost,
    Record,
    State,
    Volume,
    VolumeDir,
    entry_name,
    mount_points,
)
from controller.node.volume_keep import VolumeKeeper
from controller.node.volume_publish import VolumePublisher

__all__ = [
    "LOCK_FILE",
    "RECORD_NAME",
    "Busy",
    "KeepResult",
    "Kept",
    "Lost",
    "Record",
    "State",
    "Volume",
    "VolumeDir",
    "Volumes",
    "entry_name",
    "mount_points",
]


class Volumes(VolumePublisher, VolumeKeeper):
    """The captured volumes under one root; safe to call from the node service's threads and the agent's."""
