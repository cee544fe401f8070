"""The clients' layer parts (issue #37, docs/design/layerwise.md §2): part and seal requests, the
checks that refuse a bad part before anything is sent, a claimed slot handed over once by a
chunk's parts and settled by all their verdicts, and layer events read back. The parts moving
real bytes between daemons are tests/test_layer_parts.py."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvxfer_client import Chunk, KvxferError, Layout
from kvxfer_client._claims import HELD, LOCAL, LOST, SENT, ClaimRing
from kvxfer_client._parts import PartClaims, PartSender, check_parts, layer_part, seal_part
from kvxfer_client._requests import chunks_request, landed, register_request, watch_request
from kvxfer_client.errors import ChunkRefused, ReplyLost
from kvxfer_client.types import Slot
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2

LAYOUT = Layout(num_layers=7, total_kv_heads=2, head_dim=8, dtype_bytes=2, page_size=4, dtype="bfloat16")
SLOT = Slot(4096, 8192, 7000)
REFUSED = KvxferError(grpc.StatusCode.ALREADY_EXISTS, "layers [0, 3) of chunk 0 were enqueued already")


def test_parts_and_seal_on_the_wire() -> None:
    parts = [layer_part(5, 2, 64, 32, SLOT, 3, 0, 6, generation=1), seal_part(LAYOUT, 5, 2, 64, 32, 3, aux=b"tok")]
    check_parts(LAYOUT, parts)
    batch = chunks_request("eng", parts)
    p, s = batch.chunks
    assert (p.layer_group, p.layer_start, p.layer_end, p.chunk_id, p.token_start, p.num_tokens) == (3, 0, 6, 2, 64, 32)
    assert (p.room.id, p.room.generation, p.slot.offset, p.slot.length, p.last, p.aux) == (5, 1, 4096, 8192, False, b"")
    assert (s.layer_group, s.layer_start, s.layer_end, s.last, s.aux) == (3, 7, 7, True, b"tok")
    assert not s.HasField("slot") and list(s.pages) == []
    # A whole chunk is byte-identical to protocol 1.0's: no layer field set.
    whole = chunks_request("eng", [Chunk(5, 2, 64, 32, SLOT)]).chunks[0]
    assert not (whole.layer_group or whole.layer_start or whole.layer_end)
    assert engine_pb2.EnqueueChunkRequest.FromString(whole.SerializeToString()).ListFields() == whole.ListFields()


def test_opt_ins_on_the_wire() -> None:
    assert register_request(engine_pb2.ROLE_DECODE, "g", LAYOUT, 1, 0, 1 << 20, "", 0, None, layer_parts=True).layer_parts
    assert not register_request(engine_pb2.ROLE_DECODE, "g", LAYOUT, 1, 0, 1 << 20, "", 0, None).layer_parts
    req = watch_request("eng", False, True)
    assert (req.engine_id, req.chunk_progress, req.layer_progress) == ("eng", False, True)


@pytest.mark.parametrize(("part", "why"), [
    (layer_part(1, 0, 0, 8, SLOT, 0, 0, 3), "layer_group >= 1"),
    (layer_part(1, 0, 0, 8, SLOT, 3, 1, 3), "do not start and end on groups of 3"),
    (layer_part(1, 0, 0, 8, SLOT, 3, 0, 5), "do not start and end on groups of 3"),
    (layer_part(1, 0, 0, 8, SLOT, 3, 3, 3), "not a non-empty range"),
    (layer_part(1, 0, 0, 8, SLOT, 3, 6, 8), "not a non-empty range of the 7 layers"),
    (Chunk(1, 0, 0, 8, SLOT, layer_group=3, layer_start=7, layer_end=7), "a seal carries no slot"),
    (Chunk(1, 0, 0, 8, SLOT, last=True, layer_group=3, layer_start=0, layer_end=3), "on its seal only"),
    (Chunk(1, 0, 0, 8, SLOT, aux=b"x", layer_group=3, layer_start=6, layer_end=7), "on its seal only"),
], ids=["no-group", "misaligned-start", "misaligned-end", "empty", "past-the-end", "seal-slot", "last", "aux"])
def test_a_bad_part_is_refused_before_anything_is_sent(part: Chunk, why: str) -> None:
    ring = ClaimRing(1 << 20, 256, 64)
    claimed = ring.cut(8)
    assert claimed is not None
    sender = PartSender(LAYOUT, ring)
    good = layer_part(2, 0, 0, 8, claimed, 3, 0, 3)
    with pytest.raises(KvxferError, match=why) as exc:
        sender.prepare("eng", [good, part])
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "room 1 chunk 0" in exc.value.message
    assert ring.states()[LOCAL] == 1  # the good part's claim was not sent either


def test_a_claim_goes_with_the_first_part_and_stays_sent_until_every_verdict() -> None:
    ring = ClaimRing(1 << 20, 256, 64)
    slot = ring.cut(8)
    assert slot is not None
    pc = PartClaims(ring, LAYOUT.num_layers)
    a, b, c = (layer_part(1, 0, 0, 8, slot, 3, lo, min(7, lo + 3)) for lo in (0, 3, 6))
    assert pc.send([a, b]) == [None, None]
    assert ring.states()[SENT] == 1
    # a refused, b still out: the slot may be the daemon's through b, so it is not the engine's.
    pc.settle([a], [REFUSED])
    assert ring.states()[SENT] == 1
    with pytest.raises(KvxferError, match="not the engine's to release"):
        ring.release(slot.claim)
    pc.settle([b], [None])  # b went in: the daemon holds the slot
    assert ring.states()[HELD] == 1
    assert pc.send([c, a]) == [None, None]  # later parts (a again) ride on the held claim
    pc.settle([c, a], [None, None])
    # Every layer went in: the claim is forgotten here, a further part with it is refused unsent.
    (err,) = pc.send([c])
    assert err is not None and "already enqueued" in err.message
    pc.settle([], [], freed=[slot.claim])
    assert ring.states() == {LOCAL: 0, SENT: 0, HELD: 0, LOST: 0} and ring.free_bytes() == 1 << 20


def test_a_claim_none_of_whose_parts_went_in_is_the_engines_again() -> None:
    ring = ClaimRing(1 << 20, 256, 64)
    s1, s2 = ring.cut(8), ring.cut(8)
    assert s1 is not None and s2 is not None
    pc = PartClaims(ring, LAYOUT.num_layers)
    p1 = [layer_part(1, 0, 0, 8, s1, 3, 0, 3), layer_part(1, 0, 0, 8, s1, 3, 3, 6)]
    assert pc.send(p1) == [None, None]
    pc.settle(p1, [REFUSED, REFUSED])
    assert ring.states()[LOCAL] == 2  # refused by the daemon: s1 is back, s2 never left
    ring.release(s1.claim)
    # A lost call (the connection went) may have gone in: only the daemon's word frees the slot.
    p2 = [layer_part(2, 0, 0, 8, s2, 3, 0, 3)]
    assert pc.send(p2) == [None]
    pc.settle(p2, ReplyLost(grpc.StatusCode.UNAVAILABLE, "lane gone"))
    assert ring.states()[LOST] == 1
    # Sending it again is allowed (the daemon refuses an overlap if the first went in).
    assert pc.send(p2) == [None]
    pc.settle(p2, [None])
    assert ring.states()[HELD] == 1


def test_deferred_verdicts_reach_the_sending_thread() -> None:
    ring = ClaimRing(1 << 20, 256, 64)
    slot = ring.cut(8)
    assert slot is not None
    sender = PartSender(LAYOUT, ring)
    parts = [layer_part(4, 1, 8, 8, slot, 3, 0, 3), layer_part(4, 1, 8, 8, slot, 3, 3, 6)]
    call = sender.prepare("eng", parts)
    assert call.request is not None and len(call.request.chunks) == 2
    reply = engine_pb2.EnqueueChunksReply(results=[
        engine_pb2.EnqueueChunkReply(code=0, freed_claims=[99]),
        engine_pb2.EnqueueChunkReply(code=grpc.StatusCode.ALREADY_EXISTS.value[0], message="twice"),
    ])
    sender.on_reply(call, threading.get_ident())(reply)
    (refused,) = sender.refusals.take()
    assert isinstance(refused, ChunkRefused) and (refused.room, refused.chunk_id, refused.slot) == (4, 1, slot)
    assert refused.code == grpc.StatusCode.ALREADY_EXISTS and not refused.lost
    assert sender.refusals.take() == []
    assert ring.states()[HELD] == 1  # the first part went in


def test_layer_events_read_back() -> None:
    def pb(**kw: object) -> engine_pb2.LandedChunk:
        return engine_pb2.LandedChunk(chunk_id=3, slot=common_pb2.Slot(offset=512, length=1024), token_start=16,
                                      num_tokens=8, chunk_bytes=1000, **kw)  # type: ignore[arg-type]

    part = landed(pb(layer_group=3, layer_start=3, layer_end=6))
    assert (part.layer_group, part.layers(7), part.chunk_complete) == (3, (3, 6), False)
    done = landed(pb(layer_group=3, layer_start=6, layer_end=7, chunk_complete=True))
    assert (done.layers(7), done.chunk_complete) == ((6, 7), True)
    # Outside layer_progress, and from a 1.0 daemon (which names no layers): a complete chunk.
    old = landed(pb())
    assert (old.layers(7), old.chunk_complete, old.offset, old.chunk_bytes) == ((0, 7), True, 512, 1000)
