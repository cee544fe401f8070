"""The ``kvxferd`` transfer backend for sglang's PD disaggregation, over the kvxfer client library.

* ``KvxferdKVManager`` (one per TP rank) registers the rank with its node's daemon once: a prefill
  or a decode engine whose layout comes from ``KVArgs`` (layers, local/total KV heads, page size,
  bytes per head), and wraps the pool's K/V buffers and the aux (metadata) buffers in place.
* ``KvxferdKVSender.send(page_indices)`` gathers those pages of every layer into a ring slot and
  enqueues them as the next chunk of the room (``bootstrap_room``); the last chunk carries the
  request's aux item (first output token, logprobs, ...).
* ``KvxferdKVReceiver.send_metadata(page_indices, aux_index)`` (``_receiver.py``) expects the room; the manager's
  loader thread scatters each chunk into those pages as it lands and, on success, writes the aux
  item. Head slicing between prefill and decode TP sizes is the daemon's.
* ``KvxferdKVBootstrapServer`` (``_bootstrap.py``, on the prefill host, sglang's bootstrap port)
  tells decode ranks which daemon and group serve a prefill instance; it is the only thing the
  two sides exchange outside kvxferd. sglang's decode prealloc queue asks the manager for it with
  ``try_ensure_parallel_info(bootstrap_addr)`` before it inits a receiver, and reads the cached
  answer from ``prefill_info_table`` (as for its own backends).

Room states map one to one onto ``KVPoll``; a failed room raises ``KvxferdTransferError`` from
``failure_exception`` with the daemon's failure code and reason.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import grpc
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)

from kvxfer_client._sync import DecodeReceiver
from kvxfer_client._sync_prefill import PrefillSender
from kvxfer_client.errors import ChunkRefused, KvxferError
from kvxfer_client.sglang._bootstrap import PrefillRoute, fetch_route, put_route
from kvxfer_client.sglang._pages import PagedBuffers, dtype_bytes, wrap
from kvxfer_client.sglang._watch import RESYNC_S, RoomView, RoomWatch
from kvxfer_client.types import Layout, RoomEvent, RoomState

if TYPE_CHECKING:
    from kvxfer_client.sglang._receiver import KvxferdKVReceiver

logger = logging.getLogger(__name__)

RING_BYTES_ENV = "KVXFER_SGLANG_RING_BYTES"
# One route lookup (sglang's queue retries a failed one each second, 15 times, then fails its rooms).
ROUTE_TIMEOUT_S = 5.0
_POLL = {RoomState.BOOTSTRAPPING: KVPoll.Bootstrapping, RoomState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
         RoomState.TRANSFERRING: KVPoll.Transferring, RoomState.SUCCESS: KVPoll.Success,
         RoomState.FAILED: KVPoll.Failed}


class KvxferdTransferError(Exception):
    """A room that failed; shaped like sglang's own KVTransferError (room, reason)."""

    def __init__(self, bootstrap_room: int, failure_reason: str) -> None:
        super().__init__(f"room {bootstrap_room}: {failure_reason}")
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason


def _mode(mode: Any) -> str:
    return str(getattr(mode, "value", mode))


