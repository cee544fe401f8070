"""Claimed slots: a prefill engine cuts its chunks' slots out of its own ring, with no call.

Why: with slots from the daemon (AcquireSlot, or the spare an accepted chunk brings back), an
engine that wants its next slot before the daemon has answered its last enqueues must ask and
wait. On 2 cores that was ~45 % of acquire() calls, each a thread wake-up on both sides
(bench/results/wakeups-per-part-2core.json). Here the engine keeps its own picture of its ring
and the daemon only says, in the replies it sends anyway, which claims it let go of.

The picture never lets the engine write where the daemon reads: a slot is free here only after
the daemon said it let go of it, and the daemon refuses a claim that overlaps a slot it holds
(changing nothing), so a wrong picture costs a refusal, never bytes.

A claim's life, by its tag (unique in this client):
- LOCAL: cut, not enqueued (or refused): the engine's; release_slot() frees it here, no call.
- SENT: enqueued, verdict not read yet.
- HELD: accepted; the daemon names the tag in a reply's freed_claims when it lets it go.
- LOST: its verdict went with a dropped connection. Only the daemon's word frees it: a request
  still in a dead connection's buffer may yet be taken, and its slot must not be cut again first.
  It may be enqueued again (if the first went in, the daemon refuses the second as an overlap).
A refused enqueue puts the claim back in the state it was sent from. Only LOCAL and LOST claims
may be sent: re-sending a slot the daemon holds, or one released, is refused here, since the
engine may already be writing a newer slot cut over the same bytes.
A tag named freed is gone whatever state it is in (another thread's reply may carry the news
before this thread reads its verdict).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from kvxfer_client.errors import KvxferError, NotSent, ReplyLost
from kvxfer_client.types import Slot
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2

LOCAL, SENT, HELD, LOST = range(4)
# Refusals: the daemon checked the chunk and took nothing. Any other failure may have come after
# the daemon took the claim (a gRPC deadline, the connection gone), so the slot is LOST.
_REFUSALS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAUTHENTICATED,
})


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ClaimRing:
    def __init__(self, size: int, align: int, token_bytes: int) -> None:
        if size <= 0 or align <= 0 or token_bytes <= 0:
            raise ValueError(f"claimed slots need a ring, an alignment and token bytes (got {size}, {align}, {token_bytes})")
        self.size, self.align, self.token_bytes = size, align, token_bytes
        self._lock = threading.Lock()  # the blocking client cuts and reads verdicts on any thread
        self._starts: list[int] = [0]  # free ranges, sorted, coalesced
        self._lens: list[int] = [size]
        self._claims: dict[int, list[int]] = {}  # tag -> [offset, length, state, state sent from]
        self._next_tag = 1

    def cut(self, num_tokens: int) -> Slot | None:
        """A LOCAL slot for num_tokens tokens (first fit), or None while no free range fits."""
        nbytes = num_tokens * self.token_bytes
        need = _align_up(nbytes, self.align)
        if num_tokens <= 0 or need > self.size:
            raise KvxferError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"a chunk of {num_tokens} tokens needs {nbytes} B; the ring has {self.size} B")
        with self._lock:
            for i, flen in enumerate(self._lens):
                if flen >= need:
                    off = self._starts[i]
                    if flen == need:
                        del self._starts[i]
                        del self._lens[i]
                    else:
                        self._starts[i], self._lens[i] = off + need, flen - need
                    tag = self._next_tag
                    self._next_tag += 1
                    self._claims[tag] = [off, need, LOCAL, LOCAL]
                    return Slot(off, need, nbytes, tag)
        return None

    def _give(self, off: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, off)
        if i < len(self._starts) and off + length == self._starts[i]:
            length += self._lens[i]
            del self._starts[i]
            del self._lens[i]
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == off:
            self._lens[i - 1] += length
        else:
            self._starts.insert(i, off)
            self._lens.insert(i, length)

    def _send(self, tag: int) -> KvxferError | None:
        claim = self._claims.get(tag)
        if claim is None or claim[2] not in (LOCAL, LOST):
            return KvxferError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"claimed slot {tag} was already enqueued, or released: it is not the engine's to enqueue")
        claim[3], claim[2] = claim[2], SENT
        return None

    def sent(self, tag: int) -> None:
        """Before enqueueing claim `tag`; raises (nothing sent) if it is not the engine's to send."""
        with self._lock:
            err = self._send(tag)
        if err is not None:
            raise err

    def sent_many(self, tags: Sequence[int]) -> list[KvxferError | None]:
        """sent() for a batch's claims (0: a chunk with no claim): the error of each that may not
        be sent (None for the others, which are now SENT)."""
        with self._lock:
            return [self._send(tag) if tag else None for tag in tags]

    def settle_many(self, tags: Sequence[int], results: Sequence[BaseException | None] | BaseException,
                    freed: Iterable[int] = ()) -> None:
        """The verdicts on a batch's sent claims (None: accepted), or the one error the whole
        call raised."""
        failed: list[tuple[int, BaseException]] = []
        with self._lock:  # once per batch: this runs per chunk of batches of thousands
            self._freed(freed)
            claims = self._claims
            if isinstance(results, BaseException):
                failed = [(tag, results) for tag in tags if tag]
            else:
                for tag, res in zip(tags, results, strict=True):
                    if res is not None:
                        failed.append((tag, res))
                        continue
                    claim = claims.get(tag) if tag else None
                    if claim is not None and claim[2] == SENT:
                        claim[2] = HELD
        for tag, exc in failed:
            if tag:
                self.failed(tag, exc)

    def verdict(self, tag: int, accepted: bool, freed: Iterable[int] = ()) -> None:
        """The daemon's verdict on the chunk in claim `tag`: refused leaves the slot the engine's."""
        with self._lock:
            self._freed(freed)
            claim = self._claims.get(tag)
            if claim is not None and claim[2] == SENT:
                claim[2] = HELD if accepted else claim[3]

    def failed(self, tag: int, exc: BaseException) -> None:
        """The enqueue of claim `tag` raised, or its verdict is this error."""
        # Never sent, or refused: the claim is as it was before it was sent.
        if isinstance(exc, NotSent) or (
                isinstance(exc, KvxferError) and not isinstance(exc, ReplyLost) and exc.code in _REFUSALS):
            self.verdict(tag, False)
        else:
            self.lost(tag)

    def lost(self, tag: int) -> None:
        with self._lock:
            claim = self._claims.get(tag)
            if claim is not None:
                claim[2] = LOST

    def freed(self, tags: Iterable[int]) -> None:
        with self._lock:
            self._freed(tags)

    def _freed(self, tags: Iterable[int]) -> None:
        pop, give = self._claims.pop, self._give
        for tag in tags:
            claim = pop(tag, None)
            if claim is not None:
                give(claim[0], claim[1])

    def release(self, tag: int) -> None:
        """Frees a LOCAL slot (cut, never taken by the daemon). A LOST one stays out until the
        daemon lets it go; one enqueued and not refused is not the engine's to release."""
        with self._lock:
            claim = self._claims.get(tag)
            if claim is not None and claim[2] == LOST:
                return
            if claim is None or claim[2] != LOCAL:
                raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"claimed slot {tag} is not the engine's to release (enqueued, or released already)")
            del self._claims[tag]
            self._give(claim[0], claim[1])

    def wait_request(self, req: engine_pb2.AcquireSlotRequest) -> engine_pb2.AcquireSlotRequest:
        """An AcquireSlot request made a wait for freed claims, naming those believed held."""
        req.claims = True
        req.held_claims.extend(self.believed())
        return req

    def freed_then_cut(self, freed: Iterable[int], num_tokens: int) -> Slot | None:
        self.freed(freed)
        return self.cut(num_tokens)

    def believed(self) -> list[int]:
        """The claims the daemon took and has not been heard letting go of."""
        with self._lock:
            return [tag for tag, c in self._claims.items() if c[2] == HELD]

    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._lens)

    def states(self) -> dict[int, int]:
        """Claims by state (for status and tests)."""
        with self._lock:
            out = dict.fromkeys((LOCAL, SENT, HELD, LOST), 0)
            for c in self._claims.values():
                out[c[2]] += 1
            return out


def split_batch(claims: ClaimRing, chunks: Sequence[Any]) -> tuple[list[int], list[KvxferError | None], list[int] | None]:
    """Marks a batch's claims sent: (each chunk's tag, 0 for none; the error of each that may
    not be sent, None for the others; the indexes of those to send, None when that is all)."""
    tags = [c.slot.claim if c.slot is not None else 0 for c in chunks]
    errors = claims.sent_many(tags)
    if not any(errors):
        return tags, errors, None
    return tags, errors, [i for i, e in enumerate(errors) if e is None]


def merge_batch(claims: ClaimRing, tags: list[int], errors: list[KvxferError | None], send: list[int] | None,
                got: Sequence[KvxferError | None] | BaseException, freed: Iterable[int] = ()) -> list[KvxferError | None]:
    """Settles the sent chunks' claims with `got` (their results, or the call's error) and puts
    their results in their places."""
    if send is None:
        claims.settle_many(tags, got, freed)
        return errors if isinstance(got, BaseException) else list(got)
    claims.settle_many([tags[i] for i in send], got, freed)
    if not isinstance(got, BaseException):
        for i, res in zip(send, got, strict=True):
            errors[i] = res
    return errors
