"""What a send room admits, checked before anything changes: a decode reader at its Bootstrap, and a
layer part (docs/design/layerwise.md §2, "Refused") at its enqueue. Each check raises
InvalidArgument, FailedPrecondition or AlreadyExists naming why, or returns having changed nothing.
"""

from __future__ import annotations

from kvxfer_protocol.slot_layout import KVLayout, group_of, rank_heads
from kvxferd.core.rooms import OutChunk, SendRoom
from kvxferd.core.types import ChunkSpec, EngineSpec, RoomKey, ZeroCopyTarget
from kvxferd.datapath.parts import check_layer_part, chunk_group
from kvxferd.errors import AlreadyExists, FailedPrecondition, InvalidArgument


def layouts_compatible(a: KVLayout, b: KVLayout) -> str:
    """Empty string if prefill and decode layouts can exchange KV, else why not."""
    for name in ("num_layers", "total_kv_heads", "head_dim", "dtype_bytes", "mla"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} differs: prefill {getattr(a, name)} vs decode {getattr(b, name)}"
    return ""


def check_reader(room: SendRoom | None, spec: EngineSpec, key: RoomKey, reader: int, decode_tp: int,
                 layout: KVLayout, num_tokens: int, zero_copy: ZeroCopyTarget | None) -> None:
    """Can this reader join the room (`room`, or a new one of the group whose engine spec is
    `spec`)? Raises InvalidArgument or FailedPrecondition; changes nothing."""
    ours = room.layout if room is not None else spec.layout
    assert ours is not None
    why = layouts_compatible(ours, layout)
    if why:
        raise FailedPrecondition(f"room {key}: layout mismatch: {why}")
    try:
        rank_heads(layout.total_kv_heads, decode_tp, reader, layout.mla)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    if room is not None and room.has_parts and reader not in room.layer_readers:
        raise FailedPrecondition(f"room {key}: its chunks go as layer parts, but " + (
            f"decode rank {reader} of room {key} takes no layer parts (engine or daemon older than protocol 1.1)"))
    if spec.zero_copy != (zero_copy is not None):
        why = "prefill group is zero-copy but the reader is not" if spec.zero_copy else (
            "reader is zero-copy but the prefill group sends slots")
        raise FailedPrecondition(f"room {key}: zero-copy mismatch: {why}")
    prefill_tp = room.prefill_tp if room is not None else spec.parallel.tp_size
    if zero_copy is not None:
        if prefill_tp != decode_tp and not layout.mla:
            raise FailedPrecondition(
                f"room {key}: zero-copy needs the same TP on both sides (or MLA); "
                f"prefill {prefill_tp}, decode {decode_tp}"
            )
        if layout.page_size != ours.page_size:
            raise FailedPrecondition(f"room {key}: zero-copy needs equal page sizes")
        if len(zero_copy.pages) != -(-num_tokens // layout.page_size) or zero_copy.num_slots <= 0:
            raise InvalidArgument(f"room {key}: zero-copy target pages do not cover {num_tokens} tokens")
    if room is None:
        return
    if room.decode_tp is not None and room.decode_tp != decode_tp:
        raise InvalidArgument(f"room {key}: decode_tp {decode_tp} differs from {room.decode_tp}")
    if room.num_tokens is not None and room.num_tokens != num_tokens:
        raise InvalidArgument(f"room {key}: num_tokens {num_tokens} differs from {room.num_tokens}")
    if any(c.spec.token_start + c.spec.num_tokens > num_tokens for w in room.writers.values()
           for c in w.chunks.values()):
        raise FailedPrecondition(f"room {key}: enqueued chunks exceed {num_tokens} tokens")


def check_part_joins(room: SendRoom, rank: int, chunk: ChunkSpec, prior: OutChunk | None) -> None:
    """A layer part (or seal) of writer `rank`, whose earlier part of the chunk is `prior`."""
    assert room.layout is not None
    if prior is not None and prior.layers is None:
        raise AlreadyExists(f"room {room.key}: chunk {chunk.chunk_id} was already enqueued whole by rank {rank}")
    check_layer_part(chunk, room.layout.num_layers, None if prior is None else prior.layers, rank)
    if prior is None:
        # A later part's group was just checked against its first part's, and every writer's first
        # part (or whole chunk) was checked against the writers before it: the groups agree.
        check_group(room, chunk)
    why = room.layer_parts_refusal()
    if why:
        raise FailedPrecondition(why)

def check_group(room: SendRoom, chunk: ChunkSpec) -> None:
    """Every writer of a chunk lays its slot out with the same group size: the reader's range
    holds all their heads in one layout."""
    assert room.layout is not None
    n = room.layout.num_layers
    mine = group_of(n, chunk.layer_group)
    for rank, w in room.writers.items():
        c = w.chunks.get(chunk.chunk_id)
        if c is not None and chunk_group(c.layers, n) != mine:
            raise InvalidArgument(f"room {room.key}: chunk {chunk.chunk_id} is laid out in groups of {mine} "
                                  f"layers, rank {rank} sent it in groups of {chunk_group(c.layers, n)}")
