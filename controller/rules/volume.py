"""What a CSI publish asks for, checked: the one parsed form the node plugin works from (issue 27).

The kubelet hands the plugin a volume id, a target path and `volumeAttributes` (the user's, plus the Pod's
identity under `csi.storage.k8s.io/...` with podInfoOnMount). `VolumeRequest` is that request once it has
passed every check; nothing downstream reads the raw attributes.

`parse_publish` is total: any input gives a `VolumeRequest` or raises `VolumeError`, whose message is what the
user reads in their Pod's Events (`MountVolume.SetUp failed for volume "workspace" : rpc error: code =
InvalidArgument desc = <message>`), so each one says what was wrong and what to write instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

from controller.rules.contracts import (
    POD_INFO_EPHEMERAL,
    POD_INFO_NAME,
    POD_INFO_NAMESPACE,
    POD_INFO_SERVICE_ACCOUNT,
    POD_INFO_UID,
    VOLUME_KEEP,
    VOLUME_NAME,
    VOLUME_READ_WRITE,
    VOLUME_RETENTION,
    VOLUME_SANDBOX,
    Keep,
)
from controller.rules.durations import Invalid, parse_duration
from controller.rules.models import is_namespace_name, is_object_name

# The gRPC status names the CSI spec gives a Node plugin's refusals (the server maps them onto grpc.StatusCode).
INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
ALREADY_EXISTS = "ALREADY_EXISTS"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
INTERNAL = "INTERNAL"

DEFAULT_KUBELET_DIR = "/var/lib/kubelet"  # the kubelet's --root-dir
KUBELET_PREFIX = "csi.storage.k8s.io/"  # the kubelet's own volumeAttributes (pod info, ephemeral)
USER_KEYS = (VOLUME_KEEP, VOLUME_NAME, VOLUME_RETENTION, VOLUME_SANDBOX, VOLUME_READ_WRITE)
MAX_ATTRIBUTES = 16  # the five user keys and the kubelet's five, with room for the kubelet's next ones
MAX_BYTES = 256  # of any one key, value, volume id or target path component
MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_SANDBOX_NAME = 63  # `name` and `sandbox`: a sandbox name short enough to show whole in a column
MAX_MOUNT_GROUP = 2**31 - 1
# What the kubelet sends for an inline volume (ReadWriteOnce): SINGLE_NODE_WRITER; the rest are single-node too.
SINGLE_NODE_MODES = frozenset(
    {"SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY", "SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER"}
)
_POD_UID = re.compile(r"[0-9A-Za-z][0-9A-Za-z-]{0,63}")
_VOLUME_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")
_NAME_RULE = (
    f"a Kubernetes name of at most {MAX_SANDBOX_NAME} characters (lowercase letters, digits, '-' and '.', "
    "starting and ending with a letter or digit), e.g. run-42"
)


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
    read_only: bool = False  # a reopen is, unless VOLUME_READ_WRITE says "true"; csi.readOnly always wins
    mount_group: int | None = None  # VolumeCapability.mount.volume_mount_group (the Pod's fsGroup), when sent


@dataclass(frozen=True)
class Capability:
    """A publish's `volume_capability`, as plain values (the server reads them off the message)."""

    access_type: str | None  # "mount", "block", or None when neither is set
    access_mode: str  # the CSI AccessMode.Mode's name: SINGLE_NODE_WRITER, ..., UNKNOWN
    mount_group: str = ""  # mount.volume_mount_group, sent only to a plugin with the VOLUME_MOUNT_GROUP capability


def parse_publish(
    volume_id: str,
    target_path: str,
    capability: Capability | None,
    readonly: bool,
    attributes: Mapping[str, str],
    kubelet_dir: str = DEFAULT_KUBELET_DIR,
) -> VolumeRequest:
    """A NodePublishVolume's fields -> the VolumeRequest they ask for, or VolumeError saying what to change."""
    _check_id(volume_id, target_path)
    if capability is None:
        raise _invalid("the request has no volume_capability; the kubelet always sends one, so is this the kubelet?")
    _check_sizes(attributes)
    if attributes.get(POD_INFO_EPHEMERAL) != "true":
        raise _invalid(
            "sandkeep serves only inline ephemeral volumes: declare it in the Pod's spec.volumes[].csi with "
            f'driver and volumeAttributes, not in a PersistentVolume ({POD_INFO_EPHEMERAL} was not "true")'
        )
    pod = {key: attributes.get(key, "") for key in (POD_INFO_NAMESPACE, POD_INFO_NAME, POD_INFO_UID)}
    pod[POD_INFO_SERVICE_ACCOUNT] = attributes.get(POD_INFO_SERVICE_ACCOUNT, "")
    missing = [key for key, value in pod.items() if not value]
    if missing:
        raise _invalid(
            f"the kubelet did not say which Pod this volume is for ({', '.join(missing)} missing): podInfoOnMount "
            "must be on, as the chart's CSIDriver object sets it (spec.podInfoOnMount: true)"
        )
    _check_pod(pod)
    unknown = sorted(key for key in attributes if key not in USER_KEYS and not key.startswith(KUBELET_PREFIX))
    if unknown:
        raise _invalid(
            f"volumeAttributes has {_shown(unknown[0])}, which sandkeep does not read; the keys are "
            f"{', '.join(USER_KEYS)} (e.g. {VOLUME_KEEP}: {Keep.ON_FAILURE.value})"
        )
    read_only = _check_capability(capability, readonly)
    _check_target(target_path, kubelet_dir, pod[POD_INFO_UID])
    choices = _user_choices(attributes)
    return VolumeRequest(
        volume_id=volume_id,
        target_path=target_path,
        pod_namespace=pod[POD_INFO_NAMESPACE],
        pod_name=pod[POD_INFO_NAME],
        pod_uid=pod[POD_INFO_UID],
        service_account=pod[POD_INFO_SERVICE_ACCOUNT],
        read_only=read_only or (choices.sandbox is not None and not choices.read_write),
        mount_group=_mount_group(capability.mount_group),
        keep=choices.keep,
        name=choices.name,
        retention=choices.retention,
        sandbox=choices.sandbox,
    )


