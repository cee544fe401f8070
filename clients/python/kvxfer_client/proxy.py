"""A prefill/decode proxy for vLLM OpenAI servers that use a KV connector (KvxferdConnector or any other).

``python -m kvxfer_client.proxy --prefill http://A:8100 --decode http://B:8200 --port 8000``

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes to a prefill server first, with
``max_tokens: 1``, no streaming and ``kv_transfer_params: {"do_remote_decode": true}``; then to a
decode server with the ``kv_transfer_params`` the prefill response carried, and the decode
server's response (streamed or not, as the client asked) goes back to the client unchanged.

The params go through as they came: when the prefill engine could not hand its whole KV to its
daemon, KvxferdConnector marks them ``kvxfer_prefill_failed`` and the decode engine applies its
load-failure policy at once (fails the request, or computes the prompt itself). A prefill response
with no params at all sends the request to decode as it was, which computes the prompt.
``--prefill``/``--decode`` repeat for several servers, taken in turn.

``--concurrent`` (KvxferdConnector only; needs ``--prefill-kvxfer ADDR/GROUP`` per prefill server:
its daemon's peer address and the engine's prefill group, ``<group>-prefill``): the proxy draws
the room id and sends both legs at once, so the decode engine expects the room while the prefill
computes (what layer-wise streaming needs to hide the transfer). The decode engine counts the
room's tokens from its own prompt. A prefill leg that fails (an error answer, no answer) drops
the decode leg, which aborts its room; a prefill that could not send its KV aborts the room
itself, and the decode engine applies its load-failure policy.
``GET /health`` is 200 while every server answers its own ``/health``; ``GET /v1/models`` is the
first decode server's. Needs aiohttp (a vLLM dependency), not vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The prefill leg's wall time (ms), on every response: where a slow request spent its time.
PREFILL_MS_HEADER = "x-kvx-prefill-ms"
# Idle upstream connections are reused for at most this long: vLLM's server (uvicorn) closes an
# idle keep-alive connection after 5 s, and a request sent on one as it closes fails with
# ServerDisconnectedError (seen once in 288 concurrent-leg requests of bench engines).
KEEPALIVE_S = 3.0
ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prefill leg of a request: one token, the whole response at once, asking for the KV to be
    kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(params or {"do_remote_decode": True}))
    return out


def concurrent_params(room: int, prefill_kvxfer: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The kv_transfer_params of both legs of a room the proxy drew (``prefill_kvxfer``:
    ``ADDR/GROUP`` of the prefill engine's daemon and group). The keys are KvxferdConnector's."""
    addr, _, group = prefill_kvxfer.rpartition("/")
    if not addr or not group:
        raise ValueError(f"--prefill-kvxfer takes ADDR/GROUP, got {prefill_kvxfer!r}")
    return ({"do_remote_decode": True, "kvxfer_room": room},
            {"do_remote_prefill": True, "kvxfer_room": room, "kvxfer_prefill_address": addr,
             "kvxfer_prefill_group": group})


def new_room() -> int:
    """A room id no other proxy or engine draws (62 random bits, as the connector's own)."""
    return secrets.randbits(62)


async def both_legs(session: Any, prefill_url: str, prefill_json: dict[str, Any], decode_url: str,
                    decode_json: dict[str, Any]) -> tuple[int, Any, Any]:
    """Sends the decode leg and the prefill leg at once. Returns (prefill status, prefill reply,
    the decode response with its headers read, to be streamed and released by the caller; None
    when the prefill failed: the decode leg is then dropped, which aborts its room)."""
    async def post_decode() -> Any:
        return await session.post(decode_url, json=decode_json)

    decode = asyncio.ensure_future(post_decode())
    try:
        async with session.post(prefill_url, json=prefill_json) as pre:
            status, reply = pre.status, await pre.json(content_type=None)
    except BaseException:
        await _drop(decode)
        raise
    if status != 200:
        await _drop(decode)
        return status, reply, None
    return status, reply, await decode


async def _drop(leg: asyncio.Future[Any]) -> None:
    """Closes a decode leg: vLLM aborts a request whose client went away, and the connector
    aborts its room then."""
    leg.cancel()
    with contextlib.suppress(BaseException):
        resp = await leg
        resp.close()


