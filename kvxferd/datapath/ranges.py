"""A decode room's slot ranges going back: here (the credit ledger stops holding them) and to
the prefill side, which owns the credits and may write into a range again once told.

Moved out of the receiver (at the module size limit) as one piece: every way a decode slot is
let go of ends here, so a range is released at most once on each side.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvxferd.core.rooms import InSlot, RecvRoom
from kvxferd.datapath.credits import CreditLedger
from kvxferd.datapath.notif import NO_CREDIT


def let_go(ledger: CreditLedger, room: RecvRoom, slots: Iterable[InSlot]) -> None:
    """Lets go of these slots' ranges here and tells the prefill side it may reuse them."""
    freed = [(s.credit_id, s.credit_offset) for s in slots if free_slot(ledger, s)]
    if freed and room.peer is not None and room.peer.up and not room.ranges_released:
        room.peer.send_release(ranges=freed)


def free_slot(ledger: CreditLedger, slot: InSlot) -> bool:
    """Lets go of a slot's range here; True if the prefill side should hear of it."""
    if slot.freed:
        return False
    slot.freed = True
    if slot.credit_id == NO_CREDIT:
        return False
    ledger.unhold(slot.credit_id, slot.credit_offset)
    return True


def release_all(ledger: CreditLedger, room: RecvRoom) -> None:
    """Every range of the room goes back: here at once, on the prefill side once its own WRITEs
    into them are done (it owns them)."""
    for rs in room.readers.values():
        for slot in rs.slots.values():
            free_slot(ledger, slot)
    if not room.ranges_released:
        room.ranges_released = True
        if room.peer is not None and room.peer.up:
            room.peer.send_release(rooms=[room.key])