def parse_unpublish(volume_id: str, target_path: str) -> tuple[str, str]:
    """A NodeUnpublishVolume's two fields, present and bounded; what they name is the backend's to find.

    Laxer than a publish on purpose: an unpublish the plugin refuses is retried by the kubelet forever, and the
    Pod never finishes terminating, so nothing that a publish checked against settings is checked again here.
    """
    _check_id(volume_id, target_path)
    return volume_id, target_path


def _check_id(volume_id: str, target_path: str) -> None:
    if not volume_id:
        raise _invalid("the request has no volume_id")
    if _size(volume_id) > MAX_BYTES or not _VOLUME_ID.fullmatch(volume_id):
        raise _invalid(
            f"volume_id {_shown(volume_id)} is not one the kubelet makes: at most {MAX_BYTES} letters, digits, "
            "'.', '_' and '-', starting with a letter or digit"
        )
    if not target_path:
        raise _invalid("the request has no target_path")
    if _size(target_path) > MAX_PATH_BYTES or "\0" in target_path:
        raise _invalid(f"target_path is longer than {MAX_PATH_BYTES} bytes or has a NUL byte")


def _check_sizes(attributes: Mapping[str, str]) -> None:
    if len(attributes) > MAX_ATTRIBUTES:
        raise _invalid(
            f"volumeAttributes has {len(attributes)} keys; at most {MAX_ATTRIBUTES} are accepted "
            f"({', '.join(USER_KEYS)} and the kubelet's {KUBELET_PREFIX}* keys)"
        )
    for key, value in attributes.items():
        if _size(key) > MAX_BYTES:
            raise _invalid(f"volumeAttributes has a key of {_size(key)} bytes ({_shown(key)}); at most {MAX_BYTES}")
        if _size(value) > MAX_BYTES:
            raise _invalid(
                f"volumeAttributes.{_shown(key, quote=False)} is {_size(value)} bytes long; at most {MAX_BYTES}"
            )


def _check_pod(pod: Mapping[str, str]) -> None:
    """The Pod's identity names directories and objects downstream, so each must be what Kubernetes allows."""
    rules = {
        POD_INFO_NAMESPACE: is_namespace_name,
        POD_INFO_NAME: is_object_name,
        POD_INFO_SERVICE_ACCOUNT: is_object_name,
        POD_INFO_UID: _is_pod_uid,
    }
    for key, valid in rules.items():
        if not valid(pod[key]):
            raise _invalid(f"{key} is {_shown(pod[key])}, which is not a Kubernetes name or uid: is this the kubelet?")


def _is_pod_uid(text: str) -> bool:
    return bool(_POD_UID.fullmatch(text))


def _check_capability(capability: Capability, readonly: bool) -> bool:
    """Whether the volume is read-only, once its capability is one a directory on the node can give."""
    if capability.access_type == "block":
        raise _invalid(
            "sandkeep's volumes are directories, not block devices: declare it as an inline volume of the Pod "
            "(spec.volumes[].csi), which is mounted as a filesystem, not with volumeMode: Block"
        )
    if capability.access_type != "mount":
        raise _invalid("volume_capability has neither mount nor block access; the kubelet always sends mount")
    if capability.access_mode not in SINGLE_NODE_MODES:
        if capability.access_mode.startswith("MULTI_NODE_"):
            # The spec's "Exceeds capabilities": a workspace lives on one node's disk.
            raise VolumeError(
                FAILED_PRECONDITION,
                f"access mode {capability.access_mode}: a sandkeep volume is one node's directory, so only "
                "single-node access modes are served (an inline volume gets SINGLE_NODE_WRITER)",
            )
        raise _invalid(f"volume_capability.access_mode is {_shown(capability.access_mode)}, not a single-node mode")
    return readonly or capability.access_mode == "SINGLE_NODE_READER_ONLY"


