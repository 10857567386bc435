"""The CSI Identity service: who the plugin is, what it serves, whether it is ready.

No CONTROLLER_SERVICE capability: sandkeep's volumes are inline ephemeral ones, which the kubelet publishes on
the node without any controller call (CSIDriver attachRequired: false).
"""

from __future__ import annotations

import grpc
from google.protobuf import wrappers_pb2

from controller import __version__
from controller.csi.proto import csi_pb2, csi_pb2_grpc
from controller.rules.contracts import CSI_DRIVER


class IdentityService(csi_pb2_grpc.IdentityServicer):
    def GetPluginInfo(
        self, request: csi_pb2.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=CSI_DRIVER, vendor_version=__version__)

    def GetPluginCapabilities(
        self, request: csi_pb2.GetPluginCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[])

    def Probe(self, request: csi_pb2.ProbeRequest, context: grpc.ServicerContext) -> csi_pb2.ProbeResponse:
        # Serving at all is being ready: the backend needs no warm-up that a publish could not wait for.
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))
