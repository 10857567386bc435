"""What a CSI publish asks for, checked: the one parsed form the node plugin works from (issue 27).

The kubelet hands the plugin a volume id, a target path and `volumeAttributes` (the user's, plus the Pod's
identity under `csi.storage.k8s.io/...` with podInfoOnMount). `VolumeRequest` is that request once it has
passed every check; nothing downstream reads the raw attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from controller.rules.contracts import Keep


class VolumeError(Exception):
    """A refusal the user must see: `code` is the gRPC status name the CSI spec names (`INVALID_ARGUMENT`, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class VolumeRequest:
    volume_id: str
    target_path: str  # absolute, under the kubelet's pods directory
    pod_namespace: str
    pod_name: str
    pod_uid: str
    service_account: str
    keep: Keep = Keep.ALWAYS
    name: str | None = None  # VOLUME_NAME: the kept sandbox's name, when the user chose one
    retention: timedelta | None = None  # VOLUME_RETENTION
    sandbox: str | None = None  # VOLUME_SANDBOX: reopen this retained sandbox instead of a fresh workspace
    read_only: bool = False
    mount_group: int | None = None  # VolumeCapability.mount.volume_mount_group (the Pod's fsGroup), when sent
