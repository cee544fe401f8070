"""The prefill instance's bootstrap server for the sglang backend (sglang's bootstrap port): it
only tells decode ranks which daemon and group serve the instance, the one thing the two sides
exchange outside kvxferd."""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

ROUTE_PATH = "/kvxferd/route"


@dataclass(frozen=True)
class PrefillRoute:
    """What a decode rank knows of one prefill instance: the group and daemon that serve it, and
    its parallel shape. It is the value of the decode manager's ``prefill_info_table`` (sglang's
    queues read ``dp_size`` and ``follow_bootstrap_room`` from it to pick a prefill DP rank)."""

    group: str
    address: str
    tp_size: int
    page_size: int
    # The prefill's KV layout (decode KVArgs have no head counts: a decode rank registers with this).
    total_kv_heads: int
    head_dim: int
    dtype_bytes: int
    mla: bool
    dp_size: int = 1  # a kvxferd group is one prefill instance: one DP rank
    follow_bootstrap_room: bool = True

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size

    def to_json(self) -> bytes:
        return json.dumps({"group": self.group, "address": self.address, "tp_size": self.tp_size,
                           "page_size": self.page_size, "total_kv_heads": self.total_kv_heads,
                           "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes, "mla": self.mla}).encode()

    @classmethod
    def from_json(cls, body: bytes) -> PrefillRoute:
        try:
            d = json.loads(body)
            return cls(group=str(d["group"]), address=str(d["address"]), tp_size=int(d["tp_size"]),
                       page_size=int(d["page_size"]), total_kv_heads=int(d["total_kv_heads"]),
                       head_dim=int(d["head_dim"]), dtype_bytes=int(d["dtype_bytes"]), mla=bool(d["mla"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed kvxferd route {body[:200]!r}: {exc}") from None


def fetch_route(bootstrap_addr: str, timeout: float) -> PrefillRoute:
    """The route a prefill instance registered on its bootstrap server. Raises OSError when the
    server is not reachable or has no route yet (HTTP 404), ValueError when the answer is malformed."""
    with urllib.request.urlopen(f"http://{bootstrap_addr}{ROUTE_PATH}", timeout=timeout) as r:
        return PrefillRoute.from_json(r.read())


def put_route(bootstrap_addr: str, route: PrefillRoute, timeout: float = 10.0) -> None:
    req = urllib.request.Request(f"http://{bootstrap_addr}{ROUTE_PATH}", data=route.to_json(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


class KvxferdKVBootstrapServer(BaseKVBootstrapServer):
    """Serves the prefill instance's route ({group, daemon address, tp_size}) on sglang's bootstrap port."""

    def __init__(self, host: str, port: int) -> None:
        route: dict[str, bytes] = {}

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(n)
                try:
                    PrefillRoute.from_json(body)
                except ValueError as exc:
                    self._reply(400, json.dumps({"error": str(exc)}).encode())
                    return
                route["route"] = body
                self._reply(200, b"{}")

            def do_GET(self) -> None:
                body = route.get("route")
                self._reply(200, body) if body else self._reply(404, b'{"error": "no prefill engine registered"}')

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvxfer-sglang-bootstrap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
