"""NIXL notifications: the one message that travels with the bytes.

A WRITE's notification is delivered to the decode daemon after the bytes, so it is what turns
"bytes may be there" into "chunk c of room r landed at this range". It names the credit and the
offset inside it, so the decode side can check the range against what it granted this peer, and
the room's token: a secret the decode daemon drew for the room and sent to its writer alone (in
the Bootstrap), so that a notification counts only from the writer whatever agent name its
sender states, zero-copy rooms (no credit) included.
One WRITE may carry several parts of a chunk (one per reader on the same daemon): its
notification then lists them all, separated by ";", and each is checked on its own.
A layer part (protocol 1.1) is a "kvx4" entry: kvx3's fields, then layer_group layer_start
layer_end; a whole chunk stays a kvx3 entry (byte-identical to 1.0), which means layers [0, L).
"""

from __future__ import annotations

import binascii
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from kvxfer_protocol.limits import MAX_LAYERS
from kvxferd.core.peer_port import Link
from kvxferd.core.types import ChunkSpec, RoomKey, quick_init
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)

NOTIF_PREFIX = b"kvx3"  # kvx2 had no token: a daemon that sends it is refused at Bootstrap already
PART_PREFIX = b"kvx4"  # a layer part: kvx3 + layer_group layer_start layer_end
PART_SEP = b";"
# More parts than any TP degree gives one chunk on one daemon: a longer list is malformed.
MAX_PARTS = 1024
# Zero-copy chunks land in the reader's own pages, not in a credit.
NO_CREDIT = 0
# Why a notification did not count (kvxferd_notifs_dropped{reason}): a fixed set, never a caller's word.
DROP_REASONS = ("malformed", "sender", "token", "stale", "range", "credit", "held", "writer")
# A room's token: 128 random bits, as many as a guess must match (a wrong one is dropped, counted).
TOKEN_BYTES = 16
# A flood of forged notifications costs one warning line per this many seconds.
LOG_EVERY_S = 1.0


@quick_init  # built per entry of every notification the decode side takes in
@dataclass(frozen=True, slots=True)
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
    token: bytes = b""
    # A kvx4 entry's layers [layer_start, layer_end) of a slot with layer_group layers a group;
    # all 0 for a kvx3 entry: the whole chunk.
    layer_group: int = 0
    layer_start: int = 0
    layer_end: int = 0


def new_token() -> bytes:
    """A room's notification token (drawn by the decode daemon, one per room and generation)."""
    return secrets.token_bytes(TOKEN_BYTES)


def encode_notif(key: RoomKey, spec: ChunkSpec, writer: int, reader: int, credit_id: int = NO_CREDIT,
                 offset: int = 0, *, token: bytes, layers: tuple[int, int] | None = None) -> bytes:
    """`token`: the room's, from its Bootstrap. `layers`: the [start, end) this entry reports when
    it is not the spec's own (merged adjacent parts of one chunk); a whole chunk is a kvx3 entry."""
    head = _head(key, spec, writer, reader, credit_id, offset, token)
    if not spec.layer_group and not spec.layer_end:
        return NOTIF_PREFIX + b" " + head
    start, end = layers if layers is not None else (spec.layer_start, spec.layer_end)
    return part_entry(PART_PREFIX + b" " + head, spec.layer_group, start, end)


def _head(key: RoomKey, spec: ChunkSpec, writer: int, reader: int, credit_id: int, offset: int, token: bytes) -> bytes:
    return b"%d %d %d %d %d %d %d %d %d %d %s" % (
        key.id, key.generation, spec.chunk_id, writer, reader, spec.token_start, spec.num_tokens,
        int(spec.last), credit_id, offset, token.hex().encode(),
    )


def part_head(key: RoomKey, spec: ChunkSpec, writer: int, reader: int, credit_id: int, offset: int, *,
              token: bytes) -> bytes:
    """The kvx4 entry of a layer-wise chunk's (writer, reader) up to its layer fields: the same for
    every part, so the scheduler builds it once a chunk and adds each part's layers (part_entry)."""
    return PART_PREFIX + b" " + _head(key, spec, writer, reader, credit_id, offset, token)


def part_entry(head: bytes, layer_group: int, start: int, end: int) -> bytes:
    """A kvx4 entry: `head` (part_head) and the layers [start, end) of groups of `layer_group`."""
    return b"%s %d %d %d" % (head, layer_group, start, end)


