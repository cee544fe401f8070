"""The ``kvxferd`` transfer backend for sglang's PD disaggregation, over the kvxfer client library.

* ``KvxferdKVManager`` (one per TP rank) registers the rank with its node's daemon once: a prefill
  or a decode engine whose layout comes from ``KVArgs`` (layers, local/total KV heads, page size,
  bytes per head), and wraps the pool's K/V buffers and the aux (metadata) buffers in place.
* ``KvxferdKVSender.send(page_indices)`` gathers those pages of every layer into a ring slot and
  enqueues them as the next chunk of the room (``bootstrap_room``); the last chunk carries the
  request's aux item (first output token, logprobs, ...).
* ``KvxferdKVReceiver.send_metadata(page_indices, aux_index)`` expects the room; the manager's
  loader thread scatters each chunk into those pages as it lands and, on success, writes the aux
  item. Head slicing between prefill and decode TP sizes is the daemon's.
* ``KvxferdKVBootstrapServer`` (on the prefill host, sglang's bootstrap port) tells decode ranks
  which daemon and group serve a prefill instance; it is the only thing the two sides exchange
  outside kvxferd.

Room states map one to one onto ``KVPoll``; a failed room raises ``KvxferdTransferError`` from
``failure_exception`` with the daemon's failure code and reason.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)

from kvxfer_client._common import KvxferError, Layout, RoomState
from kvxfer_client._sync import DecodeReceiver, PrefillSender
from kvxfer_client.sglang._pages import PagedBuffers, dtype_bytes, wrap

logger = logging.getLogger(__name__)

RING_BYTES_ENV = "KVXFER_SGLANG_RING_BYTES"
ROUTE_TIMEOUT_S = 30.0
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
        planes = 1 if self.is_mla else 2
        heads = 1 if self.is_mla else int(args.kv_head_num)
        device = "cuda" if getattr(server_args, "device", "cpu") == "cuda" else "cpu"
        self.pages = PagedBuffers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, planes,
                                  int(args.page_size), heads, device)
        self.aux = [wrap(p, n) for p, n in zip(args.aux_data_ptrs, args.aux_data_lens, strict=True)]
        self.aux_item_lens = list(args.aux_item_lens)
        width = dtype_bytes(str(getattr(args, "kv_cache_dtype_str", "") or "auto"), None) if not self.is_mla else 1
        layout = Layout(
            num_layers=self.pages.layers, total_kv_heads=1 if self.is_mla else int(args.total_kv_head_num),
            head_dim=self.pages.head_bytes // width, dtype_bytes=width, page_size=int(args.page_size),
            mla=self.is_mla,
        )
        self.tp_size = int(getattr(server_args, "tp_size", 1))
        self.tp_rank = int(args.engine_rank) % self.tp_size
        self.bootstrap_host = str(getattr(server_args, "host", "127.0.0.1"))
        self.bootstrap_port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
        # One group per serving instance, the same on every TP rank of it.
        self.group = (f"sglang-prefill-{self.bootstrap_host}:{self.bootstrap_port}" if self.mode == "prefill"
                      else f"sglang-decode-{self.bootstrap_host}:{getattr(server_args, 'port', 0)}")
        common: dict[str, Any] = {"group": self.group, "layout": layout, "tp_size": self.tp_size,
                                  "tp_rank": self.tp_rank, "ring_bytes": int(os.environ.get(RING_BYTES_ENV, 64 << 20)),
                                  "name": f"sglang-{self.mode}-tp{self.tp_rank}"}
        self.tx = PrefillSender(**common) if self.mode == "prefill" else None
        self.rx = DecodeReceiver(**common) if self.mode == "decode" else None
        self._lock = threading.Lock()
        self._receivers: dict[int, KvxferdKVReceiver] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        if self.rx is not None:
            threading.Thread(target=self._load_loop, name="kvxfer-sglang-load", daemon=True).start()
            threading.Thread(target=self._event_loop, name="kvxfer-sglang-events", daemon=True).start()
        if self.tx is not None:
            self.register_to_bootstrap()

    def register_to_bootstrap(self) -> None:
        assert self.tx is not None
        body = json.dumps({"group": self.group, "address": self.tx.peer_address, "tp_size": self.tp_size}).encode()
        req = urllib.request.Request(f"http://{self.bootstrap_host}:{self.bootstrap_port}/kvxferd/route",
                                     data=body, method="PUT", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def aux_bytes(self, index: int) -> bytes:
        return b"".join(bytes(buf[index * n : (index + 1) * n].numpy()) for buf, n in zip(self.aux, self.aux_item_lens, strict=True))

    def write_aux(self, index: int, data: bytes) -> None:
        at = 0
        for buf, n in zip(self.aux, self.aux_item_lens, strict=True):
            buf[index * n : (index + 1) * n].copy_(wrap_bytes(data[at : at + n]))
            at += n

    # -- decode: loads off sglang's scheduler thread --------------------------------------------
    def watch(self, recv: KvxferdKVReceiver) -> None:
        with self._lock:
            self._receivers[recv.room] = recv
        self._wake.set()

    def _event_loop(self) -> None:
        assert self.rx is not None
        while not self._stop.is_set():
            try:
                for _ in self.rx.watch():
                    self._wake.set()
            except KvxferError as exc:
                logger.debug("room event stream ended: %s", exc)
            self._stop.wait(0.2)

    def _load_loop(self) -> None:
        active: list[KvxferdKVReceiver] = []
        while not self._stop.is_set():
            # Events wake the loop; a short sweep while rooms are active covers any missed one.
            self._wake.wait(0.02 if active else 1.0)
            self._wake.clear()
            with self._lock:
                active = list(self._receivers.values())
            for recv in active:
                if recv.advance():
                    with self._lock:
                        self._receivers.pop(recv.room, None)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for c in (self.tx, self.rx):
            if c is not None:
                c.close()


def wrap_bytes(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class KvxferdKVSender(BaseKVSender):
    def __init__(self, mgr: KvxferdKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        assert mgr.tx is not None, "a KV sender needs a prefill-mode manager"
        self.mgr, self.tx, self.room = mgr, mgr.tx, int(bootstrap_room)
        self.num_pages = 0
        self.aux_index: int | None = None
        self.sent_pages = 0
        self.chunk_id = 0
        self.bytes = 0
        self._error = ""

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **_: Any) -> None:
        pages = [int(p) for p in kv_indices]
        if not pages or self._error:
            return
        ps = self.mgr.pages.page_size
        tokens = len(pages) * ps
        last = self.sent_pages + len(pages) >= self.num_pages
        slot = self.tx.acquire(tokens)
        try:
            self.mgr.pages.gather(pages, self.mgr.pages.slot(self.tx.tensor(slot.offset, slot.chunk_bytes), tokens))
            aux = self.mgr.aux_bytes(self.aux_index) if last and self.aux_index is not None else b""
            self.tx.enqueue(self.room, self.chunk_id, self.sent_pages * ps, tokens, slot, last=last, aux=aux)
        except Exception as exc:
            self._quiet_release(slot)
            self._error = f"send failed: {exc}"
            self.abort()
            return
        self.sent_pages += len(pages)
        self.chunk_id += 1
        self.bytes += slot.chunk_bytes

    def _quiet_release(self, slot: Any) -> None:
        try:
            self.tx.release_slot(slot)
        except KvxferError:
            pass

    def poll(self) -> int:
        if self._error:
            return KVPoll.Failed
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
        if st.state is RoomState.BOOTSTRAPPING and self.chunk_id == 0:
            return KVPoll.WaitingForInput  # another rank opened the room first: the same holds
        if st.state is RoomState.FAILED:
            self._error = f"{st.failure_code}: {st.failure_reason}"
        return _POLL[st.state]

    def failure_exception(self) -> None:
        raise KvxferdTransferError(self.room, self._error or "transfer failed")

    def get_transfer_metric(self) -> Any:
        return KVTransferMetric(transfer_total_bytes=self.bytes)

    def abort(self) -> None:
        try:
            self.tx.abort(self.room, self._error or "aborted by the prefill engine")
        except KvxferError as exc:
            logger.debug("abort room %d: %s", self.room, exc)
        self._error = self._error or "aborted"

    def clear(self) -> None:
        if self._error:
            # A failed room stays on the daemon (FAILED is sticky) rather than being released: a
            # decode rank that bootstraps late must see the failure, not a fresh room that no
            # prefill rank will ever fill. The daemon drops it at the room deadline.
            return
        try:
            self.tx.release(self.room)
        except KvxferError:
            pass


class KvxferdKVReceiver(BaseKVReceiver):
    def __init__(self, mgr: KvxferdKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        assert mgr.rx is not None, "a KV receiver needs a decode-mode manager"
        self.mgr, self.rx = mgr, mgr.rx
        self.bootstrap_addr = bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self.route: dict[str, Any] | None = None
        self.pages: list[int] = []
        self.aux_index: int | None = None
        self.done_chunks: set[int] = set()
        self.state = KVPoll.Bootstrapping
        self._error = ""

    def init(self, prefill_dp_rank: int = 0) -> None:
        # Off the scheduler thread: the prefill instance may not have registered its route yet.
        threading.Thread(target=self._resolve, name="kvxfer-sglang-route", daemon=True).start()

    def _resolve(self, timeout: float = ROUTE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.bootstrap_addr}/kvxferd/route", timeout=5) as r:
                    self.route = json.loads(r.read())
                self.state = KVPoll.WaitingForInput
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self._fail(f"no kvxferd route from the prefill bootstrap server {self.bootstrap_addr}: {exc}")
                    return
            time.sleep(0.1)

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None) -> None:
        if self.route is None:
            return
        self.pages = [int(p) for p in kv_indices]
        self.aux_index = aux_index
        try:
            self.rx.expect(self.room, self.route["address"], self.route["group"],
                           len(self.pages) * self.mgr.pages.page_size)
        except KvxferError as exc:
            self._fail(f"ExpectRoom failed: {exc}")
            return
        self.state = KVPoll.Transferring
        self.mgr.watch(self)

    def advance(self) -> bool:
        """Loader thread: scatter what landed; True once the room is over (either way)."""
        ps = self.mgr.pages.page_size
        try:
            st = self.rx.poll(self.room)
            fresh = [c for c in st.landed if c.chunk_id not in self.done_chunks]
            for c in fresh:
                first = c.token_start // ps
                chunk_pages = self.pages[first : first + c.num_tokens // ps]
                self.mgr.pages.scatter(chunk_pages, self.mgr.pages.slot(self.rx.tensor(c.offset, c.chunk_bytes), c.num_tokens))
                self.done_chunks.add(c.chunk_id)
            if fresh:
                self.rx.watermark(self.room, [c.chunk_id for c in fresh])
            if st.state is RoomState.FAILED:
                self._fail(f"{st.failure_code}: {st.failure_reason}")
                return True
            if st.state is RoomState.SUCCESS and not fresh:
                if self.aux_index is not None:
                    self.mgr.write_aux(self.aux_index, st.aux)
                self.state = KVPoll.Success
                return True
        except Exception as exc:
            self._fail(f"load failed: {exc}")
            self.abort()
            return True
        return False

    def _fail(self, why: str) -> None:
        self._error = self._error or why
        self.state = KVPoll.Failed

    def poll(self) -> int:
        return self.state

    def failure_exception(self) -> None:
        raise KvxferdTransferError(self.room, self._error or "transfer failed")

    def abort(self) -> None:
        try:
            self.rx.abort(self.room, "aborted by the decode engine")
        except KvxferError as exc:
            logger.debug("abort room %d: %s", self.room, exc)
        self._fail(self._error or "aborted")

    def clear(self) -> None:
        try:
            self.rx.release(self.room)
        except KvxferError:
            pass


class KvxferdKVBootstrapServer(BaseKVBootstrapServer):
    """Serves the prefill instance's route ({group, daemon address, tp_size}) on sglang's bootstrap port."""

    def __init__(self, host: str, port: int) -> None:
        route: dict[str, bytes] = {}

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                route["route"] = self.rfile.read(n)
                self._reply(200, b"{}")

            def do_GET(self) -> None:
                body = route.get("route")
                self._reply(200, body) if body else self._reply(404, b'{"error": "no prefill engine registered"}')

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvxfer-sglang-bootstrap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
