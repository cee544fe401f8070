"""The client's enqueue requests, filled in place (fill_chunk / chunks_request), carry exactly what
building each message from keyword arguments does: same bytes on the wire, same field presence
(the daemon refuses a chunk without `room`, or without `slot` and `pages`)."""

from __future__ import annotations

import pytest

from kvxfer_client import Chunk
from kvxfer_client._requests import chunk_request, chunks_request
from kvxfer_client.types import Slot
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2

CHUNKS = [
    Chunk(room=0, chunk_id=0, token_start=0, num_tokens=1, slot=Slot(0, 0, 0)),
    Chunk(room=7, chunk_id=3, token_start=48, num_tokens=16, slot=Slot(1 << 20, 5 << 20, 5 << 20), generation=2),
    Chunk(room=9, chunk_id=1, token_start=16, num_tokens=16, slot=Slot(4096, 8192, 8192), last=True, aux=b"meta"),
    Chunk(room=11, chunk_id=0, token_start=5, num_tokens=20, slot=None, pages=(3, 1, 4)),
]


def _by_keywords(engine_id: str, c: Chunk) -> engine_pb2.EnqueueChunkRequest:
    req = engine_pb2.EnqueueChunkRequest(
        engine_id=engine_id, room=common_pb2.RoomKey(id=c.room, generation=c.generation), chunk_id=c.chunk_id,
        token_start=c.token_start, num_tokens=c.num_tokens, last=c.last, aux=c.aux, pages=list(c.pages),
    )
    if c.slot is not None:
        req.slot.CopyFrom(common_pb2.Slot(offset=c.slot.offset, length=c.slot.length))
    return req


@pytest.mark.parametrize("c", CHUNKS, ids=["zeros", "generation", "last-aux", "pages"])
def test_one_request_matches_keywords(c: Chunk) -> None:
    got, want = chunk_request("eng@x", c), _by_keywords("eng@x", c)
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert got.HasField("room")
    assert got.HasField("slot") == (c.slot is not None)


def test_batch_matches_keywords() -> None:
    batch = chunks_request("eng@x", CHUNKS)
    want = engine_pb2.EnqueueChunksRequest(chunks=[_by_keywords("eng@x", c) for c in CHUNKS])
    assert batch.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert [r.HasField("slot") for r in batch.chunks] == [True, True, True, False]
    assert list(batch.chunks[3].pages) == [3, 1, 4]
