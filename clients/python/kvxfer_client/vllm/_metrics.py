"""What the workers tell the scheduler side after each step, and the connector's stats.

``KvxferdWorkerMeta`` rides in vLLM's ``KVConnectorOutput.kv_connector_worker_meta`` (the worker
and scheduler may be separate processes; TP ranks' metas are merged with ``aggregate``).
``KvxferdStats`` is what vLLM's stat loggers get (the periodic ``KV Transfer metrics:`` log line):
``kvxfer_path_down`` (1 while any rank's daemon registration is down), and per interval the
path's transitions, failed prefill sends and failed decode loads. With vLLM's Prometheus
endpoint (``vllm serve``'s ``/metrics``), ``KvxferdPromMetrics`` exports them as the gauge
``vllm:kvxferd_transfer_path_down`` and the counters ``vllm:kvxferd_transfer_path_transitions``,
``vllm:kvxferd_failed_sends`` and ``vllm:kvxferd_failed_loads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

_COUNTERS = ("kvxfer_path_transitions", "kvxfer_failed_sends", "kvxfer_failed_loads")


class KvxferdWorkerMeta(KVConnectorWorkerMetadata):
    """One step's report of the workers: failed prefill rooms by request id, the prefill daemon's
    address now, what is down, and how many times the path went down or up (since start)."""

    def __init__(self, failed_sends: dict[str, str], address: str, down: list[str], transitions: int) -> None:
        self.failed_sends = failed_sends
        self.address = address
        self.down = down
        self.transitions = transitions

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvxferdWorkerMeta)
        return KvxferdWorkerMeta({**self.failed_sends, **other.failed_sends}, self.address or other.address,
                                 sorted({*self.down, *other.down}), self.transitions + other.transitions)


@dataclass
class KvxferdStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("kvxfer_path_down", *_COUNTERS):
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = {"kvxfer_path_down": self.data.get("kvxfer_path_down", 0), **dict.fromkeys(_COUNTERS, 0)}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # The newer observation's state; the counters of both.
        merged = {"kvxfer_path_down": other.data.get("kvxfer_path_down", 0)}
        for key in _COUNTERS:
            merged[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return KvxferdStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: int(v) for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvxferdPromMetrics(KVConnectorPromMetrics):
    """The stats above as Prometheus series, one child per engine index."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        down = self._gauge_cls(name="vllm:kvxferd_transfer_path_down", multiprocess_mode="mostrecent",
                               documentation="1 while a kvxferd registration of this engine is down "
                                             "(daemon away or registering again)", labelnames=labelnames)
        self._down = create_metric_per_engine(down, per_engine_labelvalues)
        self._counters = {}
        for key, doc in (("kvxfer_path_transitions", "kvxferd transfer path went down or came back up"),
                         ("kvxfer_failed_sends", "prefill rooms that could not hand all their KV to kvxferd"),
                         ("kvxfer_failed_loads", "decode loads through kvxferd that failed")):
            name = "vllm:kvxferd_" + key.removeprefix("kvxfer_")
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._down[engine_idx].set(int(transfer_stats_data.get("kvxfer_path_down", 0)))
        for key, per_engine in self._counters.items():
            n = int(transfer_stats_data.get(key, 0))
            if n:
                per_engine[engine_idx].inc(n)
