"""The vLLM connector's worker (kvxfer_client.vllm._worker) between two real daemons, without a
vLLM engine: a prefill rank gathers a request's KV from its paged cache, and the decode rank's
loader fills its own blocks from the room events alone, or, when its event stream is broken, from
the polling safety net. Every element of both caches is compared."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm")  # the connector package imports vLLM's connector base classes

import torch

from kvxfer_client import KvxferError
from kvxfer_client.vllm._config import LoadSpec, SendChunk, Settings, StepPlan
from kvxfer_client.vllm._paged import Planes
from kvxfer_client.vllm._worker import CacheShape, ConnectorWorker

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 2, 2, 16, 16, 8


def _shape(fill: bool) -> CacheShape:
    gen = torch.Generator().manual_seed(7)

    def plane() -> torch.Tensor:
        if fill:
            return torch.randn(BLOCKS, HEADS, BLOCK, HEAD, generator=gen).to(torch.float16)
        return torch.zeros(BLOCKS, HEADS, BLOCK, HEAD, dtype=torch.float16)

    return CacheShape(layers=[f"l{i}" for i in range(LAYERS)], planes=[Planes(plane(), plane()) for _ in range(LAYERS)],
                      total_kv_heads=HEADS, local_heads=HEADS, head_size=HEAD, block_size=BLOCK,
                      kernel_block_size=BLOCK, dtype=torch.float16)


def _tokens(shape: CacheShape, blocks: tuple[int, ...], n: int) -> list[torch.Tensor]:
    """Every layer's K and V of tokens [0, n) held in `blocks`, as [tokens, heads, dim]."""
    idx = torch.tensor([blocks[t // BLOCK] for t in range(n)])
    off = torch.tensor([t % BLOCK for t in range(n)])
    return [x[idx, :, off] for p in shape.planes for x in (p.k, p.v)]


def _wait_loaded(rx: ConnectorWorker, req: str, timeout: float = 30.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    ok: set[str] = set()
    failed: set[str] = set()
    while time.monotonic() < deadline:
        done, bad = rx.transfer_results([])
        ok |= done
        failed |= bad
        if req in ok:
            return ok, failed
        time.sleep(0.02)
    raise AssertionError(f"load of {req} not finished in {timeout} s")


@pytest.mark.parametrize("events", [True, False], ids=["events", "stream-broken"])
def test_decode_loader_fills_the_blocks_from_events_or_by_polling(daemons: Any, events: bool) -> None:
    pre, dec = daemons("vw-pre"), daemons("vw-dec")
    tx_shape, rx_shape = _shape(fill=True), _shape(fill=False)
    tx = ConnectorWorker(Settings(socket=pre.socket, group="vw"), tx_shape, 1, 0, produce=True, consume=False)
    rx = ConnectorWorker(Settings(socket=dec.socket, group="vw"), rx_shape, 1, 0, produce=False, consume=True)
    try:
        assert rx.rx is not None
        polls: list[int] = []
        poll = rx.rx.poll

        def counted(room: int, generation: int = 0) -> Any:
            polls.append(room)
            return poll(room, generation)

        rx.rx.poll = counted  # type: ignore[method-assign]
        if not events:
            time.sleep(0.3)  # the loader's first stream is open: it is cut below

            # Every (re)subscription fails from now on: only the sweep can finish the load.
            def broken(*_: Any, **__: Any) -> Any:
                raise KvxferError(grpc.StatusCode.UNAVAILABLE, "test: stream broken")

            rx.rx.watch = broken  # type: ignore[method-assign]
            streams = list(rx.rx.stub.lane._streams)
            assert len(streams) == 1
            streams[0].cancel()
            # A slow ExpectRoom: sweeps (one per failed resubscription, every 0.2 s) run while the
            # load is registered but the daemon does not know its room yet, and must leave it be.
            expect = rx.rx.expect

            def slow_expect(*args: Any, **kwargs: Any) -> Any:
                time.sleep(0.6)
                return expect(*args, **kwargs)

            rx.rx.expect = slow_expect  # type: ignore[method-assign]
        n, src_blocks, dst_blocks = 40, (3, 5, 7), (1, 2, 6)
        room = 11 if events else 12
        settings = Settings(socket=pre.socket, group="vw")
        rx.start_loads(StepPlan(loads=[LoadSpec("r1", room, pre.peer_address, settings.prefill_group, n,
                                                dst_blocks, 0)]))
        tx.save(StepPlan(sends=[
            SendChunk("r1", room, 0, 0, 16, False, src_blocks, 0),
            SendChunk("r1", room, 1, 16, 32, False, src_blocks, 0),
            SendChunk("r1", room, 2, 32, n, True, src_blocks, 0),
        ]))
        ok, failed = _wait_loaded(rx, "r1")
        assert ok == {"r1"} and not failed
        if not events:
            assert polls, "the load finished without the sweep: the stream was not cut"
        got, want = _tokens(rx_shape, dst_blocks, n), _tokens(tx_shape, src_blocks, n)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        # Blocks the request does not own stay untouched.
        for p in rx_shape.planes:
            for x in (p.k, p.v):
                assert not x[[0, 3, 4, 5, 7]].any()
    finally:
        tx.close()
        rx.close()
