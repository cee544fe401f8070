"""The vLLM connector's layer-wise sends (kvxfer_client.vllm._layers, issue #37) between two real
daemons, without a vLLM engine: the prefill worker takes slots before the forward, each layer
hook sends the groups it completes (before the step's end), the step's end sends what no hook
did and seals the room (in vLLM's order: the plan bound before the forward, start_load_kv after it); the decode worker scatters each group of a chunk into its own blocks as
it lands (skipping the tokens it holds already). Every element of both caches is compared."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm")  # the connector package imports vLLM's connector base classes

import torch

from kvxfer_client.vllm._config import LoadSpec, SendChunk, Settings, StepPlan
from kvxfer_client.vllm._layers import group_size
from kvxfer_client.vllm._worker import IDLE_WAIT_S, ConnectorWorker
from tests.engines.test_vllm_worker import LAYERS, _shape, _tokens, _wait_loaded
from tests.readiness import budget


def test_auto_group_size() -> None:
    # G = sqrt(hidden work / per-part cost), at most 16 and the layers; groups of ceil(L / G).
    mib = 1 << 20
    assert group_size(0, 8, 2 * mib) == 2  # a 2048-token chunk of the bench's model: 4 groups
    assert group_size(0, 8, 256 << 10) == 4  # 256 tokens: 2 groups
    assert group_size(0, 8, 1 << 10) == 8  # a few tokens: whole
    assert group_size(0, 32, 16 * mib, "cuda") == 2  # 8B shape, 4k tokens, GPU: 16 groups
    assert group_size(0, 32, 4 * mib, "cuda") == 4  # 1k tokens: 8 groups
    assert group_size(3, 8, 1) == 3 and group_size(12, 8, 1) == 8


def test_layer_parts_from_the_hooks_land_every_byte(daemons: Any) -> None:
    pre, dec = daemons("lw-pre"), daemons("lw-dec")
    tx_shape, rx_shape = _shape(fill=True), _shape(fill=False)
    settings = Settings(socket=pre.socket, group="lw")
    tx = ConnectorWorker(settings, tx_shape, 1, 0, produce=True, consume=False)
    rx = ConnectorWorker(Settings(socket=dec.socket, group="lw"), rx_shape, 1, 0, produce=False, consume=True)
    try:
        assert tx.tx is not None
        calls: list[list[tuple[int, int, int]]] = []
        enqueue = tx.tx.enqueue_layers

        def counted(parts: Any, wait: bool = True) -> Any:
            calls.append([(p.chunk_id, p.layer_start, p.layer_end) for p in parts])
            return enqueue(parts, wait)

        tx.tx.enqueue_layers = counted  # type: ignore[method-assign]
        n, skip, room = 45, 7, 21
        src, dst = (3, 5, 7), (1, 2, 6)
        rx.start_loads(StepPlan(loads=[LoadSpec("r1", room, pre.peer_address, settings.prefill_group, n, dst, skip)]))
        # A step that schedules nothing waits (boundedly) for a pending load instead of spinning.
        t0 = time.monotonic()
        assert rx.transfer_results([], idle=True) == (set(), set())
        assert IDLE_WAIT_S <= time.monotonic() - t0 < budget(2.0)
        # Step 1: chunk 0, a layer a group, every layer's hook runs. vLLM's order: the plan is bound
        # (slots taken) before the forward, start_load_kv comes after it (it must not take more).
        step1 = StepPlan(sends=[SendChunk("r1", room, 0, 0, 20, False, src, 0, layerwise=True, layer_group=1)])
        tx.start_sends(step1)
        tx.save_layer("l0")
        # The decode worker scatters layer 0 as soon as it lands, before the chunk's other layers exist.
        deadline = time.monotonic() + budget(30.0)
        while rx._loads[room].groups_done.get(0) != {0}:
            assert time.monotonic() < deadline, "layer 0 of chunk 0 was not scattered on its own"
            time.sleep(0.01)
        for i in range(1, LAYERS):
            tx.save_layer(f"l{i}")
        # Sent from the hooks, at each group's last layer, before the step's end.
        assert calls == [[(0, 0, 1)], [(0, 1, 2)]]
        tx.start_loads(step1)
        tx.save(step1)
        # Step 2: the last chunk; the last layer's hook never ran: the step's end sends it, then
        # the seal, in one call.
        step2 = StepPlan(sends=[SendChunk("r1", room, 1, 20, n, True, src[1:], 1, layerwise=True, layer_group=1)])
        tx.start_sends(step2)
        tx.save_layer("l0")
        tx.start_loads(step2)
        tx.save(step2)
        assert calls[2:] == [[(1, 0, 1)], [(1, 1, 2), (1, LAYERS, LAYERS)]]
        assert tx.failed_sends() == {}
        ok, failed = _wait_loaded(rx, "r1")
        assert ok == {"r1"} and not failed
        # Nothing pending: an idle step returns at once.
        t0 = time.monotonic()
        assert rx.transfer_results([], idle=True) == (set(), set())
        assert time.monotonic() - t0 < budget(2.0)
        for g, w in zip(_tokens(rx_shape, dst, n), _tokens(tx_shape, src, n), strict=True):
            assert torch.equal(g[skip:], w[skip:])
            # Tokens the decode engine held already stay untouched.
            assert not g[:skip].any()
        for p in rx_shape.planes:
            for x in (p.k, p.v):
                assert not x[[0, 3, 4, 5, 7]].any()
    finally:
        tx.close()
        rx.close()
