"""The notification that travels with a WRITE: one part or several, and malformed input."""

from __future__ import annotations

from kvxferd.core.types import ChunkSpec, RoomKey, SlotRef
from kvxferd.datapath.notif import MAX_PARTS, Notif, decode_notif, decode_notifs, encode_notif, join_notifs, new_token

TOKEN = new_token()


def _spec(chunk: int, start: int, n: int, last: bool = False) -> ChunkSpec:
    return ChunkSpec(RoomKey(0, 0), chunk_id=chunk, token_start=start, num_tokens=n, slot=SlotRef(0, 0), last=last,
                     aux=b"")


def test_one_part_round_trips() -> None:
    msg = encode_notif(RoomKey(7, 3), _spec(2, 32, 16, last=True), 1, 0, credit_id=9, offset=4096, token=TOKEN)
    assert decode_notif(msg) == Notif(RoomKey(7, 3), 2, 1, 0, 32, 16, True, 9, 4096, TOKEN)
    assert decode_notifs(msg) == [decode_notif(msg)]


def test_parts_of_one_write_each_decode_in_order() -> None:
    parts = [encode_notif(RoomKey(5, 1), _spec(0, 0, 64), 0, r, credit_id=10 + r, offset=r * 100, token=TOKEN)
             for r in range(4)]
    got = decode_notifs(join_notifs(parts))
    assert got is not None and [n.reader for n in got] == [0, 1, 2, 3]
    assert [(n.credit_id, n.offset) for n in got] == [(10, 0), (11, 100), (12, 200), (13, 300)]
    # The joined message is not one part: the single-part decoder refuses it.
    assert decode_notif(join_notifs(parts)) is None


def test_one_malformed_part_drops_the_whole_notification() -> None:
    good = encode_notif(RoomKey(5, 1), _spec(0, 0, 64), 0, 0, credit_id=1, token=TOKEN)
    no_token = good.rpartition(b" ")[0]
    for bad in (b"", b"kvx2 1 2 3", b"kvx9 1 1 1 1 1 1 1 1 1 1 " + TOKEN.hex().encode(), good.replace(b" 64 ", b" -64 "),
                b"kvx3 a b c d e f g h i j " + TOKEN.hex().encode(), no_token, no_token + b" " + TOKEN.hex()[:-2].encode(),
                no_token + b" " + b"zz" * 16, no_token.replace(b"kvx3", b"kvx2")):
        assert decode_notifs(join_notifs([good, bad])) is None, bad
    assert decode_notifs(join_notifs([good] * (MAX_PARTS + 1))) is None
    assert decode_notifs(join_notifs([good] * MAX_PARTS)) is not None


def _part(chunk: int, group: int, lo: int, hi: int) -> ChunkSpec:
    return ChunkSpec(RoomKey(0, 0), chunk_id=chunk, token_start=0, num_tokens=16, slot=SlotRef(0, 0), last=False,
                     aux=b"", layer_group=group, layer_start=lo, layer_end=hi)


def test_whole_chunk_stays_kvx3_and_a_part_is_kvx4() -> None:
    whole = encode_notif(RoomKey(7, 3), _spec(2, 32, 16), 1, 0, credit_id=9, offset=64, token=TOKEN)
    assert whole == b"kvx3 7 3 2 1 0 32 16 0 9 64 " + TOKEN.hex().encode()  # byte-identical to protocol 1.0
    part = encode_notif(RoomKey(7, 3), _part(2, 4, 8, 12), 1, 0, credit_id=9, offset=64, token=TOKEN)
    assert part == b"kvx4 7 3 2 1 0 0 16 0 9 64 " + TOKEN.hex().encode() + b" 4 8 12"
    assert decode_notif(part) == Notif(RoomKey(7, 3), 2, 1, 0, 0, 16, False, 9, 64, TOKEN, 4, 8, 12)
    # Merged adjacent parts of one chunk report their joined range in one entry.
    merged = encode_notif(RoomKey(7, 3), _part(2, 4, 8, 12), 1, 0, token=TOKEN, layers=(0, 16))
    n = decode_notif(merged)
    assert n is not None and (n.layer_group, n.layer_start, n.layer_end) == (4, 0, 16)
    # kvx3 means the whole chunk: no layer fields.
    w = decode_notif(whole)
    assert w is not None and (w.layer_group, w.layer_start, w.layer_end) == (0, 0, 0)
    both = decode_notifs(join_notifs([whole, part]))
    assert both is not None and [x.layer_end for x in both] == [0, 12]


def test_malformed_kvx4_entries_are_dropped() -> None:
    good = encode_notif(RoomKey(5, 1), _part(0, 4, 0, 4), 0, 0, token=TOKEN)
    head = good.rsplit(b" ", 3)[0]
    for tail in (b" 4 4 4", b" 4 8 4", b" 0 0 4", b" 4 0 1025", b" 1025 0 4", b" 4 0", b" 4 0 4 4", b" 4 -1 4",
                 b" 4 a 4"):
        assert decode_notifs(join_notifs([good, head + tail])) is None, tail
    # A kvx3 entry with layer fields, or a kvx4 one without, is malformed.
    assert decode_notif(good.replace(b"kvx4", b"kvx3")) is None
    assert decode_notif(head.replace(b"kvx4", b"kvx3")) is not None
    assert decode_notif(head) is None
