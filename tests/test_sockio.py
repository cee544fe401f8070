"""kvxferd.sockio.DirectWriter on real sockets, under asyncio's loop and uvloop (the daemon's)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from kvxferd.sockio import DirectWriter

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


class _Counting:
    """The real transport, with its write() calls counted."""

    def __init__(self, transport: Any) -> None:
        self.t = transport
        self.writes: list[int] = []

    def write(self, data: bytes) -> None:
        self.writes.append(len(data))
        self.t.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.t, name)


async def _pair() -> tuple[Any, socket.socket]:
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    theirs.setblocking(False)
    return transport, theirs


async def _read_all(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < n:
        got += await loop.sock_recv(sock, 1 << 20)
    return bytes(got)


@pytest.mark.parametrize("loop", list(RUNNERS))
def test_small_writes_go_straight_to_the_socket(loop: str) -> None:
    async def main() -> None:
        transport, theirs = await _pair()
        spy = _Counting(transport)
        w = DirectWriter(spy)
        assert w.direct
        for i in range(100):
            w.write(b"%05d" % i)
        assert spy.writes == []  # the transport was never needed
        assert await _read_all(theirs, 500) == b"".join(b"%05d" % i for i in range(100))
        transport.close()
        theirs.close()

    RUNNERS[loop](main())


@pytest.mark.parametrize("loop", list(RUNNERS))
def test_what_the_socket_does_not_take_goes_to_the_transport_in_order(loop: str) -> None:
    async def main() -> None:
        transport, theirs = await _pair()
        spy = _Counting(transport)
        w = DirectWriter(spy)
        big = os.urandom(8 << 20)  # far beyond a socket buffer: the kernel takes part of it
        w.write(big)
        assert len(spy.writes) == 1 and 0 < spy.writes[0] < len(big)
        # Bytes are buffered in the transport now: the next write must queue behind them.
        w.write(b"tail")
        assert spy.writes[1:] == [4]
        assert await _read_all(theirs, len(big) + 4) == big + b"tail"
        transport.close()
        theirs.close()

    RUNNERS[loop](main())


@pytest.mark.parametrize("loop", list(RUNNERS))
def test_a_closing_transport_is_never_written_around(loop: str) -> None:
    async def main() -> None:
        transport, theirs = await _pair()
        spy = _Counting(transport)
        w = DirectWriter(spy)
        transport.close()
        w.write(b"late")  # its descriptor may already be another socket's: only the transport may decide
        assert spy.writes == [4]
        await asyncio.sleep(0.05)
        assert theirs.recv(16) == b""  # closed, and "late" never reached the socket
        theirs.close()

    RUNNERS[loop](main())


def test_tls_transports_are_left_to_the_transport() -> None:
    with socket.socket() as sock:
        class _Tls:
            def get_extra_info(self, name: str) -> Any:
                return {"ssl_object": object(), "socket": sock}.get(name)

        assert not DirectWriter(_Tls()).direct
