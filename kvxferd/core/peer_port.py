"""What the room logic needs from a peer daemon, as a protocol.

The send and receive sides talk to a peer only through these methods (each queues one message
on the pair's control stream; nothing here waits for an answer), so they never import the
peer-link module and the link never imports them: the peer layer sits above the room layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvxfer_protocol.slot_layout import KVLayout
from kvxferd.core.types import FailureCode, RoomKey, ZeroCopyTarget


@dataclass(frozen=True)
class LocalRing:
    """A reader's GPU ring as another process of this host opens it (kvxferd.transports.local_ipc)."""

    handle: bytes  # the engine's CUDA IPC handle of its allocation
    device_uuid: str
    size: int  # ring bytes
    offset: int  # where the ring starts in the allocation
    base: int  # the ring's address in the granting daemon


@dataclass(frozen=True)
class CreditSpec:
    """A window of a reader ring granted to one prefill daemon (see credits.py)."""

    id: int
    ring: str
    address: int
    length: int
    mem: str
    device: int
    local: LocalRing | None = None  # same-host peers only: copy device to device, not over NIXL


@dataclass(frozen=True)
class BootstrapMsg:
    room: RoomKey
    group: str
    reader: int
    decode_tp: int
    layout: KVLayout
    num_tokens: int
    deadline_unix_ms: int
    reader_ring: str
    zero_copy: ZeroCopyTarget | None = None
    notif_token: bytes = b""  # the room's (kvxferd.datapath.notif): its writer puts it in every notification
    layer_parts: bool = False  # the reader's engine scatters layer parts (protocol 1.1)


@dataclass(frozen=True)
class BootstrapAnswer:
    room: RoomKey
    reader: int
    code: int  # 0 = accepted, else a grpc status code
    message: str = ""
    prefill_tp: int = 0
    layout: KVLayout | None = None
    zero_copy: bool = False


class Link(Protocol):
    """One peer daemon as the room logic sees it."""

    daemon_id: str
    instance_id: str
    address: str
    agent_name: str
    is_self: bool
    up: bool

    def send_bootstrap(self, msg: BootstrapMsg) -> None: ...

    def send_bootstrap_reply(self, ans: BootstrapAnswer) -> None: ...

    def send_grant(self, credits: Sequence[CreditSpec]) -> None: ...

    def send_credit_request(self, ring: str, nbytes: int) -> None: ...

    def send_credit_return(self, ids: Sequence[int]) -> None: ...

    def send_revoke(self, ids: Sequence[int], reason: str) -> None: ...

    def send_reclaim(self, ring: str) -> None: ...

    def send_release(self, ranges: Sequence[tuple[int, int]] = (), rooms: Sequence[RoomKey] = ()) -> None: ...

    def send_complete(self, room: RoomKey, reader: int, num_chunks: int, aux: bytes) -> None: ...

    def send_complete_ack(self, room: RoomKey, reader: int, code: int, message: str = "") -> None: ...

    def send_abort(self, room: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> None: ...


class Identity:
    """This daemon as its peers know it. `address` and `daemon_id` are final once the peer port is
    bound; `md_epoch` is bumped whenever memory is registered with NIXL after start (a GPU ring):
    peers must get our metadata again before they can WRITE into it."""

    def __init__(self, daemon_id: str, instance_id: str) -> None:
        self.daemon_id = daemon_id
        self.instance_id = instance_id
        self.address = ""
        self.stream_address = ""  # the framed control stream's HOST:PORT ("" when off)
        self.md_epoch = 0
