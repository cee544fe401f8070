"""The prefill instance's bootstrap server for the sglang backend (sglang's bootstrap port): it
only tells decode ranks which daemon and group serve the instance, the one thing the two sides
exchange outside kvxferd."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer


class KvxferdKVBootstrapServer(BaseKVBootstrapServer):
    """Serves the prefill instance's route ({group, daemon address, tp_size}) on sglang's bootstrap port."""

    def __init__(self, host: str, port: int) -> None:
        route: dict[str, bytes] = {}

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                route["route"] = self.rfile.read(n)
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
