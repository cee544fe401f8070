"""NIXL notifications: the one message that travels with the bytes.

A WRITE's notification is delivered to the decode daemon after the bytes, so it is what turns
"bytes may be there" into "chunk c of room r landed at this range". It names the credit and the
offset inside it, so the decode side can check the range against what it granted this peer.
One WRITE may carry several parts of a chunk (one per reader on the same daemon): its
notification then lists them all, separated by ";", and each is checked on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.domain import ChunkSpec, RoomKey

NOTIF_PREFIX = b"kvx2"
PART_SEP = b";"
# More parts than any TP degree gives one chunk on one daemon: a longer list is malformed.
MAX_PARTS = 1024
# Zero-copy chunks land in the reader's own pages, not in a credit.
NO_CREDIT = 0


@dataclass(frozen=True)
class Notif:
    room: RoomKey
    chunk_id: int
    writer: int
    reader: int
    token_start: int
    num_tokens: int
    last: bool
    credit_id: int = NO_CREDIT
    offset: int = 0


def encode_notif(key: RoomKey, spec: ChunkSpec, writer: int, reader: int, credit_id: int = NO_CREDIT,
                 offset: int = 0) -> bytes:
    return b"%s %d %d %d %d %d %d %d %d %d %d" % (
        NOTIF_PREFIX, key.id, key.generation, spec.chunk_id, writer, reader, spec.token_start, spec.num_tokens,
        int(spec.last), credit_id, offset,
    )


def decode_notif(msg: bytes) -> Notif | None:
    parts = msg.split()
    if len(parts) != 11 or parts[0] != NOTIF_PREFIX:
        return None
    try:
        rid, gen, chunk, writer, reader, tstart, ntok, last, credit, offset = (int(p) for p in parts[1:])
    except ValueError:
        return None
    if min(rid, gen, chunk, writer, reader, tstart, ntok, credit, offset) < 0:
        return None
    return Notif(RoomKey(rid, gen), chunk, writer, reader, tstart, ntok, bool(last), credit, offset)


def join_notifs(parts: list[bytes]) -> bytes:
    """One notification for a WRITE that carries several parts (see decode_notifs)."""
    return PART_SEP.join(parts)


def decode_notifs(msg: bytes) -> list[Notif] | None:
    """Every part a notification names; None when any part is malformed (then none counts)."""
    pieces = msg.split(PART_SEP)
    if len(pieces) > MAX_PARTS:
        return None
    out = []
    for piece in pieces:
        n = decode_notif(piece)
        if n is None:
            return None
        out.append(n)
    return out
