"""Socket writes that do not hold the GIL.

uvloop's transports write in C with the GIL held. A write to a local socket wakes the thread that
reads it (an engine, a peer daemon), and on a loaded node the woken thread often takes this core
on the spot: our loop thread is then off the CPU *with the GIL*, and every transfer worker that
comes back from a post waits for it. On the 2-core VM, py-spy --gil put 48 % of the prefill
daemon's GIL-held samples inside transport writes at TP 4->2 (bench/results/gil-writes-2core.json).
os.write releases the GIL around the syscall, so what the wake-up costs no longer stalls the
workers.

Only plain sockets are written this way (never TLS: the bytes must go through the SSL object),
and only while the transport has nothing buffered, so bytes never overtake each other; whatever
the socket does not take at once goes to the transport, which owns flow control and errors.
"""

from __future__ import annotations

import os
from typing import Any


class DirectWriter:
    """write(data) for one stream transport: os.write first, the transport for the rest."""

    __slots__ = ("_fd", "_transport")

    def __init__(self, transport: Any) -> None:  # asyncio.WriteTransport, or uvloop's (not one by type)
        self._transport = transport
        self._fd = -1
        if transport.get_extra_info("ssl_object") is None and transport.get_extra_info("sslcontext") is None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                self._fd = sock.fileno()

    @property
    def direct(self) -> bool:
        return self._fd >= 0

    def write(self, data: bytes) -> None:
        t = self._transport
        # is_closing(): a closed transport's descriptor may already belong to another socket.
        if self._fd >= 0 and not t.is_closing() and not t.get_write_buffer_size():
            try:
                n = os.write(self._fd, data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                # The transport makes the same write, sees the same error and closes as it would have.
                n = 0
            if n == len(data):
                return
            data = data[n:]
        t.write(data)
