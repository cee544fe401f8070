"""The client's errors: KvxferError and its kinds, each with the daemon's gRPC status code."""

from __future__ import annotations

import grpc

from kvxfer_client.types import Slot
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2


class KvxferError(Exception):
    """A call the daemon refused; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class ReplyLost(KvxferError):
    """The connection to the daemon went (or fell silent) before a call's reply came: whether
    the daemon carried the call out is unknown."""


class NotSent(KvxferError):
    """The call never left this process (no connection to the daemon's lane could be made, or
    the client is closed): the daemon did nothing for it."""


class ChunkRefused(KvxferError):
    """A chunk sent with enqueue(wait=False) that did not go in. Unless `lost`, the daemon refused
    it (`code` and the message are the daemon's): it changed nothing for it, and the chunk's slot
    is still the engine's. `lost`: the verdict went with the connection (UNAVAILABLE or
    DEADLINE_EXCEEDED from the client); the chunk may have been taken (the room's events say)."""

    def __init__(self, room: int, chunk_id: int, slot: Slot | None, cause: KvxferError) -> None:
        super().__init__(cause.code, f"room {room} chunk {chunk_id}: {cause.message}")
        self.room = room
        self.chunk_id = chunk_id
        self.slot = slot
        self.lost = isinstance(cause, ReplyLost)


class RoomFailed(KvxferError):
    """The room ended FAILED; `failure_code` and `reason` say why (both sides see the same)."""

    def __init__(self, room: int, failure_code: str, reason: str) -> None:
        super().__init__(grpc.StatusCode.ABORTED, f"room {room} failed ({failure_code}): {reason}")
        self.room = room
        self.failure_code = failure_code
        self.reason = reason


_STATUS_BY_VALUE = {sc.value[0]: sc for sc in grpc.StatusCode}


def enqueue_results(reply: engine_pb2.EnqueueChunksReply) -> list[KvxferError | None]:
    """None per accepted chunk of a batched enqueue, else its error with the status code."""
    return [
        None if r.code == 0 else KvxferError(_STATUS_BY_VALUE.get(r.code, grpc.StatusCode.UNKNOWN), r.message)
        for r in reply.results
    ]


def wrap_rpc_error(exc: grpc.RpcError) -> KvxferError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return KvxferError(code, details or "")
