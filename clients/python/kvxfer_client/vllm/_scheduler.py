"""Scheduler side of the vLLM connector: which tokens to send or load each step, and the params out.

Prefill (a request with ``kv_transfer_params = {"do_remote_decode": true}``): every scheduler step
that computes some of its prompt tokens becomes one chunk (or several, with ``max_chunk_tokens``)
that the workers gather into a kvxferd ring slot at the end of that step. When the request
finishes, every prompt token already sits in a slot, so its blocks are freed at once and
``request_finished`` returns the params a decode engine needs.

Decode (``do_remote_prefill`` plus the params above): the whole prompt is reported as an external,
asynchronous hit; the workers expect the room and scatter chunks into the allocated blocks as they
land. vLLM recomputes the last prompt token itself to sample the first output token.

A prefill room that failed on the workers (a chunk refused, the daemon away: see ``_send.py``) is
reported back with the step's output (``KvxferdWorkerMeta``). Params of a request that finished
in that same step were already returned (vLLM calls ``request_finished`` before
``update_connector_output``) but not yet sent: the dict is marked failed in place (``P_FAILED``),
as vLLM itself amends it after ``request_finished``. A decode engine given failed params fails
the load at once, and vLLM's load-failure policy (fail or recompute) applies.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvxfer_client._channel import CHANNEL_OPTIONS, target
from kvxfer_client.vllm._config import (
    P_ADDRESS,
    P_DO_REMOTE_DECODE,
    P_DO_REMOTE_PREFILL,
    P_FAILED,
    P_GROUP,
    P_HOLD_MS,
    P_LAYER_GROUP,
    P_LAYERWISE,
    P_LOAD_MS,
    P_LOADED,
    P_ROOM,
    P_TOKENS,
    LoadSpec,
    SendChunk,
    Settings,
    StepPlan,
)
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)


def daemon_peer_address(socket: str | None, timeout: float = 5.0) -> str:
    """The address other daemons reach this node's daemon at (what a decode engine's ExpectRoom names)."""
    with grpc.insecure_channel(target(socket), options=CHANNEL_OPTIONS) as ch:
        status = engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout)
    return str(status.peer_address)


@dataclass
class _Load:
    tokens: int
    started: float
    ms: float = -1.0
    failed: bool = False


@dataclass
class _Send:
    room: int
    prompt_len: int
    allocated_at: float
    blocks: list[int] = field(default_factory=list)
    next_token: int = 0
    next_chunk: int = 0
    failed: str = ""  # a worker could not enqueue one of its chunks: the room will never fill
    layerwise: bool = False
    layer_group: int = 0


def _room_tokens(request: Any, params: dict[str, Any]) -> int:
    """The room's tokens: what the prefill engine said, or (decode leg sent while the prefill
    computes, ``proxy --concurrent``) this engine's own prompt, the same tokens."""
    if params.get(P_TOKENS) is not None:
        return int(params[P_TOKENS])
    return len(request.prompt_token_ids or ())


class RoomIds:
    """Room ids unique to this engine instance: a random 62-bit start, then a counter."""

    def __init__(self) -> None:
        self._base = secrets.randbits(62)
        self._n = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._n += 1
            return (self._base + self._n) % (1 << 63)


