"""The client of ``kvxferd bench engines``: sends the request mix through the proxy at a fixed
concurrency (closed loop: N requests always in flight) and times each one from the moment it is
sent to its first streamed token (TTFT) and to its last byte (end to end), keeping its token ids.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxferd.bench.engines_model import Request
from kvxferd.bench.engines_proxy import PREFILL_MS_HEADER


@dataclass
class Outcome:
    index: int
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    e2e_s: float | None = None
    prefill_ms: float | None = None
    finish_reason: str | None = None
    error: str = ""


def body(req: Request) -> dict[str, Any]:
    """Greedy, fixed length (EOS ignored), token ids in the stream."""
    return {"model": "bench", "prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


async def _one(session: Any, url: str, req: Request) -> Outcome:
    out = Outcome(req.index, len(req.prompt))
    t0 = time.monotonic()
    try:
        async with session.post(url, json=body(req)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            if PREFILL_MS_HEADER in resp.headers:
                out.prefill_ms = float(resp.headers[PREFILL_MS_HEADER])
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    out.error = str(msg["error"])[:500]
                    break
                choice = msg["choices"][0]
                ids = choice.get("token_ids") or []
                if ids and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0
                out.tokens.extend(int(t) for t in ids)
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    except Exception as exc:  # the request's failure is reported with the point, not raised
        out.error = f"{type(exc).__name__}: {exc}"[:500]
        return out
    out.e2e_s = time.monotonic() - t0
    if not out.error and len(out.tokens) != 0 and out.ttft_s is None:
        out.error = "no token ids in the stream"
    return out


async def run_point(base_url: str, route: str, requests: Sequence[Request], concurrency: int,
                    timeout_s: float) -> tuple[list[Outcome], float]:
    """Every request once, `concurrency` in flight; outcomes in request order and the wall time."""
    import aiohttp

    url = f"{base_url}/{route}/v1/completions"
    todo: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        todo.put_nowait(r)
    results: list[Outcome] = []

    async def worker(session: Any) -> None:
        while True:
            try:
                req = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await _one(session, url, req))

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.monotonic() - t0
    results.sort(key=lambda o: o.index)
    return results, wall
