"""kvxfer_client.proxy --concurrent against two OpenAI-shaped servers that record what they got:
the proxy draws the room, the decode leg reaches its server while the prefill leg is still
running, both carry the same room, and a failed prefill drops the decode leg (vLLM then aborts
the request and its room). Real vLLM behind this proxy: `kvxferd bench engines` (kvxferd_layerwise)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvxfer_client.proxy import Servers, concurrent_params, main, serve
from tests.test_client_proxy import free_port

WHERE = "127.0.0.1:4711/vllm-x-prefill"


@dataclass
class Legs:
    """The prefill server answers only once the decode leg has arrived (or fails, if told to);
    the decode server holds its answer until the test lets it go or the client goes away."""

    prefill_status: int = 200
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    decode_closed: asyncio.Event = field(default_factory=asyncio.Event)
    release_decode: asyncio.Event = field(default_factory=asyncio.Event)

    async def prefill(self, request: web.Request) -> web.Response:
        self.seen["prefill"] = await request.json()
        if self.prefill_status != 200:
            # Failing while the decode leg waits: the proxy must drop it.
            await asyncio.wait_for(self.decode_arrived.wait(), 10)
            return web.json_response({"error": "boom"}, status=self.prefill_status)
        await asyncio.wait_for(self.decode_arrived.wait(), 10)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {"from": "prefill"}})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        self.seen["decode"] = await request.json()
        self.decode_arrived.set()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await self.release_decode.wait()
            await resp.write(b"data: {\"i\": 0}\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.decode_closed.set()
            raise
        return resp


@pytest.fixture
async def concurrent_pd() -> AsyncIterator[tuple[str, Legs]]:
    legs = Legs()
    runners, urls = [], []
    for handler in (legs.prefill, legs.decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        urls.append(f"http://127.0.0.1:{port}")
        runners.append(runner)
    port = free_port()
    started = asyncio.Event()
    task = asyncio.ensure_future(serve(Servers((urls[0],), (urls[1],)), "127.0.0.1", port, started,
                                       kvxfer={urls[0]: WHERE}))
    await asyncio.wait_for(started.wait(), 10)
    yield f"http://127.0.0.1:{port}", legs
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for runner in runners:
        await runner.cleanup()


async def test_both_legs_at_once_with_one_room(concurrent_pd: tuple[str, Legs]) -> None:
    url, legs = concurrent_pd
    legs.release_decode.set()
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
            "model": "m", "prompt": "a b", "max_tokens": 5, "stream": True}) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    # The prefill server answered only after the decode leg had arrived: they ran at once.
    assert "[DONE]" in text
    pre, dec = legs.seen["prefill"]["kv_transfer_params"], legs.seen["decode"]["kv_transfer_params"]
    room = pre["kvxfer_room"]
    assert isinstance(room, int) and 0 <= room < 1 << 62
    assert pre == {"do_remote_decode": True, "kvxfer_room": room}
    assert dec == {"do_remote_prefill": True, "kvxfer_room": room, "kvxfer_prefill_address": "127.0.0.1:4711",
                   "kvxfer_prefill_group": "vllm-x-prefill"}
    assert legs.seen["prefill"]["max_tokens"] == 1 and legs.seen["decode"]["max_tokens"] == 5


async def test_failed_prefill_drops_the_decode_leg(concurrent_pd: tuple[str, Legs]) -> None:
    url, legs = concurrent_pd
    legs.prefill_status = 500
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}) as r:
        assert r.status == 500
        assert "prefill" in await r.json()
    # The decode server sees its client go away (vLLM aborts the request, the connector its room).
    await asyncio.wait_for(legs.decode_closed.wait(), 10)


def test_concurrent_needs_an_address_and_group_per_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--prefill", "http://a", "--decode", "http://b", "--concurrent"])
    with pytest.raises(SystemExit):
        main(["--prefill", "http://a", "--decode", "http://b", "--concurrent", "--prefill-kvxfer", "nogroup"])
    assert "ADDR/GROUP" in capsys.readouterr().err
    with pytest.raises(ValueError):
        concurrent_params(1, "/g")
