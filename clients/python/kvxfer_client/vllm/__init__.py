"""vLLM KV connector over kvxferd: prefill/decode disaggregation with a config line.

```
--kv-transfer-config '{"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxfer_client.vllm",
                       "kv_role": "kv_both", "kv_connector_extra_config": {"socket": "/run/kvxferd/kvxferd.sock"}}'
```

A proxy sends the request to the prefill instance with ``kv_transfer_params = {"do_remote_decode":
true}`` and ``max_tokens = 1``, then sends it to the decode instance with the ``kv_transfer_params``
the prefill output carries (room, prefill daemon address, prefill group, token count). Settings
(``kv_connector_extra_config``): ``socket``, ``group``, ``ring_bytes``, ``max_chunk_tokens``,
``deadline_ms``, ``acquire_timeout_s``, ``prefill_address``, ``call_timeout_s``,
``load_failure_policy``, ``layerwise``, ``layer_group``, ``layerwise_min_tokens`` (see :class:`Settings`).

Layer-wise streaming (``layerwise``, or per request ``kv_transfer_params["kvxfer_layerwise"]``):
a prefill room's chunks go as layer groups from the forward's per-layer hook, so the transfer
runs while later layers compute (``_layers.py``); decode engines always accept such rooms. It
hides the transfer only if the decode engine expects the room while the prefill computes:
``python -m kvxfer_client.proxy --concurrent``.

Healing. Each TP rank's registration with its daemon heals by itself (``kvxfer_client._reattach``):
a daemon that restarts (kill -9, upgrade) is registered with again (new ring, same group and rank)
as soon as it answers, and a daemon that stalls (SIGSTOP, a hung host) is waited for off the model's
thread. While a daemon is away the engine never waits on it: every call from the model's step is
bounded by ``call_timeout_s`` (2 s) once, then fails at once until the daemon answers again.
Requests that do not disaggregate keep being served at their usual latency throughout.

* prefill: a request whose chunks could not all be enqueued gets ``kv_transfer_params`` with
  ``kvxfer_prefill_failed`` set (the reason), never params a decode engine would wait on.
* decode: a load whose params say so, whose ExpectRoom fails, or whose daemon went away fails at
  once; vLLM then fails the request (finish reason ``error``) or recomputes its prompt, per
  ``load_failure_policy`` (``"fail"`` / ``"recompute"``). Unset, vLLM's own
  ``kv_load_failure_policy`` (default ``"fail"``) applies; set, it is what vLLM's is set to.
  A load is never resumed on a new registration (its ring is a new one): no wrong byte reaches
  the engine's blocks.

What an operator sees: one WARNING log line per transition, ``kvxferd transfer path DOWN for
<group> rank <r> (epoch <e>): <why>`` and ``... UP again ...``; vLLM's periodic stats line
``KV Transfer metrics: kvxfer_path_down=1, kvxfer_path_transitions=.., kvxfer_failed_sends=..,
kvxfer_failed_loads=..`` (engines started with stats logging, the default of ``vllm serve``);
on ``/metrics`` the gauge ``vllm:kvxferd_transfer_path_down`` and the counters
``vllm:kvxferd_transfer_path_transitions``, ``vllm:kvxferd_failed_sends``,
``vllm:kvxferd_failed_loads`` (``_metrics.py``); and decode outputs' ``kv_transfer_params``:
``kvxfer_loaded_tokens`` is 0 for a failed load.

Needs vLLM (``pip install 'kvxferd[vllm]'``); importing ``kvxfer_client`` itself never imports vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvxfer_client.kernels import KVPages
from kvxfer_client.vllm import _paged
from kvxfer_client.vllm._config import Settings, StepPlan
from kvxfer_client.vllm._metrics import KvxferdPromMetrics, KvxferdStats, KvxferdWorkerMeta
from kvxfer_client.vllm._scheduler import ConnectorScheduler
from kvxfer_client.vllm._worker import CacheShape, ConnectorWorker

logger = logging.getLogger(__name__)

__all__ = ["KvxferdConnector", "KvxferdMetadata", "Settings"]


def _check_cpu_layout(attn: Any, dtype: Any, block_size: int, head_size: int) -> None:
    """Writes known K/V with the CPU backend's own cache op and reads them back through our views.

    The op's in-block layout depends on the ISA it picks (vec, vec16, amx, ...); a layout this
    connector does not read correctly must stop the engine at start, never corrupt a transfer.
    """
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = getattr(attn, "isa", None) or _get_attn_isa(dtype, block_size, head_size, "auto")
    tokens = block_size + 3  # a full block and part of the next
    scratch = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
    k_cache, v_cache = scratch.view(2, 1, 2 * block_size, head_size).chunk(2, dim=2)
    # Small integers: exact in every float dtype the backend takes.
    key = (torch.arange(tokens * head_size) % 251 + 1).to(dtype).view(tokens, 1, head_size)
    value = -key
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(tokens), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    planes = _paged.kv_planes(scratch, "CPU_ATTN", head_size)
    # Read back through the connector's own copy (slot [1 head, 1 layer, K/V, tokens, head_size]).
    slot = torch.empty(2, tokens, 1, head_size, dtype=dtype)
    KVPages([planes.k], [planes.v]).gather(torch.tensor([0, 1]), tokens, block_size, slot, backend="torch")
    if not (torch.equal(slot[0], key) and torch.equal(slot[1], value)):
        raise NotImplementedError(f"CPU attention ISA {isa!r} lays out K/V in a way KvxferdConnector does not read")


class KvxferdMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvxferdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = Settings.from_extra(dict(ktc.kv_connector_extra_config or {}), str(ktc.engine_id))
        self._produce = bool(ktc.is_kv_producer)
        self._consume = bool(ktc.is_kv_consumer)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        # Scheduler side: what the workers said last (for stats); worker side: what was last sent.
        self._down: list[str] = []
        self._transitions = 0
        self._reported = (0, 0, 0)
        self._sent: tuple[str, tuple[str, ...], int] = ("", (), 0)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(self.settings, int(vllm_config.cache_config.block_size))
            policy = self.settings.load_failure_policy
            if policy and policy != ktc.kv_load_failure_policy:
                # vLLM's scheduler reads its policy after creating this connector: ours decides.
                logger.info("KvxferdConnector load_failure_policy=%r overrides kv_load_failure_policy=%r",
                            policy, ktc.kv_load_failure_policy)
                ktc.kv_load_failure_policy = policy

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvxferdMetadata:
        assert self._scheduler is not None
        return KvxferdMetadata(self._scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        sched = self._scheduler
        if sched is None:
            return
        sched.loads_finished(set(connector_output.finished_recving or ()),
                             set(getattr(connector_output, "failed_recving", None) or ()))
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvxferdWorkerMeta):
            sched.sends_failed(meta.failed_sends, meta.address)
            self._down, self._transitions = meta.down, meta.transitions

    def get_kv_connector_stats(self) -> KvxferdStats | None:
        sched = self._scheduler
        if sched is None:
            return None
        now = (self._transitions, sched.failed_sends, sched.failed_loads)
        delta = [a - b for a, b in zip(now, self._reported, strict=True)]
        self._reported = now
        stats = KvxferdStats({"kvxfer_path_down": int(bool(self._down)), "kvxfer_path_transitions": delta[0],
                              "kvxfer_failed_sends": delta[1], "kvxfer_failed_loads": delta[2]})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferdStats | None:
        return KvxferdStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferdPromMetrics:
        return KvxferdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer hooks do not run inside a captured full graph (a layer-wise chunk would then go
        # whole at the step's end: correct, but nothing streamed).
        return bool(extra_config.get("layerwise"))

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        cfg = self._vllm_config
        layers = cfg.compilation_config.static_forward_context
        names = list(kv_caches)
        first = kv_caches[names[0]]
        planes = []
        for name in names:
            attn = layers[name]
            backend = attn.get_attn_backend().get_name()
            if backend in _paged.PLANE_MAJOR_BACKENDS and name == names[0]:
                _check_cpu_layout(attn, first.dtype, int(first.shape[2]), int(attn.head_size))
            planes.append(_paged.kv_planes(kv_caches[name], backend, int(attn.head_size)))
        shape = CacheShape(
            layers=names, planes=planes, total_kv_heads=int(cfg.model_config.get_total_num_kv_heads()),
            local_heads=int(first.shape[1]), head_size=int(layers[names[0]].head_size),
            block_size=int(cfg.cache_config.block_size), kernel_block_size=int(first.shape[2]), dtype=first.dtype,
        )
        self._worker = ConnectorWorker(
            self.settings, shape, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank(),
            produce=self._produce, consume=self._consume,
        )

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferdMetadata)
        return meta.plan

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The one worker call that always comes before the forward: vLLM 0.32 calls start_load_kv
        # after it when the step loads nothing synchronously (kv_connector_model_runner_mixin's
        # start_after_forward), which is every prefill step; slots taken there would leave every
        # layer hook without an open chunk, and a layer-wise chunk would go whole after the forward.
        if self._worker is not None and isinstance(connector_metadata, KvxferdMetadata):
            self._worker.start_sends(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_loads(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request runs only after its whole load has finished.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Whole chunks: one slot holds every layer, gathered once after the forward (wait_for_save).
        # Layer-wise chunks (settings.layerwise): a group goes as soon as its last layer is written.
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.save(self._plan())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        idle = self.has_connector_metadata() and self._plan().idle
        done, failed = self._worker.transfer_results(finished_req_ids, idle=idle)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> KvxferdWorkerMeta | None:
        """The step's failed sends and the path's state, when there is news (else None: vLLM then
        ships no connector output for an idle step)."""
        w = self._worker
        if w is None:
            return None
        failed = w.failed_sends()
        tx = w.tx
        state = (tx.peer_address if tx is not None else "", tuple(w.path_down()), w.transitions())
        if not failed and state == self._sent:
            return None
        self._sent = state
        return KvxferdWorkerMeta(failed, state[0], list(state[1]), state[2])

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