class ConnectorScheduler:
    def __init__(self, settings: Settings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self._rooms = RoomIds()
        self._sends: dict[str, _Send] = {}
        self._loads: list[LoadSpec] = []
        self._pending_loads: dict[str, int] = {}  # req id -> locally computed tokens at match time
        self._loading: dict[str, _Load] = {}
        self._aborts: list[int] = []
        self._address = settings.prefill_address
        # Params returned by request_finished since the last plan: the step's output still holds
        # them, so a failure the workers report for the same step can amend them in place.
        self._handed: dict[str, dict[str, Any]] = {}
        # Counters for the connector's stats (failed sends here, failed loads here).
        self.failed_sends = 0
        self.failed_loads = 0
        # Block hold times of finished prefill requests (ms), newest last; for metrics and tests.
        self.hold_ms: list[float] = []

    # -- decode --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get(P_DO_REMOTE_PREFILL) or P_ROOM not in params:
            return 0, False
        if params.get(P_FAILED):
            logger.warning("request %s: the prefill engine failed to send its KV (%s): load failure policy applies",
                           request.request_id, params[P_FAILED])
        count = _room_tokens(request, params) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._pending_loads[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if params.get(P_DO_REMOTE_DECODE) and rid not in self._sends:
            self._sends[rid] = self._new_send(request, params)
        skip = self._pending_loads.pop(rid, None)
        if skip is None or num_external_tokens <= 0:
            return
        self._loads.append(LoadSpec(
            req_id=rid, room=int(params[P_ROOM]), prefill_address=str(params[P_ADDRESS]),
            prefill_group=str(params[P_GROUP]), num_tokens=_room_tokens(request, params),
            block_ids=tuple(blocks.get_block_ids()[0]), skip_tokens=skip, failed=str(params.get(P_FAILED) or ""),
        ))
        self._loading[rid] = _Load(num_external_tokens, time.monotonic())
        # Load once: if it fails, vLLM recomputes or fails the request, and must not load again.
        params[P_DO_REMOTE_PREFILL] = False

    def _new_send(self, request: Any, params: dict[str, Any]) -> _Send:
        """A prefill request's room: the proxy's id when it drew one (``proxy --concurrent`` sends
        the decode leg at once), and whether it goes as layer parts (the request's say first)."""
        n = len(request.prompt_token_ids or ())
        s = self.settings
        room = int(params[P_ROOM]) if params.get(P_ROOM) is not None else self._rooms.next()
        layerwise = params.get(P_LAYERWISE)
        if layerwise is None:
            layerwise = s.layerwise and n >= s.layerwise_min_tokens
        group = int(params.get(P_LAYER_GROUP) or s.layer_group)
        return _Send(room, n, time.monotonic(), layerwise=bool(layerwise), layer_group=max(0, group))

    def loads_finished(self, finished: set[str], failed: set[str]) -> None:
        now = time.monotonic()
        for rid in finished:
            ld = self._loading.get(rid)
            if ld is not None:
                ld.ms, ld.failed = (now - ld.started) * 1e3, rid in failed
        self.failed_loads += len(failed)

    def sends_failed(self, failed: dict[str, str], address: str) -> None:
        """What the workers report after a step: prefill rooms that failed (request id -> why), and
        the address of the prefill daemon registered with now (a restarted daemon may listen
        on another port)."""
        if address and not self.settings.prefill_address:
            self._address = address
            for params in self._handed.values():
                if P_ADDRESS in params:
                    params[P_ADDRESS] = address
        for rid, why in failed.items():
            self.failed_sends += 1
            st = self._sends.get(rid)
            if st is not None:
                st.failed = st.failed or why
            elif rid in self._handed:
                # Returned this step but not sent yet (the step's output is built, not shipped).
                self._handed[rid][P_FAILED] = why

    # -- every step ----------------------------------------------------------------------------
    def build_plan(self, so: Any) -> StepPlan:
        plan = StepPlan(loads=self._loads, aborts=self._aborts,
                        idle=not getattr(so, "total_num_scheduled_tokens", 1))
        self._loads, self._aborts = [], []
        self._handed.clear()  # the last step's outputs have gone out
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            st = self._sends.get(new.req_id)
            if st is not None:
                st.blocks = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._sends.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                # A resumed (preempted) request gets its whole block list again.
                st.blocks = list(new_ids[0]) if rid in cached.resumed_req_ids else st.blocks + list(new_ids[0])
            computed[rid] = cached.num_computed_tokens[i]
        for rid, done in computed.items():
            st = self._sends[rid]
            end = min(done + so.num_scheduled_tokens.get(rid, 0), st.prompt_len)
            step = self.settings.max_chunk_tokens or max(1, end - st.next_token)
            while st.next_token < end:
                stop = min(end, st.next_token + step)
                first = st.next_token // self.block_size
                last_block = (stop - 1) // self.block_size
                plan.sends.append(SendChunk(
                    req_id=rid, room=st.room, chunk_id=st.next_chunk, start=st.next_token, end=stop,
                    last=stop == st.prompt_len, block_ids=tuple(st.blocks[first : last_block + 1]),
                    first_block=first, layerwise=st.layerwise, layer_group=st.layer_group,
                ))
                st.next_token, st.next_chunk = stop, st.next_chunk + 1
        return plan

    # -- prefill finish ------------------------------------------------------------------------
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        ld = self._loading.pop(request.request_id, None)
        if ld is not None:
            return False, {P_LOADED: 0 if ld.failed else ld.tokens, P_LOAD_MS: round(ld.ms, 3)}
        st = self._sends.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.next_token < st.prompt_len or st.prompt_len == 0:
            # Finished (aborted, or stopped) before every prompt token was computed: no decode
            # will be pointed at this room, so end it rather than leave slots held to its deadline.
            if st.next_chunk:
                self._aborts.append(st.room)
            return False, None
        held = (time.monotonic() - st.allocated_at) * 1e3
        self.hold_ms.append(held)
        logger.debug("request %s: prefill blocks held %.1f ms", request.request_id, held)
        params: dict[str, Any] = {
            P_DO_REMOTE_PREFILL: True, P_DO_REMOTE_DECODE: False, P_ROOM: st.room, P_ADDRESS: self._address,
            P_GROUP: self.settings.prefill_group, P_TOKENS: st.prompt_len, P_HOLD_MS: round(held, 3),
        }
        if st.failed:
            # The decode engine learns at once that no KV will come (not at the room deadline).
            params[P_FAILED] = st.failed
            return False, params
        if not self._address:
            try:
                params[P_ADDRESS] = self._address = daemon_peer_address(self.settings.socket, timeout=2.0)
            except grpc.RpcError as exc:
                params[P_FAILED] = f"the prefill daemon did not say its address: {exc.code().name}"
                return False, params
        self._handed[request.request_id] = params
        # False: the KV is in the daemon's ring already, vLLM may free the blocks now.
        return False, params
