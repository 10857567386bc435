"""What the CSI tests share: a recording in-memory backend, short socket directories, and the kubelet's requests.

`RecordingVolumes` stands in for controller/node/capture.py's `Volumes` in the protocol tests only: it keeps
what was published in a dict and follows the backend contract (idempotent publish at one path, ALREADY_EXISTS
at another, unpublish of anything is a success), so what is tested here is the gRPC half alone.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from controller.csi.proto import csi_pb2, csi_pb2_grpc
from controller.rules.volume import ALREADY_EXISTS, VolumeError, VolumeRequest
from tests.unit.test_volume import POD, TARGET, VOLUME_ID

REGISTRATION_PATH = "/var/lib/kubelet/plugins/csi.sandkeep.io/csi.sock"  # the plugin's socket as the kubelet sees it


class RecordingVolumes:
    """An in-memory VolumeBackend that records each call (for protocol tests; never the real disk work)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []  # (publish|unpublish, volume id, target path)
        self.requests: list[VolumeRequest] = []
        self.published: dict[str, str] = {}  # volume id -> target path
        self.fail: BaseException | None = None  # raised by the next calls, when set
        self.gate: threading.Event | None = None  # when set, each call waits for it (calls held in flight)
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def publish(self, req: VolumeRequest) -> None:
        with self._entered("publish", req.volume_id, req.target_path):
            self.requests.append(req)
            at = self.published.get(req.volume_id)
            if at is not None and at != req.target_path:
                raise VolumeError(ALREADY_EXISTS, f"volume {req.volume_id} is already published at {at}")
            self.published[req.volume_id] = req.target_path

    def unpublish(self, volume_id: str, target_path: str) -> None:
        with self._entered("unpublish", volume_id, target_path):
            self.published.pop(volume_id, None)

    @contextmanager
    def _entered(self, call: str, volume_id: str, target_path: str) -> Iterator[None]:
        with self._lock:
            self.calls.append((call, volume_id, target_path))
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.gate is not None:
                self.gate.wait(30)
            if self.fail is not None:
                raise self.fail
            yield
        finally:
            with self._lock:
                self.running -= 1


@contextmanager
def socket_dir() -> Iterator[Path]:
    """A short directory for sockets: a unix socket's path must fit in 107 bytes, and tmp_path's may not."""
    path = Path(tempfile.mkdtemp(prefix="skcsi-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def channel(path: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{path}")


def node_stub(path: Path) -> csi_pb2_grpc.NodeStub:
    return csi_pb2_grpc.NodeStub(channel(path))


def publish_request(
    volume_id: str = VOLUME_ID,
    target: str = TARGET,
    attributes: dict[str, str] | None = None,
    *,
    readonly: bool = False,
    secrets: dict[str, str] | None = None,
    mode: int = csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER,
) -> csi_pb2.NodePublishVolumeRequest:
    """A NodePublishVolume as the kubelet sends one for an inline ephemeral volume with podInfoOnMount."""
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id,
        target_path=target,
        volume_capability=csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode),
        ),
        readonly=readonly,
        volume_context={**POD, **(attributes or {})},
        secrets=secrets or {},
    )
