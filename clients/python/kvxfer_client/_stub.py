"""RoutedStub: the Engine stub an engine client calls, over the lane where the daemon serves the
method there, else over gRPC."""

from __future__ import annotations

from typing import Any

from kvxfer_client._aio_lane import AioLane
from kvxfer_client._lane import LANE_METHODS, SyncLane


class RoutedStub:
    """An EngineStub look-alike: `stub.X(req, timeout=...)` goes over the lane when the lane
    serves X, else over gRPC."""

    def __init__(self, grpc_stub: Any, lane: SyncLane | AioLane | None = None) -> None:
        self._grpc = grpc_stub
        self.lane = lane

    def __getattr__(self, name: str) -> Any:
        lane = self.lane
        if lane is not None and name in LANE_METHODS:
            return lambda req, timeout=None: lane.call(name, req, timeout)
        return getattr(self._grpc, name)
