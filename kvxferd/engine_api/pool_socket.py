"""Hands the host pool to local engines as a file descriptor, when the pool has no path.

A pool on a private huge-page tmpfs (kvxferd.buffers.hugepool) is named nowhere: an engine connects to
``<socket>.pool`` and receives the open file with SCM_RIGHTS, then maps it as it would map a
file in /dev/shm. Who may connect is decided as for the engine API socket (same mode, same
group). Each connection gets one message and is closed: the loop never waits on a client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket

from kvxferd.ops.owned_files import bind_unix_socket

logger = logging.getLogger(__name__)

PROTOCOL = "kvxferd-pool/1"


class PoolSocket:
    def __init__(self, path: str, pool_fd: int, instance: str, pool_bytes: int) -> None:
        self.path = path
        self._fd = pool_fd
        self._header = json.dumps({"protocol": PROTOCOL, "instance": instance, "bytes": pool_bytes}).encode()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop, mode: int, gid: int = -1) -> None:
        sock = bind_unix_socket(self.path, mode, gid)
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("pool socket: accept failed: %s", exc)
                return
            with conn:
                conn.setblocking(False)
                try:
                    # One small message into a fresh connection's empty buffer: never blocks.
                    socket.send_fds(conn, [self._header], [self._fd])
                except OSError as exc:
                    logger.info("pool socket: a client left before taking the pool: %s", exc)

    def close(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None  # the daemon removes the socket file with the others next to its socket