def decode_notif(msg: bytes) -> Notif | None:
    parts = msg.split()
    n = len(parts)
    if not ((n == 12 and parts[0] == NOTIF_PREFIX) or (n == 15 and parts[0] == PART_PREFIX)):
        return None
    if len(parts[11]) != 2 * TOKEN_BYTES:
        return None
    try:
        rid, gen, chunk, writer, reader, tstart, ntok, last, credit, offset = map(int, parts[1:11])
        # unhexlify takes the bytes as they are (bytes.fromhex wants a str: a decode per entry);
        # it refuses non-hex digits as fromhex does (binascii.Error is a ValueError).
        token = binascii.unhexlify(parts[11])
        group, start, end = map(int, parts[12:15]) if n == 15 else (0, 0, 0)
    except ValueError:
        return None
    if min(rid, gen, chunk, writer, reader, tstart, ntok, credit, offset) < 0:
        return None
    # A kvx4 entry names a non-empty layer range (seals carry no bytes, so no notification); the
    # model's layer count is the receiver's to check.
    if n == 15 and not (0 < group <= MAX_LAYERS and 0 <= start < end <= MAX_LAYERS):
        return None
    return Notif(RoomKey(rid, gen), chunk, writer, reader, tstart, ntok, bool(last), credit, offset, token,
                 group, start, end)


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


def sent_by_writer(peer: Link | None, agent: str | None) -> bool:
    """Whether a notification came from the daemon that writes its room (`agent`: the NIXL agent
    it came from; None for the hand-off between engines of this daemon, which never crosses NIXL).

    NIXL keys notifications by an agent name the sender states itself (UCX does not vouch for it),
    so this stops a peer naming others' rooms under its own agent; one that also claims the
    writer's agent name lands nothing: it does not hold the room's token (from_writers), nor the
    writer's credits (random ids, sent to their holder only). O(1) per part on the chunk path."""
    if peer is None:
        return False
    if agent is None:
        return peer.is_self
    return bool(agent) and not peer.is_self and agent == peer.agent_name


def from_writers(notifs: Iterable[tuple[str, bytes]], local: bool,
                 writer_of: Callable[[RoomKey], tuple[Link | None, bytes] | Literal[False]],
                 drops: NotifDrops) -> Iterator[Notif]:
    """Each part, of each (sending agent, message), that the writer of its room sent; the rest are
    counted and dropped. Checked before anything else (the early queue too). `writer_of`: the
    daemon a room bootstrapped with (None: none yet) and the room's token, False for a room
    unknown or ended. The token is compared in constant time: a guess learns nothing of how
    close it came."""
    for agent, msg in notifs:
        parts = decode_notifs(msg)
        if parts is None:
            drops.drop("malformed", None, f"from agent {agent[:100]!r}: {msg[:64]!r}")
            continue
        for n in parts:
            writer = writer_of(n.room)
            if writer is False:
                drops.drop("stale", n.room, "room unknown or ended", quiet=True)
            elif not sent_by_writer(writer[0], None if local else agent):
                drops.drop("sender", n.room, f"agent {agent[:100]!r} does not write this room")
            elif not hmac.compare_digest(n.token, writer[1]):
                drops.drop("token", n.room, f"agent {agent[:100]!r} does not hold the room's token")
            else:
                yield n


class NotifDrops:
    """Counts notifications that changed nothing, by reason, and logs them rate-limited."""

    def __init__(self, metrics: Metrics) -> None:
        self._count = {r: metrics.notifs_dropped.labels(reason=r) for r in DROP_REASONS}
        self._log_at = 0.0
        self._unlogged = 0

    def drop(self, reason: str, room: RoomKey | None, detail: str, quiet: bool = False) -> None:
        """`quiet`: an expected straggler (a WRITE's notification after its room ended): debug only."""
        self._count[reason].inc()
        if quiet:
            logger.debug("room %s: notification dropped (%s): %s", room, reason, detail)
            return
        now = time.monotonic()
        if now < self._log_at:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more dropped since the last line)" if self._unlogged else ""
        logger.warning("room %s: notification dropped (%s): %s%s", room or "?", reason, detail[:300], more)
        self._log_at, self._unlogged = now + LOG_EVERY_S, 0
