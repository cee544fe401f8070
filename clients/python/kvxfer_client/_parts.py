"""Layer parts (protocol 1.1, docs/design/layerwise.md) for both clients: part and seal
requests, which part of a claimed slot hands the slot over, the verdicts of parts sent without
waiting, and what a layer event says.

A layer-wise chunk's slot is group-major ``[groups, heads, layers_in_group, planes, tokens,
head_dim]`` (``KVPages.layers``/``group_view`` fill it a group at a time). Its parts repeat the
chunk's ``chunk_id``/``token_start``/``num_tokens``/slot/claim; the daemon takes the slot with
the first part to arrive. The room's last chunk is closed by a seal: no slot, no bytes,
``last`` and ``aux``, because the first token exists only after the LM head.

Claims: the slot of a part's chunk is the daemon's as soon as any part of it went in, so the
claim is sent once, with the chunk's first part, and stays SENT (neither the engine's to cut
over nor to release) until every part sent with it has its verdict. Only if none of them went
in is it the engine's again; a refusal of one part among accepted ones changes nothing for the
slot. Whole chunks keep their one-claim-one-verdict path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvxfer_client._aio_lane import AioLane
from kvxfer_client._claims import ClaimRing
from kvxfer_client._requests import chunks_request
from kvxfer_client.errors import ChunkRefused, KvxferError, enqueue_results
from kvxfer_client.types import Chunk, Layout, Slot
from kvxfer_protocol.limits import MAX_BATCH_CHUNKS
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2
from kvxfer_protocol.slot_layout import check_part


def layer_part(
    room: int, chunk_id: int, token_start: int, num_tokens: int, slot: Slot | None, layer_group: int,
    layer_start: int, layer_end: int, generation: int = 0, pages: Sequence[int] = (),
) -> Chunk:
    """Layers ``[layer_start, layer_end)`` of a chunk whose slot holds ``layer_group`` layers a
    group; a range of several groups written since the last send goes as one part (one WRITE,
    one notification entry at the daemons)."""
    return Chunk(room, chunk_id, token_start, num_tokens, slot, generation=generation, pages=tuple(pages),
                 layer_group=layer_group, layer_start=layer_start, layer_end=layer_end)


def seal_part(
    layout: Layout, room: int, chunk_id: int, token_start: int, num_tokens: int, layer_group: int,
    aux: bytes = b"", generation: int = 0,
) -> Chunk:
    """The seal of a room's last chunk sent as layer parts: no slot, no bytes; carries ``last`` and ``aux``."""
    n = layout.num_layers
    return Chunk(room, chunk_id, token_start, num_tokens, None, True, aux, generation,
                 layer_group=layer_group, layer_start=n, layer_end=n)


def check_parts(layout: Layout, parts: Sequence[Chunk]) -> None:
    """Raises INVALID_ARGUMENT naming the first part that cannot be one (nothing is sent)."""
    if len(parts) > MAX_BATCH_CHUNKS:
        raise KvxferError(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_BATCH_CHUNKS} parts a call, got {len(parts)}")
    n = layout.num_layers
    for p in parts:
        why = check_part(n, p.layer_group, p.layer_start, p.layer_end) if p.layer_group else \
            "a layer part needs layer_group >= 1 (a whole chunk goes through enqueue())"
        if not why and p.layer_start == p.layer_end == n and (p.slot is not None or p.pages):
            why = "a seal carries no slot and no pages"
        if not why and p.layer_start != n and (p.last or p.aux):
            why = "last and aux of a layer-wise chunk go on its seal only"
        if why:
            raise KvxferError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"room {p.room} chunk {p.chunk_id} layers [{p.layer_start}, {p.layer_end}): {why}")


@dataclass
class _Open:
    """A claimed slot some parts were sent with."""

    pending: int = 0  # parts sent, verdict not read yet
    went_in: bool = False  # some part was accepted: the slot is the daemon's
    first_error: BaseException | None = None
    layers_in: int = 0  # layers of accepted parts: at num_layers no part of it is left to send