class KvxferdKVManager(BaseKVManager):
    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.mode = _mode(disaggregation_mode)
        if self.mode not in ("prefill", "decode"):
            raise ValueError(f"kvxferd backend: disaggregation mode {self.mode!r} is neither prefill nor decode")
        self.is_mla = bool(is_mla_backend)
        self.page_size = int(args.page_size)
        self._device = "cuda" if getattr(server_args, "device", "cpu") == "cuda" else "cpu"
        self.aux = [wrap(p, n) for p, n in zip(args.aux_data_ptrs, args.aux_data_lens, strict=True)]
        self.aux_item_lens = list(args.aux_item_lens)
        self.tp_size = int(getattr(server_args, "tp_size", 1))
        self.tp_rank = int(args.engine_rank) % self.tp_size
        self.bootstrap_host = str(getattr(server_args, "host", "127.0.0.1"))
        self.bootstrap_port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
        # One group per serving instance, the same on every TP rank of it.
        self.group = (f"sglang-prefill-{self.bootstrap_host}:{self.bootstrap_port}" if self.mode == "prefill"
                      else f"sglang-decode-{self.bootstrap_host}:{getattr(server_args, 'port', 0)}")
        # bootstrap address -> route of that prefill instance (decode side; sglang's queues read it).
        self.prefill_info_table: dict[str, PrefillRoute] = {}
        self._lock = threading.Lock()
        self._receivers: dict[int, KvxferdKVReceiver] = {}
        self._senders: dict[int, KvxferdKVSender] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.tx: PrefillSender | None = None
        self.rx: DecodeReceiver | None = None
        self.pages: PagedBuffers | None = None
        self.events: RoomWatch | None = None
        heads = 1 if self.is_mla else getattr(args, "kv_head_num", None)
        if heads is not None:
            self._start(int(heads), self._own_layout(int(heads)))
        elif self.mode == "prefill":
            raise ValueError("kvxferd backend: a prefill KVArgs without kv_head_num (sglang sets it for MHA pools)")
        # Else a decode rank: sglang's decode KVArgs do not say the KV heads, so the rank
        # registers with the layout the first prefill route tells (try_ensure_parallel_info).

    @property
    def paged(self) -> PagedBuffers:
        assert self.pages is not None, "the rank has not registered with its daemon yet"
        return self.pages

    @property
    def epoch(self) -> int:
        """Room-event streams opened so far (see RoomWatch.epoch)."""
        return self.events.epoch if self.events is not None else 0

    def _own_layout(self, heads: int) -> Layout:
        """The layout as this rank's KVArgs say it. A dtype sglang names "auto" (the model's) has
        no width here: the head is then described in bytes, which is all the daemon moves."""
        item = self.kv_args.kv_item_lens[0]
        head_bytes = item // (self.page_size * heads)
        try:
            width = 1 if self.is_mla else dtype_bytes(str(getattr(self.kv_args, "kv_cache_dtype_str", "") or "auto"))
        except ValueError:
            width = 1
        total = 1 if self.is_mla else int(getattr(self.kv_args, "total_kv_head_num", 0) or heads * self.tp_size)
        planes = 1 if self.is_mla else 2
        return Layout(num_layers=len(self.kv_args.kv_data_ptrs) // planes, total_kv_heads=total,
                      head_dim=head_bytes // width, dtype_bytes=width, page_size=self.page_size, mla=self.is_mla)

    def _start(self, heads: int, layout: Layout) -> None:
        """Wraps the pool, registers the rank with its daemon and starts the room-event reader
        (and, on decode, the loader)."""
        args = self.kv_args
        self.pages = PagedBuffers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, 1 if self.is_mla else 2,
                                  self.page_size, heads, self._device)
        common: dict[str, Any] = {"group": self.group, "layout": layout, "tp_size": self.tp_size,
                                  "tp_rank": self.tp_rank, "ring_bytes": int(os.environ.get(RING_BYTES_ENV, 64 << 20)),
                                  "name": f"sglang-{self.mode}-tp{self.tp_rank}"}
        if self.mode == "prefill":
            self.tx = PrefillSender(**common)
            self.events = RoomWatch(self.tx, "kvxfer-sglang-events", self._sender_events)
            self.register_to_bootstrap()
        else:
            self.rx = DecodeReceiver(**common)
            self.events = RoomWatch(self.rx, "kvxfer-sglang-events", self._receiver_events)
            threading.Thread(target=self._load_loop, name="kvxfer-sglang-load", daemon=True).start()

    def register_to_bootstrap(self) -> None:
        assert self.tx is not None
        lay = self.tx.layout
        put_route(f"{self.bootstrap_host}:{self.bootstrap_port}",
                  PrefillRoute(self.group, self.tx.peer_address, self.tp_size, self.page_size, lay.total_kv_heads,
                               lay.head_dim, lay.dtype_bytes, lay.mla))

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One attempt to learn the route of the prefill instance at `bootstrap_addr` (cached once
        known): sglang's decode prealloc queue calls it before it inits receivers of that instance
        and retries a False later. A prefill of another page size is a setup error, raised as
        sglang's own backends raise it."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            route = fetch_route(bootstrap_addr, ROUTE_TIMEOUT_S)
        except (OSError, ValueError) as exc:
            # sglang retries each second and logs its own error when it gives up (15 tries).
            logger.info("no kvxferd route from the prefill bootstrap server %s yet: %s", bootstrap_addr, exc)
            return False
        if route.page_size != self.page_size:
            raise RuntimeError(f"page size mismatch: the prefill at {bootstrap_addr} has page_size={route.page_size}, "
                               f"this decode {self.page_size}; both must use the same --page-size")
        if self.rx is None:
            self._start_from(route, bootstrap_addr)
        elif self._route_layout(route) != self.rx.layout:
            # The daemon would refuse every room of it; say so where the setup is made.
            raise RuntimeError(f"KV layout mismatch: the prefill at {bootstrap_addr} has {self._route_layout(route)}, "
                               f"this decode registered {self.rx.layout} (from the first prefill it met)")
        self.prefill_info_table[bootstrap_addr] = route
        return True

    def _start_from(self, route: PrefillRoute, bootstrap_addr: str) -> None:
        """Registers this decode rank with the KV layout the prefill instance says (sglang's decode
        KVArgs have no head counts); the rank's own pool must hold this rank's share of it."""
        if not route.total_kv_heads or route.mla != self.is_mla:
            raise RuntimeError(f"the prefill at {bootstrap_addr} does not say a KV layout this decode can take "
                               f"(mla={route.mla}, this decode mla={self.is_mla})")
        heads = 1 if self.is_mla else max(1, route.total_kv_heads // self.tp_size)
        want = self.page_size * heads * route.head_dim * route.dtype_bytes
        if self.kv_args.kv_item_lens[0] != want:
            raise RuntimeError(f"KV layout mismatch: the prefill at {bootstrap_addr} has {route.total_kv_heads} KV heads "
                               f"of {route.head_dim * route.dtype_bytes} B, so a page of this decode (TP {self.tp_size}) "
                               f"would be {want} B; it is {self.kv_args.kv_item_lens[0]} B")
        self._start(heads, self._route_layout(route))

    def _route_layout(self, route: PrefillRoute) -> Layout:
        return Layout(num_layers=len(self.kv_args.kv_data_ptrs) // (1 if self.is_mla else 2),
                      total_kv_heads=route.total_kv_heads, head_dim=route.head_dim, dtype_bytes=route.dtype_bytes,
                      page_size=self.page_size, mla=route.mla)

    def forget_route(self, bootstrap_addr: str) -> None:
        """Drops a route that failed (the prefill instance may have come back elsewhere): the next
        request of that instance looks it up again."""
        self.prefill_info_table.pop(bootstrap_addr, None)

    def aux_bytes(self, index: int) -> bytes:
        return b"".join(bytes(buf[index * n : (index + 1) * n].numpy()) for buf, n in zip(self.aux, self.aux_item_lens, strict=True))

    def write_aux(self, index: int, data: bytes) -> None:
        at = 0
        for buf, n in zip(self.aux, self.aux_item_lens, strict=True):
            buf[index * n : (index + 1) * n].copy_(wrap_bytes(data[at : at + n]))
            at += n

    # -- prefill: room states by push, refusals routed to their room --------------------------
    def track(self, sender: KvxferdKVSender) -> None:
        with self._lock:
            self._senders[sender.room] = sender

    def untrack(self, room: int) -> None:
        with self._lock:
            self._senders.pop(room, None)

    def _sender_events(self, batch: list[RoomEvent]) -> None:
        epoch = self.epoch
        with self._lock:
            for ev in batch:
                sender = self._senders.get(ev.room)
                if sender is not None:
                    sender.view.update(ev, epoch)

    def settle(self) -> None:
        """Verdicts of chunks sent without waiting that are already here: a refusal fails its
        room (whichever sender sent it) on the calling thread."""
        assert self.tx is not None
        for refused in self.tx.settle():
            self.refused(refused)

    def release_slot(self, slot: Any) -> None:
        """Gives a slot back; a daemon that already freed it (the engine's lease ended) is fine."""
        assert self.tx is not None
        try:
            self.tx.release_slot(slot)
        except KvxferError:
            pass

    def refused(self, r: ChunkRefused) -> None:
        if not r.lost and r.slot is not None:
            self.release_slot(r.slot)  # the daemon left it to us
        with self._lock:
            sender = self._senders.get(r.room)
        if sender is not None:
            sender.fail(f"chunk {r.chunk_id} not taken: {r.message}")

    # -- decode: loads off sglang's scheduler thread, driven by room events ---------------------
    def watch(self, recv: KvxferdKVReceiver) -> None:
        with self._lock:
            self._receivers[recv.room] = recv
        self._wake.set()

    def unwatch(self, room: int) -> None:
        with self._lock:
            self._receivers.pop(room, None)

    def _receiver_events(self, batch: list[RoomEvent]) -> None:
        with self._lock:
            for ev in batch:
                recv = self._receivers.get(ev.room)
                if recv is not None:
                    recv.events.append(ev)
        self._wake.set()

    def _load_loop(self) -> None:
        assert self.rx is not None
        active: list[KvxferdKVReceiver] = []
        while not self._stop.is_set():
            # Events wake the loop; without any, rooms in flight are looked at every RESYNC_S
            # (each polls once if it heard nothing for that long).
            self._wake.wait(RESYNC_S / 2 if active else 1.0)
            self._wake.clear()
            with self._lock:
                active = list(self._receivers.values())
            epoch = self.epoch
            marks: list[tuple[KvxferdKVReceiver, list[int]]] = []
            for recv in active:
                fresh = recv.advance(epoch)
                if fresh:
                    marks.append((recv, fresh))
            if marks:
                # Every chunk read in this sweep goes back in one call, before any of their rooms
                # reports Success (sglang then releases the room).
                errs = self.rx.watermark_many([(r.room, ids) for r, ids in marks])
                for (recv, _), err in zip(marks, errs, strict=True):
                    if err is not None:
                        recv.fail(f"watermark failed: {err}")
            for recv in active:
                if recv.finish():
                    self.unwatch(recv.room)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.events is not None:
            self.events.close()
        for c in (self.tx, self.rx):
            if c is not None:
                c.close()


def wrap_bytes(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class KvxferdKVSender(BaseKVSender):
    """One room on a prefill rank. send() does not wait for the daemon's verdict (a refusal fails
    the room at the rank's next send() or poll()); poll() answers from the room's events and asks
    the daemon only before this rank's first chunk or when the events may have missed something."""

    def __init__(self, mgr: KvxferdKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        assert mgr.tx is not None, "a KV sender needs a prefill-mode manager"
        self.mgr, self.tx, self.room = mgr, mgr.tx, int(bootstrap_room)
        self.kv_mgr = mgr  # sglang's queues read the manager under this name
        self.num_pages = 0
        self.aux_index: int | None = None
        self.sent_pages = 0
        self.chunk_id = 0
        self.bytes = 0
        self._error = ""
        self.view = RoomView()
        mgr.track(self)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **_: Any) -> None:
        pages = [int(p) for p in kv_indices]
        if not pages or self._error:
            return
        ps = self.mgr.page_size
        tokens = len(pages) * ps
        last = self.sent_pages + len(pages) >= self.num_pages
        try:
            slot = self._settling(lambda: self.tx.acquire(tokens))
        except KvxferError as exc:
            self.fail(f"send failed: {exc}")
            return
        if self._error:  # a refusal of this room's earlier chunk came in
            self.mgr.release_slot(slot)
            return
        try:
            self.mgr.paged.gather(pages, self.mgr.paged.slot(self.tx.tensor(slot.offset, slot.chunk_bytes), tokens))
            aux = self.mgr.aux_bytes(self.aux_index) if last and self.aux_index is not None else b""
            self._settling(lambda: self.tx.enqueue(self.room, self.chunk_id, self.sent_pages * ps, tokens, slot,
                                                   last=last, aux=aux, wait=False))
        except Exception as exc:
            self.mgr.release_slot(slot)
            self.fail(f"send failed: {exc}")
            return
        self.sent_pages += len(pages)
        self.chunk_id += 1
        self.bytes += slot.chunk_bytes

    def _settling(self, call: Any) -> Any:
        """Runs a client call that first raises any unread refusal of an earlier chunk (before it
        does anything): each such refusal fails its own room, then the call runs again."""
        while True:
            try:
                return call()
            except ChunkRefused as r:
                self.mgr.refused(r)

    def fail(self, why: str) -> None:
        """The room cannot finish from here: the decode side hears it at once (AbortRoom)."""
        if self._error:
            return
        self._error = why
        self._abort_room(why)

    def _abort_room(self, reason: str) -> None:
        try:
            self.tx.abort(self.room, reason)
        except KvxferError as exc:
            logger.debug("abort room %d: %s", self.room, exc)

    def poll(self) -> int:
        if not self._error:
            self.mgr.settle()
        if self._error:
            return KVPoll.Failed
        view = self.view
        if self.chunk_id and view.state is not None and not view.stale(self.mgr.epoch):
            return self._state(view.state, view.failure)
        return self._poll_daemon()

    def _state(self, state: RoomState, failure: str) -> int:
        if state is RoomState.FAILED:
            self._error = self._error or failure
        if state in (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT):
            # Chunks wait in the ring for the decode's handshake, so prefill never waits for it:
            # before this rank's first chunk the room waits for input, after it the transfer is
            # under way (sglang's inflight queue takes only those two, Bootstrapping is an error there).
            return KVPoll.Transferring if self.chunk_id else KVPoll.WaitingForInput
        return _POLL[state]

    def _poll_daemon(self) -> int:
        epoch = self.mgr.epoch
        try:
            st = self.tx.poll(self.room)
        except KvxferError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND and self.chunk_id == 0:
                # No rank of the group has enqueued and no decode rank has bootstrapped the room
                # yet. The rank may go ahead: chunks wait in the ring until the decode side
                # bootstraps, so prefill never waits for the decode's handshake.
                return KVPoll.WaitingForInput
            self._error = str(exc)
            return KVPoll.Failed
        if not self.chunk_id:
            return self._state(st.state, f"{st.failure_code}: {st.failure_reason}")
        self.view.update(st, epoch)
        return self._state(st.state, self.view.failure)

    def failure_exception(self) -> None:
        raise KvxferdTransferError(self.room, self._error or "transfer failed")

    def get_transfer_metric(self) -> Any:
        return KVTransferMetric(transfer_total_bytes=self.bytes)

    def abort(self) -> None:
        self._abort_room(self._error or "aborted by the prefill engine")
        self._error = self._error or "aborted"

    def clear(self) -> None:
        self.mgr.untrack(self.room)
        if self._error:
            # A failed room stays on the daemon (FAILED is sticky) rather than being released: a
            # decode rank that bootstraps late must see the failure, not a fresh room that no
            # prefill rank will ever fill. The daemon drops it at the room deadline.
            return
        try:
            self.tx.release(self.room)
        except KvxferError:
            pass
