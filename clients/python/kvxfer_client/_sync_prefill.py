"""The blocking client of a prefill engine rank: slots (claimed here, or from the daemon),
chunks enqueued with or without waiting for the daemon's verdict, batches."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from kvxfer_client._claims import ClaimRing, merge_batch, split_batch
from kvxfer_client._lane import SyncLane
from kvxfer_client._parts import PartSender, seal_part
from kvxfer_client._requests import PIPELINE_PART, acquire_request, chunk_request, chunks_request, retry_full_or_raise
from kvxfer_client._spare import SpareSlot
from kvxfer_client._sync import _EngineClient
from kvxfer_client._verdicts import Verdicts
from kvxfer_client.errors import ChunkRefused, KvxferError, enqueue_results
from kvxfer_client.types import Chunk, Slot
from kvxfer_protocol.limits import MAX_BATCH_CHUNKS
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2


class PrefillSender(_EngineClient):
    """A prefill engine rank: get a slot, write the chunk's KV into it, enqueue, poll."""

    role = engine_pb2.ROLE_PREFILL

    def __init__(self, *, prefetch_slots: bool = True, claim_slots: bool = True, **kwargs: Any) -> None:
        """claim_slots: cut slots out of the ring here, with no call (see ClaimRing), where the
        daemon allows it (a slot ring; an older daemon does not know it). Else, prefetch_slots:
        each enqueue() also asks for a next slot, of the same size (see SpareSlot)."""
        self.spare = SpareSlot(prefetch_slots, depth=2)
        self._verdicts = Verdicts(self.spare)
        super().__init__(claim_slots=claim_slots and not kwargs.get("zero_copy", False), **kwargs)
        self.claims: ClaimRing | None = None
        if self.reg.claim_slots:
            self.claims = ClaimRing(self.reg.ring_bytes, self.reg.slot_align, self.reg.token_bytes)
            self._verdicts.claims = self.claims
            self.spare.enabled = False
        self._parts = PartSender(self.layout, self.claims)

    def acquire(self, num_tokens: int, timeout: float = 30.0) -> Slot:
        """A slot for `num_tokens` tokens. With claimed slots: cut out of the ring here (the
        verdicts already here are read first, without waiting: they say which slots the daemon
        let go of); while none fits, the daemon holds an AcquireSlot call until one comes free.
        Else a spare one in hand, or AcquireSlot. Either way no polling, up to `timeout`."""
        self._settle_deferred()
        if self.claims is not None:
            return self._cut(num_tokens, timeout)
        spare, stale = self.spare.take(num_tokens)
        if stale is not None:
            self._release_all([stale])
        if spare is not None:
            return spare
        deadline = time.monotonic() + timeout
        while True:
            req = acquire_request(self.engine_id, num_tokens, deadline, self._timeout)
            try:
                reply = self._call(self.stub.AcquireSlot, req, timeout=req.wait_ms / 1000 + self._timeout)
                return Slot(reply.slot.offset, reply.slot.length, reply.chunk_bytes)
            except KvxferError as exc:
                retry_full_or_raise(exc, deadline)

    def _cut(self, num_tokens: int, timeout: float) -> Slot:
        claims = self.claims
        assert claims is not None
        slot = claims.cut(num_tokens)
        deadline = time.monotonic() + timeout
        while slot is None:
            # The daemon holds this call until it let go of a claim (no polling).
            req = claims.wait_request(acquire_request(self.engine_id, num_tokens, deadline, self._timeout))
            try:
                reply = self._call(self.stub.AcquireSlot, req, timeout=req.wait_ms / 1000 + self._timeout)
            except KvxferError as exc:
                retry_full_or_raise(exc, deadline)
                continue
            slot = claims.freed_then_cut(reply.freed_claims, num_tokens)
        return slot

    def release_slot(self, slot: Slot) -> None:
        """Gives back a slot never enqueued (or whose chunk was refused). A claimed slot goes
        back here, with no call."""
        if slot.claim:
            if self.claims is None:
                raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION, "this client cuts no slots of its own")
            self.claims.release(slot.claim)
            return
        self._call(self.stub.ReleaseSlot, engine_pb2.ReleaseSlotRequest(
            engine_id=self.engine_id, slot=common_pb2.Slot(offset=slot.offset, length=slot.length)))

    def _release_all(self, slots: Sequence[Slot]) -> None:
        """Releases spares; one that fails raises, and leaves the rest for the next call
        (SpareSlot.unreleased)."""
        for i, slot in enumerate(slots):
            try:
                self.release_slot(slot)
            except BaseException as exc:
                self.spare.unreleased(slots, i, exc)
                raise

    def slot_view(self, slot: Slot) -> memoryview:
        return self.view(slot.offset, slot.chunk_bytes)

    def enqueue(
        self, room: int, chunk_id: int, token_start: int, num_tokens: int, slot: Slot | None = None,
        last: bool = False, aux: bytes = b"", generation: int = 0, pages: Sequence[int] = (),
        wait: bool = True,
    ) -> None:
        """Hands a written chunk over: a slot from acquire(), or (zero-copy engines) its pool pages.

        wait=False (over the daemon's lane; over gRPC it waits anyway): returns once the request
        is written, without waiting for the daemon's verdict. The engine then fills its next
        chunk while the daemon takes this one, and a slot for the next chunk comes back with
        the verdict (two are held ahead; acquire() with none in hand asks the daemon rather than
        wait for a verdict). A refused chunk
        is raised as ChunkRefused (its room, chunk and slot; the daemon changed nothing for it
        and the slot is still the engine's) by this thread's next acquire() or enqueue(),
        before that call does anything, or returned by flush(). Every call of this client
        that reads from the lane also reads the verdicts that are there. A chunk that cannot
        be sent at all (no connection to the daemon's lane within the call timeout) raises
        KvxferError at once; the daemon saw nothing of it."""
        c = Chunk(room, chunk_id, token_start, num_tokens, slot, last, aux, generation, tuple(pages))
        self._settle_deferred()
        req = chunk_request(self.engine_id, c)
        lane = self.stub.lane
        claim = slot.claim if slot is not None and self.claims is not None else 0
        if claim:
            self.claims.sent(claim)  # type: ignore[union-attr]
        if not wait and isinstance(lane, SyncLane):
            # send_deferred raises only when nothing was sent (then the ask is settled here);
            # once sent, the verdict or the connection's loss reaches on_reply instead.
            with self.spare.asking(req) as asked, self._unsent_on_raise(claim):
                owner = threading.get_ident()  # another thread may read the verdict
                lane.send_deferred("EnqueueChunk", req, lambda got: self._verdicts.on_reply(c, asked, got, owner),
                                   self._timeout)
            return
        with self.spare.asking(req, depth=1) as asked:
            try:
                reply = self._call(self.stub.EnqueueChunk, req)
            except BaseException as exc:
                if claim:
                    self.claims.failed(claim, exc)  # type: ignore[union-attr]
                raise
        if claim:
            self.claims.verdict(claim, True, reply.freed_claims)  # type: ignore[union-attr]
        extra = self.spare.keep(reply, num_tokens, asked)
        if extra is not None:
            self.release_slot(extra)

    def enqueue_layers(self, parts: Sequence[Chunk], wait: bool = True) -> list[KvxferError | None]:
        """Layer parts (``layer_part``/``seal_part``) of any rooms, in one EnqueueChunks: send
        every group written since the last call as one part per chunk. Returns None per part
        accepted, else its error; a part that is not one raises INVALID_ARGUMENT and nothing goes.

        wait=False (over the daemon's lane): returns once the call is written (all None; what
        cannot be sent at all raises); the refusals come back from flush() or settle(). The slot
        of a chunk is the daemon's from its first part on: do not release it, even if a later
        part is refused (fail the room instead)."""
        self._read_verdicts()
        call = self._parts.prepare(self.engine_id, parts)
        if call.request is None:
            return call.errors
        lane = self.stub.lane
        try:
            if not wait and isinstance(lane, SyncLane):
                lane.send_deferred("EnqueueChunks", call.request,
                                   self._parts.on_reply(call, threading.get_ident()), self._timeout)
                return call.errors
            reply = self._call(self.stub.EnqueueChunks, call.request)
        except BaseException as exc:
            self._parts.failed(call, exc)
            raise
        return self._parts.replied(call, reply)

    def seal(self, room: int, chunk_id: int, token_start: int, num_tokens: int, layer_group: int,
             aux: bytes = b"", generation: int = 0, wait: bool = True) -> None:
        """Closes a room's last layer-wise chunk (no slot, no bytes) with ``aux``; raises its
        refusal (wait=False: see enqueue_layers)."""
        err = self.enqueue_layers(
            [seal_part(self.layout, room, chunk_id, token_start, num_tokens, layer_group, aux, generation)], wait)[0]
        if err is not None:
            raise err

    @contextlib.contextmanager
    def _unsent_on_raise(self, claim: int) -> Iterator[None]:
        """Around a deferred send: one that raises sent nothing, and the claim stays the engine's."""
        try:
            yield
        except BaseException:
            if claim:
                self.claims.verdict(claim, False)  # type: ignore[union-attr]
            raise

    def flush(self, timeout: float | None = None) -> list[ChunkRefused]:
        """Waits for the daemon's verdict on every chunk this thread sent with enqueue(wait=False)
        (and enqueue_layers) and returns the refusals not raised yet, oldest first (parts after chunks) (an engine that sends a batch
        of chunks this way and flushes once learns every verdict for one round trip). A daemon
        that stays silent for `timeout` (the call timeout by default) or goes away refuses
        what is outstanding with DEADLINE_EXCEEDED or UNAVAILABLE."""
        lane = self.stub.lane
        if isinstance(lane, SyncLane):
            lane.wait_deferred(timeout or self._timeout)
        return self._verdicts.take() + self._parts.refusals.take()

    def settle(self) -> list[ChunkRefused]:
        """The refusals among the verdicts already here for this thread's enqueue(wait=False)
        chunks, oldest first, without waiting for the others (flush() waits for them all): an
        engine that checks once per scheduler step learns of a refused chunk without a round trip."""
        self._read_verdicts()
        return self._verdicts.take() + self._parts.refusals.take()

    def _settle_deferred(self) -> None:
        """Reads the verdicts that are already here, gives back surplus spares, raises a refusal."""
        self._read_verdicts()
        self._verdicts.raise_oldest()

    def _read_verdicts(self) -> None:
        """Reads, without waiting, the verdicts already here; gives back the spares they made surplus."""
        lane = self.stub.lane
        if isinstance(lane, SyncLane):
            lane.poll_deferred()  # returns at once when nothing was sent without waiting
        surplus = self.spare.surplus()
        if surplus:
            self._release_all(surplus)

    def close(self, unregister: bool = True) -> None:
        lane = self.stub.lane
        if isinstance(lane, SyncLane) and not self._closed.is_set():
            lane.wait_deferred(self._timeout)  # what was sent goes in before the engine leaves
        spares = self.spare.drop()
        if not unregister and not self._closed.is_set():
            for spare in spares:
                try:
                    self.release_slot(spare)
                except KvxferError:
                    break  # the daemon frees it with the engine's lease anyway
        super().close(unregister)

    def enqueue_many(self, chunks: Sequence[Chunk]) -> list[KvxferError | None]:
        """Many chunks at once; returns None per accepted chunk, else its error.

        Over the lane, a large batch goes as several calls pipelined on one connection (the
        daemon accepts the first part while the next is serialised), in order; over gRPC, as one
        EnqueueChunks call. A part the daemon refuses as a whole (it is draining, say) gives each
        of its chunks that error."""
        lane = self.stub.lane
        if len(chunks) > MAX_BATCH_CHUNKS:
            raise KvxferError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"at most {MAX_BATCH_CHUNKS} chunks per call, got {len(chunks)}")
        claims = self.claims
        if claims is None:
            return self._enqueue_batch(chunks, lane)
        tags, errors, send = split_batch(claims, chunks)
        try:
            got = self._enqueue_batch(chunks if send is None else [chunks[i] for i in send], lane) if send != [] else []
        except BaseException as exc:
            merge_batch(claims, tags, errors, send, exc)
            raise
        return merge_batch(claims, tags, errors, send, got)

    def _enqueue_batch(self, chunks: Sequence[Chunk], lane: Any) -> list[KvxferError | None]:
        if not isinstance(lane, SyncLane) or len(chunks) < 2 * PIPELINE_PART:
            reply = self._call(self.stub.EnqueueChunks, chunks_request(self.engine_id, chunks))
            self._batch_freed([reply])
            return enqueue_results(reply)
        eid = self.engine_id
        parts = [chunks[i:i + PIPELINE_PART] for i in range(0, len(chunks), PIPELINE_PART)]
        replies = lane.call_pipelined("EnqueueChunks", (
            chunks_request(eid, part) for part in parts
        ), self._timeout)
        self._batch_freed(replies)
        out: list[KvxferError | None] = []
        for part, reply in zip(parts, replies, strict=True):
            out += [reply] * len(part) if isinstance(reply, KvxferError) else enqueue_results(reply)
        return out

    def _batch_freed(self, replies: Sequence[Any]) -> None:
        """The claims the daemon let go of, which a batch reply carries in its first result."""
        if self.claims is not None:
            for reply in replies:
                if not isinstance(reply, KvxferError) and reply.results and reply.results[0].freed_claims:
                    self.claims.freed(reply.results[0].freed_claims)

    def send_chunk(
        self, room: int, chunk_id: int, token_start: int, num_tokens: int, data: bytes | memoryview,
        last: bool = False, aux: bytes = b"", generation: int = 0, timeout: float = 30.0, wait: bool = True,
    ) -> Slot:
        """Convenience: acquire a slot, copy `data` (the chunk in slot layout) into it, enqueue.
        A chunk refused at once gives its slot back; with wait=False the refusal comes later
        (see enqueue) with the slot, which is then the engine's to release."""
        slot = self.acquire(num_tokens, timeout)
        mv = memoryview(data).cast("B")
        if mv.nbytes != slot.chunk_bytes:
            self.release_slot(slot)
            raise ValueError(f"chunk data is {mv.nbytes} B; {num_tokens} tokens need {slot.chunk_bytes} B")
        self.slot_view(slot)[:] = mv
        try:
            self.enqueue(room, chunk_id, token_start, num_tokens, slot, last, aux, generation, wait=wait)
        except KvxferError:
            self.release_slot(slot)
            raise
        return slot