class PartClaims:
    """Hands a claimed slot over with its chunk's first part and settles it on its parts' verdicts."""

    def __init__(self, claims: ClaimRing, num_layers: int) -> None:
        self._claims = claims
        self._num_layers = num_layers
        self._lock = threading.Lock()
        self._open: dict[int, _Open] = {}

    def send(self, parts: Sequence[Chunk]) -> list[KvxferError | None]:
        """Before sending ``parts``: the error of each whose slot is not the engine's to send (it is
        not to be sent), None for the others, now counted as sent with their claims."""
        out: list[KvxferError | None] = []
        with self._lock:
            for p in parts:
                tag = p.slot.claim if p.slot is not None else 0
                if not tag:
                    out.append(None)
                    continue
                entry = self._open.get(tag)
                if entry is None:
                    err = self._claims.sent_many([tag])[0]
                    if err is not None:
                        out.append(err)
                        continue
                    entry = self._open[tag] = _Open()
                entry.pending += 1
                out.append(None)
        return out

    def settle(self, parts: Sequence[Chunk], results: Sequence[BaseException | None] | BaseException,
               freed: Sequence[int] = ()) -> None:
        """The verdicts of parts counted by send() (None: accepted), or the one error of the call."""
        self._claims.freed(freed)
        done: list[tuple[int, bool, BaseException | None]] = []
        with self._lock:
            for tag in freed:
                self._open.pop(tag, None)
            for i, p in enumerate(parts):
                tag = p.slot.claim if p.slot is not None else 0
                entry = self._open.get(tag) if tag else None
                if entry is None:
                    continue
                res = results if isinstance(results, BaseException) else results[i]
                entry.pending -= 1
                if res is None:
                    entry.went_in = True
                    entry.layers_in += p.layer_end - p.layer_start
                elif entry.first_error is None:
                    entry.first_error = res
                if entry.pending == 0:
                    done.append((tag, entry.went_in, entry.first_error))
                    if not entry.went_in or entry.layers_in >= self._num_layers:
                        del self._open[tag]
        for tag, went_in, err in done:
            if went_in:
                self._claims.verdict(tag, True)
            elif err is not None:
                self._claims.failed(tag, err)


class PartRefusals:
    """Refused parts sent without waiting, per sending thread, until the engine reads them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refused: dict[int, list[ChunkRefused]] = {}

    def add(self, owner: int, parts: Sequence[Chunk], results: Sequence[KvxferError | None]) -> None:
        refused = [ChunkRefused(p.room, p.chunk_id, p.slot, r) for p, r in zip(parts, results, strict=True) if r]
        if refused:
            with self._lock:
                self._refused.setdefault(owner, []).extend(refused)

    def take(self) -> list[ChunkRefused]:
        with self._lock:
            return self._refused.pop(threading.get_ident(), [])


@dataclass(frozen=True)
class PartCall:
    """One EnqueueChunks of parts about to go: ``request`` is None when none may be sent."""

    parts: tuple[Chunk, ...]  # those sent
    errors: list[KvxferError | None]  # per part handed in; None where sent (until its verdict)
    sent: list[int]  # their indexes among the parts handed in
    request: engine_pb2.EnqueueChunksRequest | None


class PartSender:
    """What both prefill clients do around an EnqueueChunks of layer parts; they only make the call."""

    def __init__(self, layout: Layout, claims: ClaimRing | None) -> None:
        self.layout = layout
        self.claims = PartClaims(claims, layout.num_layers) if claims is not None else None
        self.refusals = PartRefusals()

    def prepare(self, engine_id: str, parts: Sequence[Chunk]) -> PartCall:
        """Checks the parts (raises, nothing sent, on a bad one) and counts their claims sent."""
        check_parts(self.layout, parts)
        errors: list[KvxferError | None] = self.claims.send(parts) if self.claims is not None else [None] * len(parts)
        sent = [i for i, e in enumerate(errors) if e is None]
        chosen = tuple(parts[i] for i in sent)
        return PartCall(chosen, errors, sent, chunks_request(engine_id, chosen) if chosen else None)

    def failed(self, call: PartCall, exc: BaseException) -> None:
        """The call raised: its parts' claims as that error leaves them."""
        if self.claims is not None:
            self.claims.settle(call.parts, exc)

    def replied(self, call: PartCall, reply: engine_pb2.EnqueueChunksReply) -> list[KvxferError | None]:
        """The verdict of every part handed in, in order (None: accepted)."""
        results = enqueue_results(reply)
        if self.claims is not None:
            self.claims.settle(call.parts, results, list(reply.results[0].freed_claims) if reply.results else [])
        out = list(call.errors)
        for i, res in zip(call.sent, results, strict=True):
            out[i] = res
        return out

    def on_reply(self, call: PartCall, owner: int) -> Callable[[Any], None]:
        """The callback of the call sent without waiting: its reply, or the KvxferError standing for it."""

        def settle(got: Any) -> None:
            if isinstance(got, KvxferError):
                self.failed(call, got)
                results: list[KvxferError | None] = [got] * len(call.parts)
            else:
                verdicts = self.replied(call, got)
                results = [verdicts[i] for i in call.sent]
            self.refusals.add(owner, call.parts, results)

        return settle


async def enqueue_layers_aio(client: Any, sender: PartSender, parts: Sequence[Chunk], wait: bool) -> list[KvxferError | None]:
    """AsyncPrefillSender.enqueue_layers: over its lane without waiting (wait=False), else one call."""
    call = sender.prepare(client.engine_id, parts)
    if call.request is None:
        return call.errors
    lane = client.stub.lane
    try:
        if not wait and isinstance(lane, AioLane):
            # The loop's thread reads every verdict: one owner for settle()/flush().
            await lane.send_deferred("EnqueueChunks", call.request, sender.on_reply(call, threading.get_ident()),
                                     client._timeout)
            return call.errors
        reply = await client._call(client.stub.EnqueueChunks, call.request)
    except BaseException as exc:
        sender.failed(call, exc)
        raise
    return sender.replied(call, reply)
