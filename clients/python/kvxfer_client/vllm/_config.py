"""Connector settings (``kv_connector_extra_config``) and the step metadata the scheduler sends workers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Keys of kv_transfer_params this connector reads and writes (the proxy passes them through).
P_DO_REMOTE_DECODE = "do_remote_decode"
P_DO_REMOTE_PREFILL = "do_remote_prefill"
P_ROOM = "kvxfer_room"
P_ADDRESS = "kvxfer_prefill_address"
P_GROUP = "kvxfer_prefill_group"
P_TOKENS = "kvxfer_num_tokens"
# Informational: how long the prefill engine held the request's KV blocks (allocation to free).
P_HOLD_MS = "kvxfer_prefill_block_hold_ms"
# Informational, on decode outputs: prompt tokens loaded through kvxferd (0: the load failed) and
# how long the load took (blocks allocated to the scheduler hearing it finished).
P_LOADED = "kvxfer_loaded_tokens"
P_LOAD_MS = "kvxfer_load_ms"
# Set (to the reason) when the prefill side could not hand the whole prompt's KV to its daemon:
# the decode engine then applies the load-failure policy at once instead of waiting for a room
# that will never fill.
P_FAILED = "kvxfer_prefill_failed"
# Per request, on the prefill leg: send this room as layer parts (True) or whole chunks (False)
# whatever the engine's ``layerwise`` setting says, and its layers a group (0: auto).
P_LAYERWISE = "kvxfer_layerwise"
P_LAYER_GROUP = "kvxfer_layer_group"
POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class Settings:
    socket: str | None = None
    group: str = ""
    ring_bytes: int = 64 << 20
    max_chunk_tokens: int = 0  # 0: one chunk per scheduler step (vLLM's prefill chunk)
    deadline_ms: int = 0  # 0: the daemon's room deadline
    acquire_timeout_s: float = 30.0
    prefill_address: str = ""  # "": the daemon's own peer address (GetStatus)
    # Bound on every call into the daemon from the model's step (enqueue verdicts, ExpectRoom,
    # aborts): a daemon silent for longer takes the transfer path down until it answers again.
    call_timeout_s: float = 2.0
    # What a decode request whose KV cannot come does: "fail" or "recompute"; "" follows vLLM's
    # own kv_transfer_config.kv_load_failure_policy (the connector sets that one when this is given).
    load_failure_policy: str = ""
    # Layer-wise streaming (docs/design/layerwise.md §3.1): a prefill room of at least
    # layerwise_min_tokens tokens goes as layer parts, each group enqueued as the forward computes
    # it; layer_group layers a part (0: auto, _layers.group_size: about sqrt(hidden work / per-part cost) groups,
    # at most 16).
    layerwise: bool = False
    layer_group: int = 0
    layerwise_min_tokens: int = 256

    @classmethod
    def from_extra(cls, extra: dict[str, Any], engine_id: str) -> Settings:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys for KvxferdConnector: {unknown}")
        s = cls(**extra)
        if not s.group:
            # One group per serving instance (every TP rank of it): vLLM's engine_id is shared by them.
            s = cls(**{**extra, "group": f"vllm-{engine_id[:12]}"})
        if s.load_failure_policy not in ("", *POLICIES):
            raise ValueError(f"KvxferdConnector load_failure_policy must be one of {POLICIES} or unset, "
                             f"got {s.load_failure_policy!r}")
        if (s.ring_bytes <= 0 or s.max_chunk_tokens < 0 or s.deadline_ms < 0 or s.acquire_timeout_s <= 0
                or s.call_timeout_s <= 0 or s.layer_group < 0 or s.layerwise_min_tokens < 0):
            raise ValueError(f"bad KvxferdConnector settings: {s}")
        return s

    @property
    def prefill_group(self) -> str:
        # Prefill and decode engines of a kv_both instance register separately: a second
        # registration of the same (group, rank) would replace the first.
        return f"{self.group}-prefill"

    @property
    def decode_group(self) -> str:
        return f"{self.group}-decode"


@dataclass(frozen=True)
class SendChunk:
    """Tokens [start, end) of a prefill request, computed this step: gather and enqueue them."""

    req_id: str
    room: int
    chunk_id: int
    start: int
    end: int
    last: bool
    block_ids: tuple[int, ...]  # blocks holding tokens from first_block * block_size on
    first_block: int
    layerwise: bool = False  # as layer parts from the forward's per-layer hook (else whole, after it)
    layer_group: int = 0  # layers a part; 0: auto (the worker knows the bytes)


@dataclass(frozen=True)
class LoadSpec:
    """A decode request whose prompt KV comes from a prefill engine's room."""

    req_id: str
    room: int
    prefill_address: str
    prefill_group: str
    num_tokens: int
    block_ids: tuple[int, ...]  # every block of the request, from token 0
    skip_tokens: int  # tokens already in local (prefix-cached) blocks: never overwritten
    failed: str = ""  # the prefill side said its room will never fill: fail the load at once


@dataclass
class StepPlan:
    """What the workers do this step; wrapped in vLLM's KVConnectorMetadata by the connector."""

    sends: list[SendChunk] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)  # prefill rooms whose request ended before its last chunk
    # Nothing scheduled this step: vLLM's engine loop is only waiting (for loads, here), and steps
    # again 1 ms after this one returns.
    idle: bool = False
