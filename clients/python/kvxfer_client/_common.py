"""Pieces shared by the sync and asyncio clients: types, request builders, the pool mapping."""

from __future__ import annotations

import enum
import json
import mmap
import os
import socket
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvxfer_client._pinned import HostPin
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2

# enqueue_many over the lane sends a batch of at least twice this many chunks as pipelined calls
# of this many each (measured: bench rpc, batches of 256).
PIPELINE_PART = 64

MAX_MESSAGE_BYTES = 4 << 20


def default_socket() -> str:
    env = os.environ.get("KVXFERD_SOCKET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "kvxferd", "kvxferd.sock")
    return f"/tmp/kvxferd-{os.getuid()}/kvxferd.sock"


def target(socket: str | None) -> str:
    """gRPC target: a Unix socket path, or HOST:PORT for a TCP engine listener."""
    path = socket or default_socket()
    if path.startswith("unix:") or (":" in path and not path.startswith("/")):
        return path
    return f"unix:{path}"


CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

Pem = str | bytes | os.PathLike[str]


def _pem(value: Pem | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as fh:
        return fh.read()


@dataclass(frozen=True)
class Tls:
    """TLS to a daemon's TCP engine listener (`listen` with `tls_*` set on the daemon).

    `ca` verifies the daemon's certificate (None: the system's roots); `cert` and `key` are this
    engine's client certificate for mutual TLS (`tls_client_auth = true`). Each is a file path or
    the PEM bytes themselves. `server_name` overrides the name checked against the daemon's
    certificate (default: the host of the address dialled).
    """

    ca: Pem | None = None
    cert: Pem | None = None
    key: Pem | None = None
    server_name: str = ""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("Tls: cert and key go together (mutual TLS), or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca), private_key=_pem(self.key), certificate_chain=_pem(self.cert)
        )

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel_args(socket: str | None, tls: Tls | None) -> tuple[str, grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """(target, credentials or None for plaintext, options) for a sync or asyncio channel."""
    dest = target(socket)
    if tls is None:
        return dest, None, list(CHANNEL_OPTIONS)
    if dest.startswith("unix:"):
        raise ValueError("TLS is for a TCP engine listener (HOST:PORT); the Unix socket is guarded by file permissions")
    return dest, tls.credentials(), [*CHANNEL_OPTIONS, *tls.options()]


def sync_channel(socket: str | None, tls: Tls | None = None) -> grpc.Channel:
    dest, creds, opts = channel_args(socket, tls)
    return grpc.secure_channel(dest, creds, options=opts) if creds else grpc.insecure_channel(dest, options=opts)


def aio_channel(socket: str | None, tls: Tls | None = None) -> grpc.aio.Channel:
    dest, creds, opts = channel_args(socket, tls)
    if creds:
        return grpc.aio.secure_channel(dest, creds, options=opts)
    return grpc.aio.insecure_channel(dest, options=opts)


class RoomState(enum.IntEnum):
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4
    FAILED = 5


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


@dataclass(frozen=True)
class Layout:
    """The model's KV layout as the engine holds it (see the proto's KVLayout)."""

    num_layers: int
    total_kv_heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int = 16
    mla: bool = False
    dtype: str = ""

    def to_pb(self) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(
            num_layers=self.num_layers, total_kv_heads=self.total_kv_heads, head_dim=self.head_dim,
            dtype_bytes=self.dtype_bytes, page_size=self.page_size, mla=self.mla, dtype=self.dtype,
        )

    def chunk_pages(self, room_pages: Sequence[int], token_start: int, num_tokens: int) -> tuple[list[int], int]:
        """A chunk's pages (those its tokens touch, from the one holding ``token_start``) and the
        offset of its first token in the first: what the kernels' ``page_ids``/``token_offset`` and
        a zero-copy ``enqueue(pages=...)`` take. Chunks may start and end anywhere in a page."""
        if token_start < 0 or num_tokens < 1:
            raise ValueError(f"bad token range [{token_start}, +{num_tokens})")
        first, offset = divmod(token_start, self.page_size)
        last = -(-(token_start + num_tokens) // self.page_size)
        if last > len(room_pages):
            raise ValueError(f"tokens up to {token_start + num_tokens} need {last} pages, the room has {len(room_pages)}")
        return list(room_pages[first:last]), offset


@dataclass(frozen=True)
class Slot:
    """A slot in this engine's ring: the chunk is written at [offset, offset + chunk_bytes)."""

    offset: int
    length: int
    chunk_bytes: int
    # The client's tag for a slot it cut out of the ring itself (claimed slots); 0: from the daemon.
    claim: int = 0


@dataclass(frozen=True)
class Landed:
    """A chunk whose every writer has landed in this reader's ring."""

    chunk_id: int
    offset: int
    length: int
    token_start: int
    num_tokens: int
    last: bool
    chunk_bytes: int


@dataclass(frozen=True)
class RoomStatus:
    room: int
    generation: int
    state: RoomState
    failure_code: str
    failure_reason: str
    landed: tuple[Landed, ...] = ()
    aux: bytes = b""
    chunks_done: int = 0
    # Zero-copy decode: FAILED, and a prefill WRITE may still land in the room's pages; reuse
    # them once this is False (release() waits for it).
    pages_fenced: bool = False

    @property
    def finished(self) -> bool:
        return self.state in (RoomState.SUCCESS, RoomState.FAILED)


@dataclass(frozen=True)
class RoomEvent:
    room: int
    generation: int
    state: RoomState
    failure_code: str = ""
    failure_reason: str = ""
    landed: Landed | None = None
    aux: bytes = b""
    # On a sending engine's events: its chunks of the room written so far.
    chunks_done: int = 0
    # As RoomStatus.pages_fenced: a fenced FAILED event is followed by one with False.
    pages_fenced: bool = False


@dataclass(frozen=True)
class Chunk:
    """One chunk to enqueue (for batched enqueue)."""

    room: int
    chunk_id: int
    token_start: int
    num_tokens: int
    slot: Slot | None
    last: bool = False
    aux: bytes = b""
    generation: int = 0
    pages: tuple[int, ...] = ()


@dataclass
class Registration:
    engine_id: str
    pool_path: str
    pool_bytes: int
    ring_offset: int
    ring_bytes: int
    lease_ms: int
    daemon_id: str
    peer_address: str
    extra: dict[str, Any] = field(default_factory=dict)
    pool_socket: str = ""
    lane_socket: str = ""
    claim_slots: bool = False
    token_bytes: int = 0
    slot_align: int = 0


def register_request(
    role: int, group: str, layout: Layout, tp_size: int, tp_rank: int, ring_bytes: int, name: str,
    lease_ms: int, cuda_ring: dict[str, Any] | None, pp_size: int = 1, pp_rank: int = 0, zero_copy: bool = False,
    claim_slots: bool = False,
) -> engine_pb2.RegisterEngineRequest:
    req = engine_pb2.RegisterEngineRequest(
        role=engine_pb2.Role.ValueType(role), group=group, layout=layout.to_pb(),
        parallel=common_pb2.Parallelism(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank),
        ring_bytes=ring_bytes, lease_ms=lease_ms, name=name, zero_copy=zero_copy, claim_slots=claim_slots,
    )
    if cuda_ring is not None:
        req.cuda_ring.CopyFrom(engine_pb2.CudaIpcRing(**cuda_ring))
        # The daemon imports the ring while we ask again: no call has to outlive the import.
        req.accept_pending = True
    return req


# How long a registration may wait for the daemon to import its GPU ring (eight ranks per side
# starting at once queue their imports); each call is short, this bounds them all.
RING_READY_TIMEOUT_S = 600.0


def still_pending(req: engine_pb2.RegisterEngineRequest, reply: engine_pb2.RegisterEngineReply, deadline: float) -> bool:
    """Whether to ask again (then ``req`` names the pending registration); raises past ``deadline``."""
    if not reply.pending:
        return False
    if time.monotonic() > deadline:
        raise KvxferError(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the daemon had not imported the GPU ring after {RING_READY_TIMEOUT_S:.0f} s")
    req.registration_id = reply.registration_id
    return True


def registration(reply: engine_pb2.RegisterEngineReply) -> Registration:
    return Registration(
        engine_id=reply.engine_id, pool_path=reply.pool_path, pool_bytes=reply.pool_bytes,
        ring_offset=reply.ring_offset, ring_bytes=reply.ring_bytes, lease_ms=reply.lease_ms,
        daemon_id=reply.daemon_id, peer_address=reply.peer_address, pool_socket=reply.pool_socket,
        lane_socket=reply.lane_socket, claim_slots=reply.claim_slots, token_bytes=reply.token_bytes,
        slot_align=reply.slot_align,
    )


def acquire_request(engine_id: str, num_tokens: int, deadline: float, call_timeout: float) -> engine_pb2.AcquireSlotRequest:
    """The daemon waits for space itself, in rounds of at most one call timeout."""
    wait_s = max(0.0, min(deadline - time.monotonic(), call_timeout))
    return engine_pb2.AcquireSlotRequest(engine_id=engine_id, num_tokens=num_tokens, wait_ms=int(wait_s * 1000))


def retry_full_or_raise(exc: KvxferError, deadline: float) -> None:
    """After an AcquireSlot round that failed (either kind of slot): raises `exc` unless the ring
    was only still full and the caller's deadline leaves time for another round."""
    if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() >= deadline:
        raise exc


# A zero-copy decode room's ReleaseRoom may wait for the page fence, which the daemon lifts
# after its credit quarantine (30 s) at the latest.
RELEASE_TIMEOUT_S = 40.0


def room_pb(room: int, generation: int = 0) -> common_pb2.RoomKey:
    return common_pb2.RoomKey(id=room, generation=generation)


def fill_chunk(req: engine_pb2.EnqueueChunkRequest, engine_id: str, c: Chunk) -> engine_pb2.EnqueueChunkRequest:
    """Sets a request's fields from a chunk, in place: a batch's entries are filled where they
    live (``batch.chunks.add()``), not built apart and copied in (half the client's cost a chunk)."""
    req.engine_id = engine_id
    req.chunk_id, req.token_start, req.num_tokens, req.last = c.chunk_id, c.token_start, c.num_tokens, c.last
    room = req.room
    room.id, room.generation = c.room, c.generation
    if c.aux:
        req.aux = c.aux
    if c.pages:
        req.pages.extend(c.pages)
    if c.slot is not None:
        slot = req.slot
        slot.offset, slot.length = c.slot.offset, c.slot.length
        if c.slot.claim:
            req.claim = c.slot.claim
    return req


def chunk_request(engine_id: str, c: Chunk) -> engine_pb2.EnqueueChunkRequest:
    return fill_chunk(engine_pb2.EnqueueChunkRequest(), engine_id, c)


def chunks_request(engine_id: str, chunks: Sequence[Chunk]) -> engine_pb2.EnqueueChunksRequest:
    batch = engine_pb2.EnqueueChunksRequest()
    add = batch.chunks.add
    for c in chunks:
        fill_chunk(add(), engine_id, c)
    return batch


def _failure_name(code: int) -> str:
    return common_pb2.FailureCode.Name(code).removeprefix("FAILURE_CODE_") if code else ""


def landed(pb: engine_pb2.LandedChunk) -> Landed:
    return Landed(pb.chunk_id, pb.slot.offset, pb.slot.length, pb.token_start, pb.num_tokens, pb.last, pb.chunk_bytes)


def room_status(pb: engine_pb2.RoomStatus) -> RoomStatus:
    return RoomStatus(
        room=pb.room.id, generation=pb.room.generation, state=RoomState(pb.state),
        failure_code=_failure_name(pb.failure_code), failure_reason=pb.failure_reason,
        landed=tuple(landed(c) for c in pb.landed), aux=bytes(pb.aux), chunks_done=pb.chunks_done,
        pages_fenced=pb.pages_fenced,
    )


def room_event(pb: engine_pb2.RoomEvent) -> RoomEvent:
    return RoomEvent(
        room=pb.room.id, generation=pb.room.generation, state=RoomState(pb.state),
        failure_code=_failure_name(pb.failure_code), failure_reason=pb.failure_reason,
        landed=landed(pb.landed) if pb.HasField("landed") else None, aux=bytes(pb.aux),
        chunks_done=pb.chunks_done, pages_fenced=pb.pages_fenced,
    )


def watermark_request(engine_id: str, room: int, chunk_ids: Iterable[int], generation: int = 0) -> engine_pb2.WatermarkRequest:
    return engine_pb2.WatermarkRequest(engine_id=engine_id, room=room_pb(room, generation), chunk_ids=list(chunk_ids))


def export_ring(ring_tensor: Any) -> dict[str, Any]:
    """CudaIpcRing fields for a contiguous CUDA tensor the engine keeps alive as its staging ring."""
    from kvxfer_protocol.cuda_ipc import export_tensor

    h = export_tensor(ring_tensor)
    return {"handle": h.handle, "device_uuid": h.device_uuid, "offset": h.offset, "size": h.size}


def bytes_tensor(ring_tensor: Any, pool: PoolMapping | None, offset: int, length: int) -> Any:
    """A uint8 torch tensor over [offset, offset+length) of the ring: GPU ring or mapped host ring."""
    import torch

    if ring_tensor is not None:
        flat = ring_tensor.view(torch.uint8).reshape(-1)
        if offset < 0 or offset + length > flat.numel():
            raise ValueError(f"[{offset}, {offset + length}) is outside the {flat.numel()} B GPU ring")
        return flat[offset : offset + length]
    if pool is None:
        raise RuntimeError("this engine has no ring mapped here")
    return torch.frombuffer(pool.view(offset, length), dtype=torch.uint8)


POOL_PROTOCOL = "kvxferd-pool/1"


def receive_pool(reg: Registration, timeout_s: float = 10.0) -> int:
    """The daemon's pool file, received over its pool socket (a pool with no path: see the proto)."""
    instance = reg.engine_id.rpartition("@")[2]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(reg.pool_socket)
            msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        except OSError as exc:
            raise KvxferError(grpc.StatusCode.UNAVAILABLE,
                              f"cannot receive the host pool from {reg.pool_socket}: {exc}") from exc
    try:
        header = json.loads(msg)
    except ValueError:
        header = {}
    if not fds or header.get("protocol") != POOL_PROTOCOL or header.get("instance") != instance \
            or header.get("bytes") != reg.pool_bytes:
        for fd in fds:
            os.close(fd)
        raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{reg.pool_socket} did not hand out this daemon's pool (got {header!r}, want instance "
                          f"{instance!r} of {reg.pool_bytes} B)")
    for extra in fds[1:]:
        os.close(extra)
    os.set_inheritable(fds[0], False)
    return fds[0]


class PoolMapping:
    """The daemon's host pool mapped into this process; the engine's ring is a window of it."""

    def __init__(self, reg: Registration, pin: bool = False) -> None:
        fd = receive_pool(reg) if reg.pool_socket else os.open(reg.pool_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            # Not a file the daemon made (replaced, truncated): refuse now, not SIGBUS on first touch.
            if not stat.S_ISREG(st.st_mode) or st.st_size < reg.pool_bytes:
                raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"host pool {reg.pool_path or reg.pool_socket} is not the daemon's "
                                  f"{reg.pool_bytes} B pool file")
            self._mm = mmap.mmap(fd, reg.pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # A GPU engine's host ring: page-locked here so its kernels reach it at copy-engine speed.
        self.pin = HostPin(self._mm, reg.ring_offset, reg.ring_bytes) if pin else None
        self._ring = memoryview(self._mm)[reg.ring_offset : reg.ring_offset + reg.ring_bytes]
        self.ring_bytes = reg.ring_bytes

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.ring_bytes:
            raise ValueError(f"[{offset}, {offset + length}) is outside this engine's ring of {self.ring_bytes} B")
        return self._ring[offset : offset + length]

    def close(self) -> None:
        if self.pin is not None:
            self.pin.close()
            self.pin = None
        self._ring.release()
        try:
            self._mm.close()
        except BufferError:
            # A caller still holds a view (e.g. a numpy array); the OS unmaps at exit.
            pass
