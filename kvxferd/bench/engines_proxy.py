"""The PD proxy of ``kvxferd bench engines``, a process of its own (its CPU is measured apart):
what vLLM's disaggregated-serving examples do, for any number of named routes.

``POST /<route>/v1/completions``: a ``pd`` route sends the request to its prefill server with
``max_tokens=1``, no streaming and the route's ``kv_transfer_params`` (``do_remote_decode``), then
sends it to its decode server with the ``kv_transfer_params`` the prefill response returned and
streams the decode server's response back. A ``direct`` route streams one server's response (the
non-disaggregated reference, through the same hops). The prefill leg's wall time goes back in the
``x-kvx-prefill-ms`` header.

Run: ``python -m kvxferd.bench.engines_proxy --routes ROUTES.json --ready-file PATH``; ROUTES maps
a route name to ``{"kind": "pd"|"direct", "prefill": URL, "decode": URL, "prefill_params": {...}}``, and for a
route of KvxferdConnector engines ``"concurrent": "ADDR/GROUP"``: both legs at once, the room
drawn here (``kvxfer_client.proxy --concurrent``); its prefill leg's time is then its own wall
time, the decode leg running meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvxfer_client.proxy import KEEPALIVE_S, PREFILL_MS_HEADER, both_legs, concurrent_params, new_room, prefill_body


async def serve(routes: dict[str, dict[str, Any]], ready_file: Path) -> None:
    import aiohttp
    from aiohttp import web

    # No connection cap: the bench's concurrency is the client's, not a pool's.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                    timeout=aiohttp.ClientTimeout(total=None))

    async def stream_from(request: web.Request, url: str, body: dict[str, Any],
                          headers: dict[str, str]) -> web.StreamResponse:
        async with session.post(f"{url}/v1/completions", json=body) as up:
            return await stream(request, up, headers)

    async def stream(request: web.Request, up: Any, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, headers={
            **headers, "Content-Type": up.headers.get("Content-Type", "text/event-stream")})
        await resp.prepare(request)
        async for piece in up.content.iter_any():
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def concurrent(request: web.Request, route: dict[str, Any], body: dict[str, Any]) -> web.StreamResponse:
        """Both legs at once, the room drawn here (kvxfer_client.proxy --concurrent)."""
        pre_params, dec_params = concurrent_params(new_room(), route["concurrent"])
        t0 = time.monotonic()
        _, reply, up = await both_legs(
            session, f"{route['prefill']}/v1/completions",
            prefill_body(body, {**route["prefill_params"], **pre_params}),
            f"{route['decode']}/v1/completions", {**body, "kv_transfer_params": dec_params})
        if up is None:
            return web.json_response({"error": "prefill failed", "prefill": reply}, status=502)
        try:
            return await stream(request, up, {PREFILL_MS_HEADER: f"{(time.monotonic() - t0) * 1e3:.3f}"})
        finally:
            up.release()

    async def completions(request: web.Request) -> web.StreamResponse:
        route = routes.get(request.match_info["route"])
        if route is None:
            return web.json_response({"error": f"no route {request.match_info['route']!r}"}, status=404)
        body = await request.json()
        if route["kind"] == "direct":
            return await stream_from(request, route["decode"], body, {})
        if route.get("concurrent"):
            return await concurrent(request, route, body)
        t0 = time.monotonic()
        async with session.post(f"{route['prefill']}/v1/completions",
                                json=prefill_body(body, route["prefill_params"])) as pre:
            reply = await pre.json(content_type=None)
            if pre.status != 200:
                return web.json_response({"error": "prefill failed", "prefill": reply}, status=502)
        params = reply.get("kv_transfer_params")
        if not params:
            return web.json_response({"error": "prefill returned no kv_transfer_params", "prefill": reply}, status=502)
        prefill_ms = (time.monotonic() - t0) * 1e3
        return await stream_from(request, route["decode"], {**body, "kv_transfer_params": params},
                                 {PREFILL_MS_HEADER: f"{prefill_ms:.3f}"})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/{route}/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    tmp = ready_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": port}))
    tmp.replace(ready_file)
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxferd.bench.engines_proxy")
    ap.add_argument("--routes", type=Path, required=True)
    ap.add_argument("--ready-file", type=Path, required=True)
    args = ap.parse_args(argv)
    routes = json.loads(args.routes.read_text())
    try:
        asyncio.run(serve(routes, args.ready_file))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
