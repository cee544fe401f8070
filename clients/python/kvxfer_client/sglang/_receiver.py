"""The decode side's per-room object of the sglang backend (see ``_conn`` for the whole)."""

from __future__ import annotations

import collections
import logging
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from kvxfer_client._sync import DecodeReceiver
from kvxfer_client.errors import KvxferError
from kvxfer_client.sglang._bootstrap import PrefillRoute
from kvxfer_client.sglang._conn import KvxferdKVManager, KvxferdTransferError
from kvxfer_client.sglang._watch import RoomView
from kvxfer_client.types import Landed, RoomEvent, RoomState

logger = logging.getLogger(__name__)


class KvxferdKVReceiver(BaseKVReceiver):
    """One room on a decode rank: the manager's loader scatters each chunk as its landed event
    comes, watermarks it and, on SUCCESS, writes the aux item; poll() reads the outcome."""

    def __init__(self, mgr: KvxferdKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        assert mgr.mode == "decode", "a KV receiver needs a decode-mode manager"
        self.mgr = mgr
        self.kv_mgr = mgr  # sglang's queues read the manager under this name
        self.bootstrap_addr = bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self.route: PrefillRoute | None = None
        self.pages: list[int] = []
        self.aux_index: int | None = None
        self.done_chunks: set[int] = set()
        self.state = KVPoll.Bootstrapping
        self.events: collections.deque[RoomEvent] = collections.deque()  # appended by the watch thread
        self.view = RoomView()
        self._tokens = 0  # scattered so far
        self._error = ""

    @property
    def rx(self) -> DecodeReceiver:
        # The manager registers with its daemon once it knows a prefill's layout, which sglang
        # looks up (try_ensure_parallel_info) after it has made this receiver.
        assert self.mgr.rx is not None, "the decode rank has no prefill route yet"
        return self.mgr.rx

    @property
    def conclude_state(self) -> int | None:
        """The room's outcome once it has one (sglang's queues read it), else None."""
        return self.state if self.state in (KVPoll.Success, KVPoll.Failed) else None

    def init(self, prefill_dp_rank: int = 0) -> None:
        """sglang calls this once ``try_ensure_parallel_info`` found the prefill's route (as for its
        own backends, a receiver without one fails)."""
        self.route = self.mgr.prefill_info_table.get(self.bootstrap_addr)
        if self.route is None:
            self.fail(f"no kvxferd route for the prefill at {self.bootstrap_addr} (try_ensure_parallel_info "
                      f"has not found one)")
            return
        if prefill_dp_rank != 0:
            self.fail(f"prefill DP rank {prefill_dp_rank}: a kvxferd prefill instance has one DP rank")
            return
        self.state = KVPoll.WaitingForInput

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None) -> None:
        if self.route is None:
            return
        self.pages = [int(p) for p in kv_indices]
        self.aux_index = aux_index
        self.mgr.watch(self)  # before the room exists: no event of it can come unheard
        try:
            self.rx.expect(self.room, self.route.address, self.route.group, len(self.pages) * self.mgr.page_size)
        except KvxferError as exc:
            self.mgr.unwatch(self.room)
            self.mgr.forget_route(self.bootstrap_addr)
            self.fail(f"ExpectRoom failed: {exc}")
            return
        self.state = KVPoll.Transferring

    def advance(self, epoch: int) -> list[int]:
        """Loader thread: scatters the chunks that landed since the last call (from events, or
        from PollRoom when the events may have missed something); returns their ids to watermark."""
        if self.state != KVPoll.Transferring or self.view.state in (RoomState.SUCCESS, RoomState.FAILED):
            self.events.clear()
            return []
        try:
            landed: list[Landed] = []
            while self.events:
                ev = self.events.popleft()
                if ev.landed is not None:
                    landed.append(ev.landed)
                self.view.update(ev, epoch)
            if self.view.stale(epoch) or (self.view.state is RoomState.SUCCESS and not self._complete()):
                # Events may have been lost with a stream (a SUCCESS with chunks unseen says so):
                # the daemon lists every landed chunk not watermarked yet.
                st = self.rx.poll(self.room)
                landed += st.landed
                self.view.update(st, epoch)
            return self._scatter(landed)
        except Exception as exc:
            self.fail(f"load failed: {exc}")
            self.abort()
            return []

    def _scatter(self, landed: list[Landed]) -> list[int]:
        ps = self.mgr.page_size
        fresh: list[int] = []
        for c in landed:
            if c.chunk_id in self.done_chunks:
                continue
            first = c.token_start // ps
            chunk_pages = self.pages[first : first + c.num_tokens // ps]
            self.mgr.paged.scatter(chunk_pages, self.mgr.paged.slot(self.rx.tensor(c.offset, c.chunk_bytes), c.num_tokens))
            self.done_chunks.add(c.chunk_id)
            self._tokens += c.num_tokens
            fresh.append(c.chunk_id)
        return fresh

    def _complete(self) -> bool:
        return self._tokens >= len(self.pages) * self.mgr.page_size

    def finish(self) -> bool:
        """Loader thread, after the sweep's watermarks: True once the room has its outcome."""
        if self.state in (KVPoll.Success, KVPoll.Failed):
            return True
        if self.state != KVPoll.Transferring:
            return False  # send_metadata is still expecting the room
        if self.view.state is RoomState.FAILED:
            self.fail(self.view.failure)
            return True
        if self.view.state is RoomState.SUCCESS:
            if not self._complete():
                self.fail(f"SUCCESS with {self._tokens} of {len(self.pages) * self.mgr.page_size} tokens seen")
                return True
            if self.aux_index is not None:
                self.mgr.write_aux(self.aux_index, self.view.aux)
            self.state = KVPoll.Success
            return True
        return False

    def fail(self, why: str) -> None:
        self._error = self._error or why
        self.state = KVPoll.Failed

    def poll(self) -> int:
        return self.state

    def failure_exception(self) -> None:
        raise KvxferdTransferError(self.room, self._error or "transfer failed")

    def abort(self) -> None:
        # A rank that never found a prefill route (sglang aborts its pending requests after 15
        # lookups) has no daemon to tell; the room then fails here only.
        if self.mgr.rx is not None:
            try:
                self.rx.abort(self.room, "aborted by the decode engine")
            except KvxferError as exc:
                logger.debug("abort room %d: %s", self.room, exc)
        self.fail(self._error or "aborted")

    def clear(self) -> None:
        self.mgr.unwatch(self.room)
        if self.mgr.rx is None:
            return
        try:
            self.rx.release(self.room)
        except KvxferError:
            pass