def decode_body(body: dict[str, Any], prefill_reply: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the client's request plus the prefill's kv_transfer_params, if it gave any."""
    params = prefill_reply.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


@dataclass(frozen=True)
class Servers:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    def pairs(self) -> Iterator[tuple[str, str]]:
        """(prefill, decode) URLs in turn, each list cycling on its own."""
        return zip(itertools.cycle(self.prefill), itertools.cycle(self.decode), strict=False)


async def serve(servers: Servers, host: str, port: int, started: asyncio.Event | None = None,
                kvxfer: dict[str, str] | None = None) -> None:
    """``kvxfer``: prefill URL -> ``ADDR/GROUP``, given for ``--concurrent`` (both legs at once)."""
    import aiohttp
    from aiohttp import web

    # No connection cap: concurrency is the clients', not a pool's.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
    turn = servers.pairs()

    async def relay(request: web.Request, url: str, body: dict[str, Any], prefill_ms: float) -> web.StreamResponse:
        async with session.post(url, json=body) as up:
            return await stream(request, up, prefill_ms)

    async def stream(request: web.Request, up: Any, prefill_ms: float) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "application/json"),
            PREFILL_MS_HEADER: f"{prefill_ms:.3f}"})
        await resp.prepare(request)
        async for piece in up.content.iter_any():
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def concurrent(request: web.Request, body: dict[str, Any], prefill: str, decode: str,
                         where: str) -> web.StreamResponse:
        room = new_room()
        pre_params, dec_params = concurrent_params(room, where)
        t0 = asyncio.get_running_loop().time()
        try:
            status, reply, up = await both_legs(session, prefill + request.path, prefill_body(body, pre_params),
                                                decode + request.path, {**body, "kv_transfer_params": dec_params})
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"prefill {prefill} / decode {decode} (room {room}): {exc}"}, status=502)
        if up is None:
            logger.warning("room %d: prefill server %s answered %d: decode leg dropped", room, prefill, status)
            return web.json_response({"error": f"prefill server {prefill} answered {status}", "prefill": reply},
                                     status=status)
        prefill_ms = (asyncio.get_running_loop().time() - t0) * 1e3
        try:
            return await stream(request, up, prefill_ms)
        finally:
            up.release()

    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return web.json_response({"error": f"request body is not JSON: {exc}"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        prefill, decode = next(turn)
        if kvxfer is not None:
            return await concurrent(request, body, prefill, decode, kvxfer[prefill])
        path = request.path
        t0 = asyncio.get_running_loop().time()
        try:
            async with session.post(prefill + path, json=prefill_body(body)) as pre:
                reply = await pre.json(content_type=None)
                if pre.status != 200:
                    return web.json_response({"error": f"prefill server {prefill} answered {pre.status}",
                                              "prefill": reply}, status=pre.status)
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"prefill server {prefill}: {exc}"}, status=502)
        prefill_ms = (asyncio.get_running_loop().time() - t0) * 1e3
        if not reply.get("kv_transfer_params"):
            logger.warning("prefill %s returned no kv_transfer_params: decode %s computes the prompt", prefill, decode)
        try:
            return await relay(request, decode + path, decode_body(body, reply), prefill_ms)
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"decode server {decode}: {exc}"}, status=502)

    async def health(_: web.Request) -> web.Response:
        bad = []
        for url in (*servers.prefill, *servers.decode):
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        bad.append(f"{url}: {r.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                bad.append(f"{url}: {exc!r}")
        return web.json_response({"ok": not bad, "down": bad}, status=503 if bad else 200)

    async def models(_: web.Request) -> web.Response:
        async with session.get(servers.decode[0] + "/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    for route in ROUTES:
        app.router.add_post(route, generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("PD proxy on %s:%d: prefill %s, decode %s", host, port, servers.prefill, servers.decode)
    if started is not None:
        started.set()
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer_client.proxy", description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="prefill server URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="decode server URL (repeatable)")
    ap.add_argument("--concurrent", action="store_true",
                    help="draw the room here and send the prefill and decode legs at once (KvxferdConnector)")
    ap.add_argument("--prefill-kvxfer", action="append", default=[], metavar="ADDR/GROUP",
                    help="with --concurrent, per --prefill in order: its daemon's peer address and prefill group")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    servers = Servers(tuple(u.rstrip("/") for u in args.prefill), tuple(u.rstrip("/") for u in args.decode))
    kvxfer = None
    if args.concurrent:
        if len(args.prefill_kvxfer) != len(servers.prefill):
            ap.error("--concurrent needs one --prefill-kvxfer ADDR/GROUP per --prefill")
        for where in args.prefill_kvxfer:
            try:
                concurrent_params(0, where)
            except ValueError as exc:
                ap.error(str(exc))
        kvxfer = dict(zip(servers.prefill, args.prefill_kvxfer, strict=True))
    try:
        asyncio.run(serve(servers, args.host, args.port, kvxfer=kvxfer))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
