"""Scheduler: what it reports (its queue gauges are read when scraped, not set per chunk)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import CollectorRegistry

from kvxferd.datapath.scheduler import Scheduler
from kvxferd.datapath.workers import TransferJob, WorkerPool
from kvxferd.ops.metrics import Metrics
from kvxferd.transports.interface import XferState
from tests.test_workers import GatedTransport


@pytest.mark.asyncio
async def test_queue_gauges_show_the_writes_in_flight_when_scraped() -> None:
    loop = asyncio.get_running_loop()
    tr = GatedTransport()
    pool = WorkerPool(tr, loop, 2)  # type: ignore[arg-type]
    metrics = Metrics(CollectorRegistry())
    Scheduler(pool, metrics, window=lambda link: None, chunk_done=lambda r, c: None,  # type: ignore[arg-type,return-value]
              fail=lambda r, code, why: None, local_notif=lambda n: None)
    depth = lambda q: metrics.registry.get_sample_value("kvxferd_queue_depth", {"queue": q})  # noqa: E731
    finished = asyncio.Event()
    left = [2]

    def on_done(job: TransferJob, state: XferState, error: str) -> None:
        left[0] -= 1
        if not left[0]:
            finished.set()

    pool.start()
    try:
        assert depth("workers") == 0 and depth("waiting_slot") == 0
        for n in (b"a", b"b"):
            tr.gates[n] = threading.Event()
            pool.submit(TransferJob(remote="peer", pairs=[(1, 2, 3)], notif=n, on_done=on_done))
        assert depth("workers") == 2  # nothing set it: the scrape asked the pool
        for n in (b"a", b"b"):
            tr.gates[n].set()
        await asyncio.wait_for(finished.wait(), 10)
        assert depth("workers") == 0
    finally:
        for g in tr.gates.values():
            g.set()
        pool.stop()
