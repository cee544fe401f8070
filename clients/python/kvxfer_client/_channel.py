"""The gRPC channel to the node's daemon: where its socket is, message limits, TLS."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 4 << 20


def default_socket() -> str:
    env = os.environ.get("KVXFERD_SOCKET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "kvxferd", "kvxferd.sock")
    return f"/tmp/kvxferd-{os.getuid()}/kvxferd.sock"


def target(socket: str | None) -> str:
    """gRPC target: a Unix socket path, or HOST:PORT for a TCP engine listener."""
    path = socket or default_socket()
    if path.startswith("unix:") or (":" in path and not path.startswith("/")):
        return path
    return f"unix:{path}"


CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


Pem = str | bytes | os.PathLike[str]


def _pem(value: Pem | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as fh:
        return fh.read()


@dataclass(frozen=True)
class Tls:
    """TLS to a daemon's TCP engine listener (`listen` with `tls_*` set on the daemon).

    `ca` verifies the daemon's certificate (None: the system's roots); `cert` and `key` are this
    engine's client certificate for mutual TLS (`tls_client_auth = true`). Each is a file path or
    the PEM bytes themselves. `server_name` overrides the name checked against the daemon's
    certificate (default: the host of the address dialled).
    """

    ca: Pem | None = None
    cert: Pem | None = None
    key: Pem | None = None
    server_name: str = ""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("Tls: cert and key go together (mutual TLS), or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca), private_key=_pem(self.key), certificate_chain=_pem(self.cert)
        )

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel_args(socket: str | None, tls: Tls | None) -> tuple[str, grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """(target, credentials or None for plaintext, options) for a sync or asyncio channel."""
    dest = target(socket)
    if tls is None:
        return dest, None, list(CHANNEL_OPTIONS)
    if dest.startswith("unix:"):
        raise ValueError("TLS is for a TCP engine listener (HOST:PORT); the Unix socket is guarded by file permissions")
    return dest, tls.credentials(), [*CHANNEL_OPTIONS, *tls.options()]


def sync_channel(socket: str | None, tls: Tls | None = None) -> grpc.Channel:
    dest, creds, opts = channel_args(socket, tls)
    return grpc.secure_channel(dest, creds, options=opts) if creds else grpc.insecure_channel(dest, options=opts)


def aio_channel(socket: str | None, tls: Tls | None = None) -> grpc.aio.Channel:
    dest, creds, opts = channel_args(socket, tls)
    if creds:
        return grpc.aio.secure_channel(dest, creds, options=opts)
    return grpc.aio.insecure_channel(dest, options=opts)
