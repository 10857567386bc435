"""The CSI Node service: publish and unpublish inline ephemeral volumes through a backend; the rest UNIMPLEMENTED.

Each RPC checks its request first (`controller/rules/volume.py`) and answers with the gRPC status the CSI spec
names. What a publish does on disk is the backend's (`VolumeBackend`); here a call is only serialised per volume
id, timed into the log, and every failure turned into a status the kubelet shows in the Pod's Events: a
`VolumeError` as its own code and message, anything else as INTERNAL with a short message (never a traceback),
logged with the volume id and the Pod. The request's `secrets` are never read, so never logged.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from controller.csi.proto import csi_pb2, csi_pb2_grpc
from controller.observe import logs
from controller.rules.contracts import POD_INFO_NAME, POD_INFO_NAMESPACE, Reason
from controller.rules.objects import Obj
from controller.rules.reopen import volume_refusal
from controller.rules.volume import (
    INTERNAL,
    Capability,
    VolumeError,
    VolumeRequest,
    parse_publish,
    parse_unpublish,
)

log = logging.getLogger("sandkeep.csi")

# What the Node service advertises: VOLUME_MOUNT_GROUP alone. Inline ephemeral volumes need no STAGE_UNSTAGE
# (there is nothing to stage) and no GET_VOLUME_STATS. With VOLUME_MOUNT_GROUP (and the CSIDriver's fsGroupPolicy
# File) the kubelet hands the Pod's fsGroup to the publish as volume_mount_group and does not chown the volume
# itself: a fresh workspace is made group-writable for it, and a reopened one is never chowned file by file.
NODE_CAPABILITIES: tuple[csi_pb2.NodeServiceCapability.RPC.Type, ...] = (
    csi_pb2.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP,
)
_POD_UID_IN_PATH = re.compile(r"/pods/([^/]{1,64})/volumes/")


class VolumeBackend(Protocol):
    """What publishes and unpublishes on disk (controller/node/capture.py's `Volumes`). Both calls block.

    `publish` is idempotent for the same volume id and target path, and raises VolumeError ALREADY_EXISTS for
    the same id at another path; `unpublish` is idempotent, and an unknown volume id is a success.
    """

    def publish(self, req: VolumeRequest) -> None: ...

    def unpublish(self, volume_id: str, target_path: str) -> None: ...


# A RetainedSandbox as the API server has it now (None: it does not exist); raises when the API cannot say.
SandboxLookup = Callable[[str, str], Obj | None]
UNAVAILABLE = "UNAVAILABLE"


class NodeService(csi_pb2_grpc.NodeServicer):
    def __init__(
        self, node: str, backend: VolumeBackend, kubelet_dir: str, sandboxes: SandboxLookup | None = None
    ) -> None:
        self.node = node
        self.backend = backend
        self.kubelet_dir = kubelet_dir
        self.sandboxes = sandboxes  # None: no API access, so every reopen is refused (UNAVAILABLE)
        self.serial = Serial()
        self.pods: dict[str, str] = {}  # volume id -> `namespace/name` of its Pod, from the publish (for the log)

    def NodeGetCapabilities(
        self, request: csi_pb2.NodeGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetCapabilitiesResponse:
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[
                csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=t)) for t in NODE_CAPABILITIES
            ]
        )

    def NodeGetInfo(
        self, request: csi_pb2.NodeGetInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self.node)  # max_volumes_per_node 0: no limit

    def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodePublishVolumeResponse:
        attributes = dict(request.volume_context)
        pod = _pod_of(attributes)

        def publish() -> dict[str, Any]:
            req = parse_publish(
                request.volume_id,
                request.target_path,
                _capability(request) if request.HasField("volume_capability") else None,
                request.readonly,
                attributes,
                self.kubelet_dir,
            )
            if req.sandbox is not None:
                self._may_reopen(req.pod_namespace, req.sandbox)
            self.backend.publish(req)
            self.pods[req.volume_id] = pod
            return {"keep": None if req.sandbox else req.keep, "sandbox": req.sandbox, "read_only": req.read_only}

        self._answer(context, "volume_published", request.volume_id, pod, publish)
        return csi_pb2.NodePublishVolumeResponse()

    def _may_reopen(self, namespace: str, name: str) -> None:
        """Refuse a reopen `kubectl sandkeep open` would refuse (rules/reopen.py), or one on another node; fail
        closed (UNAVAILABLE, which the kubelet retries) when the API cannot say."""
        if self.sandboxes is None:
            raise VolumeError(
                UNAVAILABLE, f"RetainedSandbox {namespace}/{name}: sandkeep's node plugin has no API access to check it"
            )
        try:
            sandbox = self.sandboxes(namespace, name)
        except Exception as err:
            raise VolumeError(
                UNAVAILABLE,
                f"RetainedSandbox {namespace}/{name} could not be read from the API ({str(err)[:200]}); the kubelet "
                "retries",
            ) from err
        refusal = volume_refusal(sandbox, namespace, name, self.node)
        if refusal is not None:
            raise VolumeError(*refusal)

    def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        pod = self.pods.get(request.volume_id) or _pod_uid_of(request.target_path)

        def unpublish() -> dict[str, Any]:
            volume_id, target_path = parse_unpublish(request.volume_id, request.target_path)
            self.backend.unpublish(volume_id, target_path)
            self.pods.pop(volume_id, None)
            return {}

        self._answer(context, "volume_unpublished", request.volume_id, pod, unpublish)
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _answer(
        self,
        context: grpc.ServicerContext,
        event: str,
        volume_id: str,
        pod: str,
        work: Callable[[], dict[str, Any]],
    ) -> None:
        """Run `work` (one call per volume id at a time) and log it; a failure aborts the RPC with its status."""
        volume = volume_id[:128]
        about = {"rpc": event, "volume": volume, "pod": pod}
        started = time.monotonic()
        try:
            with self.serial.hold(volume_id):
                said = work()
        except VolumeError as err:
            refusal = {"code": err.code, "message": err.message}
            logs.say(log, "volume_refused", level=logging.WARNING, reason=Reason.VOLUME_REFUSED, **about, **refusal)
            context.abort(_status(err.code), err.message)
        except Exception as err:
            logs.say(
                log, "volume_failed", level=logging.ERROR, reason=Reason.AGENT_ERROR, **about, error=repr(err)[:500]
            )
            log.debug("%s of volume %s failed", event, volume, exc_info=True)
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"sandkeep's node plugin failed ({type(err).__name__}); the sandkeep agent's log on this node "
                f"has the details under volume={volume}",
            )
        else:
            ms = round((time.monotonic() - started) * 1000)
            logs.say(log, event, volume=volume, pod=pod, ms=ms, **said)


class Serial:
    """One call at a time per volume id.

    The kubelet retries a publish or unpublish whose deadline passed, and the first call's thread does not stop
    with its deadline: the retry waits for it here instead of racing it in the backend.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[str, tuple[threading.Lock, int]] = {}  # volume id -> its lock, calls holding or waiting

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._held.get(key, (threading.Lock(), 0))
            self._held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._held[key]
                if users == 1:
                    del self._held[key]
                else:
                    self._held[key] = (lock, users - 1)

    def __len__(self) -> int:
        with self._guard:
            return len(self._held)


def _capability(request: csi_pb2.NodePublishVolumeRequest) -> Capability:
    cap = request.volume_capability
    mode = cap.access_mode.mode
    try:
        mode_name = csi_pb2.VolumeCapability.AccessMode.Mode.Name(mode)
    except ValueError:  # a mode of a newer spec than ours
        mode_name = f"mode {int(mode)}"
    return Capability(
        access_type=cap.WhichOneof("access_type"),
        access_mode=mode_name,
        mount_group=cap.mount.volume_mount_group if cap.HasField("mount") else "",
    )


def _status(code: str) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[code]
    except KeyError:
        return grpc.StatusCode[INTERNAL]


def _pod_of(attributes: dict[str, str]) -> str:
    """`namespace/name` of the Pod a publish says it is for, as the log shows it (unchecked, cut short)."""
    return f"{attributes.get(POD_INFO_NAMESPACE, '?')[:63]}/{attributes.get(POD_INFO_NAME, '?')[:253]}"


def _pod_uid_of(target_path: str) -> str:
    """The Pod an unpublish is for, when this process did not see its publish: `uid:<uid>` from the path."""
    match = _POD_UID_IN_PATH.search(target_path)
    return f"uid:{match.group(1)}" if match else "?"
