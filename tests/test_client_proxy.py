"""kvxfer_client.proxy against two small OpenAI-shaped servers that record what they were sent.

Unit scope: what the proxy sends on each leg and what it gives back. The proxy in front of real
vLLM servers runs in `kvxferd bench engines` (tests/bench/test_bench_engines.py) and in
scripts/try-two-hosts.sh."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvxfer_client.proxy import PREFILL_MS_HEADER, Servers, prefill_body, serve


@dataclass
class Upstream:
    """Answers like a vLLM server: prefill gives kv_transfer_params (unless told not to)."""

    give_params: bool = True
    seen: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            out = {"choices": [{"text": "x"}]}
            if self.give_params:
                out["kv_transfer_params"] = {"kvxfer_room": 7}
            return web.json_response(out)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"choices": [{"text": "decoded"}], "kv_transfer_params": params or None})


async def healthy(_: web.Request) -> web.Response:
    return web.json_response({})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def pd() -> AsyncIterator[tuple[str, Upstream, Upstream]]:
    runners = []
    ups = (Upstream(), Upstream())
    for up in ups:
        app = web.Application()
        app.router.add_post("/v1/completions", up.completions)
        app.router.add_get("/health", healthy)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        up.url = f"http://127.0.0.1:{port}"
        runners.append(runner)
    port = free_port()
    started = asyncio.Event()
    task = asyncio.ensure_future(serve(Servers((ups[0].url,), (ups[1].url,)), "127.0.0.1", port, started))
    await asyncio.wait_for(started.wait(), 10)
    yield f"http://127.0.0.1:{port}", ups[0], ups[1]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for runner in runners:
        await runner.cleanup()


async def test_prefill_then_decode_with_the_params(pd: tuple[str, Upstream, Upstream]) -> None:
    url, pre, dec = pd
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
            "model": "m", "prompt": "a b c", "max_tokens": 9, "stream": False}) as r:
        assert r.status == 200
        assert float(r.headers[PREFILL_MS_HEADER]) >= 0
        got = await r.json()
    assert pre.seen == [{"model": "m", "prompt": "a b c", "max_tokens": 1, "stream": False,
                         "kv_transfer_params": {"do_remote_decode": True}}]
    assert dec.seen == [{"model": "m", "prompt": "a b c", "max_tokens": 9, "stream": False,
                         "kv_transfer_params": {"kvxfer_room": 7}}]
    assert got["kv_transfer_params"] == {"kvxfer_room": 7}


async def test_streamed_decode_comes_back_whole(pd: tuple[str, Upstream, Upstream]) -> None:
    url, pre, _ = pd
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
            "model": "m", "prompt": "a", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
        text = (await r.read()).decode()
    assert [json.loads(line[6:])["i"] for line in text.split("\n\n") if line.startswith("data: {")] == [0, 1, 2]
    assert text.rstrip().endswith("[DONE]")
    # The prefill leg is never streamed and carries no stream options.
    assert pre.seen[0]["stream"] is False and "stream_options" not in pre.seen[0]


async def test_no_params_from_prefill_means_decode_computes_the_prompt(pd: tuple[str, Upstream, Upstream]) -> None:
    url, pre, dec = pd
    pre.give_params = False
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}) as r:
        assert r.status == 200
    assert "kv_transfer_params" not in dec.seen[0]


async def test_bad_body_is_refused_and_reaches_no_server(pd: tuple[str, Upstream, Upstream]) -> None:
    url, pre, dec = pd
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400
        async with s.post(url + "/v1/completions", json=[1, 2]) as r:
            assert r.status == 400
    assert pre.seen == [] and dec.seen == []


async def test_health_names_a_server_that_is_down() -> None:
    port, dead = free_port(), free_port()
    started = asyncio.Event()
    task = asyncio.ensure_future(serve(Servers((f"http://127.0.0.1:{dead}",), (f"http://127.0.0.1:{dead}",)),
                                       "127.0.0.1", port, started))
    try:
        await asyncio.wait_for(started.wait(), 10)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 503
                assert str(dead) in json.dumps(await r.json())
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a"}) as r:
                assert r.status == 502
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_prefill_leg_asks_for_one_token_without_streaming() -> None:
    body = {"prompt": [5, 6], "max_tokens": 4, "stream": True, "stream_options": {"x": 1}, "min_tokens": 2}
    got = prefill_body(body, {"do_remote_decode": True})
    assert got == {"prompt": [5, 6], "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 4  # the decode leg's request is left as the client sent it
