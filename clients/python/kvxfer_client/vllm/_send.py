"""Prefill side of the vLLM connector's worker: gather each step's chunks into ring slots and
enqueue them, through a registration that heals (kvxfer_client._reattach).

A room is all or nothing: once one of its chunks could not be enqueued (refused, the daemon away,
the registration replaced), the room is aborted, its later chunks are skipped, and its request is
reported failed to the scheduler side (which then hands out no usable kv_transfer_params). A room
begun with one registration is never continued with the next: the new ring knows none of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvxfer_client._reattach import Reattach
from kvxfer_client._sync_prefill import PrefillSender
from kvxfer_client.errors import ChunkRefused, KvxferError
from kvxfer_client.vllm import _paged
from kvxfer_client.vllm._config import SendChunk, StepPlan
from kvxfer_client.vllm._layers import LayerSends

logger = logging.getLogger(__name__)


def quiet(fn: Callable[..., object], *args: object) -> None:
    """A clean-up call whose failure changes nothing for the caller (the daemon's deadline or the
    engine's lease ends what it would have ended)."""
    try:
        fn(*args)
    except Exception as exc:
        logger.debug("%s%s: %s", getattr(fn, "__name__", fn), args, exc)


class SendPath:
    """One TP rank's prefill sends. Only the model's step thread calls save()."""

    def __init__(self, link: Reattach[PrefillSender], shape: _paged.CacheShape, acquire_timeout_s: float) -> None:
        self.link = link
        self.shape = shape
        self._acquire_timeout = acquire_timeout_s
        self._epochs: dict[int, int] = {}  # room -> the registration epoch of its first chunk
        self._dead: dict[int, str] = {}  # rooms failed here -> why; their later chunks are skipped
        self.failed: dict[str, str] = {}  # request ids of failed rooms, for the scheduler side
        self.layers = LayerSends(shape, acquire_timeout_s, self._fail)
        self._started: StepPlan | None = None  # the last plan start() took slots for

    def start(self, plan: StepPlan) -> None:
        """Before the forward: slots for the step's layer-wise chunks, so no layer hook waits for
        ring space. One that cannot be had fails its room (save() then skips it)."""
        if plan is self._started:
            return  # taken already for this step (the connector binds the plan, then starts loads)
        self._started = plan
        wanted = [c for c in plan.sends if c.layerwise]
        if not wanted:
            return
        try:
            tx, epoch = self.link.get()
        except KvxferError:
            return  # save() fails them with the reason
        for c in wanted:
            if not self._usable(tx, epoch, c):
                continue
            try:
                self.layers.open(tx, c)
            except Exception as exc:
                self.link.failed(exc, epoch)
                self._fail(c.req_id, c.room, f"prefill slot for layer parts failed: {exc}", tx)

    def save_layer(self, name: str) -> None:
        """A layer's KV is written (the forward's hook): groups complete with it go now."""
        self.layers.on_layer(name)

    def _usable(self, tx: PrefillSender, epoch: int, c: SendChunk) -> bool:
        """False for a chunk of a failed room, or of one begun with another registration (failed now)."""
        if c.room in self._dead:
            return False
        first = self._epochs.setdefault(c.room, epoch)
        if first != epoch or not self.link.up:
            self._fail(c.req_id, c.room, "the daemon's registration was replaced or is down mid-room", tx)
            return False
        return True

    def save(self, plan: StepPlan) -> None:
        """Gathers this step's chunks into ring slots and enqueues them; the step's KV is written.
        Never waits on a daemon that is away: the registration says so at once (Detached)."""
        for room in plan.aborts:
            self._epochs.pop(room, None)
            self._dead.pop(room, None)
            self.layers.drop(room)
        try:
            tx, epoch = self.link.get()
        except KvxferError as exc:
            for c in plan.sends:
                self._fail(c.req_id, c.room, str(exc), None)
            self.layers.finish()  # nothing open: start() found the daemon away too
            self._ended(plan)
            return  # the aborted rooms end with their daemon's deadline (or are gone with it)
        for room in plan.aborts:
            quiet(tx.abort, room, "request ended before its prompt was computed")
        for c in plan.sends:
            if self.layers.is_open(c) or not self._usable(tx, epoch, c):
                continue
            while True:
                try:
                    self._send(tx, c)
                except ChunkRefused as exc:
                    # An earlier chunk of this step, refused; this one was not sent: again.
                    self._refused(tx, epoch, exc, plan)
                    if c.room in self._dead:
                        break
                    continue
                except Exception as exc:
                    # The decode side must hear of it now, not at the room deadline.
                    self.link.failed(exc, epoch)
                    self._fail(c.req_id, c.room, f"prefill gather/enqueue failed: {exc}", tx)
                break
        self.layers.finish()  # the step's last layer parts and the seals
        # The step's chunks went without waiting for each verdict: all of them, in one round trip
        # (bounded by the client's call timeout; a silent daemon takes the path down).
        for refused in tx.flush():
            self._refused(tx, epoch, refused, plan)
        self._ended(plan)

    def _ended(self, plan: StepPlan) -> None:
        """Rooms whose last chunk was this step's need no bookkeeping any more."""
        for c in plan.sends:
            if c.last:
                self._epochs.pop(c.room, None)
                self._dead.pop(c.room, None)
                self.layers.drop(c.room)

    def _refused(self, tx: PrefillSender, epoch: int, exc: ChunkRefused, plan: StepPlan) -> None:
        self.link.failed(exc, epoch)
        if exc.slot is not None and not exc.lost and exc.room not in self.layers.rooms:
            # Still ours: the daemon took nothing (a layer-wise chunk's slot is the daemon's
            # once any of its parts went in: the room fails, the slot is left to it).
            quiet(tx.release_slot, exc.slot)
        req = next((c.req_id for c in plan.sends if c.room == exc.room), "")
        self._fail(req, exc.room, f"prefill enqueue refused: {exc.message}", tx)

    def _fail(self, req_id: str, room: int, why: str, tx: PrefillSender | None) -> None:
        if room in self._dead:
            return
        self._dead[room] = why
        self._epochs.pop(room, None)
        logger.error("request %s room %d: send failed, no decode will be pointed at it: %s", req_id, room, why)
        if req_id:
            self.failed[req_id] = why
        if tx is not None and self.link.up:
            quiet(tx.abort, room, why[:200])

    def _send(self, tx: PrefillSender, c: SendChunk) -> None:
        n = c.end - c.start
        s = self.shape
        slot = tx.acquire(n, timeout=self._acquire_timeout)
        try:
            s.copy("gather", tx.tensor(slot.offset, slot.chunk_bytes), c.block_ids, c.first_block, c.start, c.end)
            tx.enqueue(c.room, c.chunk_id, c.start, n, slot, last=c.last, wait=False)
        except BaseException:
            quiet(tx.release_slot, slot)
            raise

    def take_failed(self) -> dict[str, str]:
        out, self.failed = self.failed, {}
        return out
