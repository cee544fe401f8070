"""The processes of ``kvxferd bench loopback``, both ends of their pipe: the coordinator sends a
command tuple and gets ("ok", value) or ("error", traceback); "stop" closes the child.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def redirect_output(log_path: str) -> None:
    """Native libraries (UCX, NIXL, glog) print to fd 1/2: send it to the process's log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def child_loop(conn: Connection, handler: Callable[[tuple[Any, ...]], Any], close: Callable[[], None]) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            close()
            return
        if msg[0] == "stop":
            try:
                close()
            finally:
                conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handler(msg)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Child:
    """A spawned process driven through a pipe: send a command, get ("ok", value) or ("error", text)."""

    def __init__(self, ctx: Any, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer in {timeout:.0f} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name}: process died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def call(self, *msg: Any, timeout: float = 120.0) -> Any:
        self.send(*msg)
        return self.recv(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("stop")
                self.recv(10)
            except Exception:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