def _check_target(target: str, kubelet_dir: str, pod_uid: str) -> None:
    """The target must be this Pod's own CSI volume directory under the kubelet's, and nothing else."""
    shown = _shown(target, limit=MAX_BYTES)
    if not target.startswith("/"):
        raise _invalid(f"target_path {shown} is not an absolute path")
    if any(part in (".", "..") for part in target.split("/")):
        raise _invalid(f"target_path {shown} has a '.' or '..' component")
    pods = kubelet_dir.rstrip("/") + "/pods/"
    expected = f"{pods}{pod_uid}/volumes/kubernetes.io~csi/<volume>/mount"
    rest = target.removeprefix(pods).split("/") if target.startswith(pods) else []
    if not (
        len(rest) == 5
        and rest[0] == pod_uid
        and rest[1:3] == ["volumes", "kubernetes.io~csi"]
        and is_namespace_name(rest[3])  # a Pod's volume name is a DNS-1123 label
        and rest[4] == "mount"
    ):
        raise _invalid(
            f"target_path {shown} is not {expected}, this Pod's own volume directory; if the kubelet's "
            f"--root-dir is not {kubelet_dir}, set the agent's --kubelet-dir to it"
        )


class _Choices(NamedTuple):
    keep: Keep = Keep.ALWAYS
    name: str | None = None
    retention: timedelta | None = None
    sandbox: str | None = None
    read_write: bool = False


def _user_choices(attributes: Mapping[str, str]) -> _Choices:
    """keep, name, retention or sandbox, each checked; a reopen (sandbox) takes none of the others, and only a
    reopen takes readWrite ("true" or "false")."""
    sandbox = attributes.get(VOLUME_SANDBOX)
    read_write = attributes.get(VOLUME_READ_WRITE)
    if read_write is not None and sandbox is None:
        raise _invalid(
            f"volumeAttributes.{VOLUME_READ_WRITE} goes only with {VOLUME_SANDBOX} (a reopened sandbox is read-only "
            f'unless it says "true"); a captured workspace is always writable: remove {VOLUME_READ_WRITE}'
        )
    if read_write is not None and read_write not in ("true", "false"):
        raise _invalid(f'volumeAttributes.{VOLUME_READ_WRITE} is {_shown(read_write)}; write "true" or "false"')
    if sandbox is not None:
        others = [key for key in (VOLUME_KEEP, VOLUME_NAME, VOLUME_RETENTION) if key in attributes]
        if others:
            raise _invalid(
                f"volumeAttributes.{VOLUME_SANDBOX} reopens a retained sandbox and keeps nothing new, so "
                f"{' and '.join(others)} cannot go with it: remove {' and '.join(others)}, or remove "
                f"{VOLUME_SANDBOX} to capture a new workspace"
            )
        reopened = _sandbox_name(VOLUME_SANDBOX, sandbox, "a retained sandbox of this namespace")
        return _Choices(sandbox=reopened, read_write=read_write == "true")
    keep = attributes.get(VOLUME_KEEP, Keep.ALWAYS.value)
    if keep not in {k.value for k in Keep}:
        raise _invalid(
            f"volumeAttributes.{VOLUME_KEEP} is {_shown(keep)}; write {', '.join(k.value for k in Keep)} "
            "(exactly so: the case matters)"
        )
    name = attributes.get(VOLUME_NAME)
    retention = attributes.get(VOLUME_RETENTION)
    parsed = parse_duration(retention) if retention is not None else None
    if isinstance(parsed, Invalid):
        raise _invalid(f"volumeAttributes.{VOLUME_RETENTION} is {_shown(parsed.text)}: {parsed.why}")
    return _Choices(
        keep=Keep(keep),
        name=_sandbox_name(VOLUME_NAME, name, "the name the kept sandbox gets") if name is not None else None,
        retention=parsed,
    )


def _sandbox_name(key: str, value: str, what: str) -> str:
    if len(value) > MAX_SANDBOX_NAME or not is_object_name(value):
        raise _invalid(f"volumeAttributes.{key} is {_shown(value)}; it is {what} and must be {_NAME_RULE}")
    return value


def _mount_group(text: str) -> int | None:
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_MOUNT_GROUP:
        raise _invalid(f"volume_mount_group is {_shown(text)}, not a numeric group id (the Pod's fsGroup)")
    return int(text)


def _invalid(message: str) -> VolumeError:
    return VolumeError(INVALID_ARGUMENT, message)


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _shown(text: str, *, quote: bool = True, limit: int = 64) -> str:
    """A value as a message quotes it: cut to `limit` characters, control characters escaped."""
    cut = text if len(text) <= limit else text[: limit - 3] + "..."
    shown = repr(cut)[1:-1].replace('"', '\\"')
    return f'"{shown}"' if quote else shown
