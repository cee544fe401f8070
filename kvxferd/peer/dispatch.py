"""What a peer's stream carries, routed to the domain: protobuf messages in, PeerInbox calls out.

Every room, credit and range message is handed over with the link it came on; the domain checks
it against the peer that owns the room or credit (a message about another peer's room changes
nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2
from kvxferd.core.pb_convert import layout, room_key, zero_copy_target
from kvxferd.core.peer_port import BootstrapAnswer, BootstrapMsg, CreditSpec, Link, LocalRing
from kvxferd.core.types import FailureCode, RoomKey
from kvxferd.errors import InvalidArgument, KvxferError
from kvxferd.peer.link import PeerLink
from kvxferd.transports.local_ipc import same_host, valid_local

_MEMS = ("DRAM", "VRAM")


class PeerInbox(Protocol):
    """What the peer layer delivers to the domain (kvxferd.core.node.Node implements it)."""

    def on_bootstrap(self, peer: Link, m: BootstrapMsg) -> BootstrapAnswer: ...

    def on_bootstrap_reply(self, peer: Link, ans: BootstrapAnswer) -> None: ...

    def on_credit_request(self, peer: Link, ring: str, nbytes: int) -> None: ...

    def on_credit_return(self, peer: Link, ids: list[int]) -> None: ...

    def on_complete(self, peer: Link, key: RoomKey, reader: int, num_chunks: int, aux: bytes) -> tuple[int, str]: ...

    def on_complete_ack(self, peer: Link, key: RoomKey, reader: int, code: int, message: str) -> None: ...

    def on_abort(self, peer: Link, key: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> None: ...

    def on_peer_lost(self, peer: Link, reason: str) -> None: ...

    def on_peer_back(self, peer: Link, old_instance: str) -> None: ...

    def on_peer_gone(self, peer: Link, instance: str) -> None: ...


def _failure_code(value: int) -> FailureCode:
    try:
        return FailureCode(value)
    except ValueError:
        return FailureCode.UNSPECIFIED


def _with_local(h: PeerLink, spec: CreditSpec, loc: peer_pb2.LocalRing | None) -> CreditSpec:
    """A credit's CUDA IPC ring counts only from a peer that proved it is on this host, and only
    when the window lies inside it; otherwise the credit is written over NIXL."""
    if loc is None or not same_host(h.daemon_id, h.instance_id):
        return spec
    ring = LocalRing(bytes(loc.handle), loc.device_uuid, loc.size, loc.offset, loc.base)
    with_ring = dataclasses.replace(spec, local=ring)
    return with_ring if valid_local(with_ring) else spec


def dispatch(inbox: PeerInbox, h: PeerLink, msg: peer_pb2.PeerMsg) -> None:
    """Hands one message of a peer's stream to the domain; answers that go back on the stream are queued on `h`."""
    kind = msg.WhichOneof("body")
    if kind == "bootstrap":
        b = msg.bootstrap
        key = room_key(b.room)
        try:
            m = BootstrapMsg(key, b.prefill_group, b.reader_rank, b.decode_tp, layout(b.layout), b.num_tokens,
                             b.deadline_unix_ms, b.reader_ring,
                             zero_copy_target(b.zero_copy) if b.HasField("zero_copy") else None, bytes(b.notif_token),
                             b.layer_parts)
            ans = inbox.on_bootstrap(h, m)
        except KvxferError as exc:
            ans = BootstrapAnswer(key, b.reader_rank, exc.code, str(exc))
        h.send_bootstrap_reply(ans)
    elif kind == "bootstrap_reply":
        r = msg.bootstrap_reply
        lay = layout(r.layout) if r.HasField("layout") and r.code == 0 else None
        inbox.on_bootstrap_reply(h, BootstrapAnswer(room_key(r.room), r.reader_rank, r.code, r.message,
                                                    r.prefill_tp, lay, r.zero_copy))
    elif kind == "grant":
        specs = []
        for c in msg.grant.credits:
            if c.length <= 0 or len(c.ring) > 128 or (c.mem or "DRAM") not in _MEMS:
                raise InvalidArgument(f"malformed credit {c.id}")
            specs.append(_with_local(h, CreditSpec(c.id, c.ring, c.address, c.length, c.mem or "DRAM", c.device),
                                     c.local if c.HasField("local") else None))
        h.window.add(specs)
    elif kind == "credit_request":
        inbox.on_credit_request(h, msg.credit_request.ring, msg.credit_request.bytes)
    elif kind == "credit_return":
        inbox.on_credit_return(h, list(msg.credit_return.ids))
    elif kind == "revoke":
        h.window.revoke(list(msg.revoke.ids))
    elif kind == "reclaim":
        h.window.reclaim(msg.reclaim.ring)
    elif kind == "release":
        rel = msg.release
        h.window.release([(r.credit_id, r.offset) for r in rel.ranges], [room_key(k) for k in rel.rooms])
    elif kind == "complete":
        c = msg.complete
        key = room_key(c.room)
        code, text = inbox.on_complete(h, key, c.reader_rank, c.num_chunks, bytes(c.aux))
        h.send_complete_ack(key, c.reader_rank, code, text)
    elif kind == "complete_ack":
        a = msg.complete_ack
        inbox.on_complete_ack(h, room_key(a.room), a.reader_rank, a.code, a.message)
    elif kind == "abort":
        a = msg.abort
        inbox.on_abort(h, room_key(a.room), _failure_code(a.code), a.reason[:1000], a.quiesced)
