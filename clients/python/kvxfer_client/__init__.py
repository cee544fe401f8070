"""Engine-side client of kvxferd: hand KV chunks to the node's daemon and receive them.

Blocking: PrefillSender, DecodeReceiver. asyncio: AsyncPrefillSender, AsyncDecodeReceiver
(created with ``await AsyncPrefillSender.create(...)``). No gRPC knowledge needed.
"""

from kvxfer_client._aio import AsyncDecodeReceiver, AsyncPrefillSender, async_daemon_status
from kvxfer_client._channel import Tls, default_socket
from kvxfer_client._parts import layer_part, seal_part
from kvxfer_client._sync import DecodeReceiver, daemon_status
from kvxfer_client._sync_prefill import PrefillSender
from kvxfer_client.errors import ChunkRefused, KvxferError, RoomFailed
from kvxfer_client.types import Chunk, Landed, Layout, RoomEvent, RoomState, RoomStatus, Slot
from kvxfer_protocol.version import PACKAGE_VERSION

__version__ = PACKAGE_VERSION

__all__ = [
    "AsyncDecodeReceiver",
    "AsyncPrefillSender",
    "Chunk",
    "ChunkRefused",
    "DecodeReceiver",
    "KvxferError",
    "Landed",
    "Layout",
    "PrefillSender",
    "RoomEvent",
    "RoomFailed",
    "RoomState",
    "RoomStatus",
    "Slot",
    "Tls",
    "async_daemon_status",
    "daemon_status",
    "default_socket",
    "layer_part",
    "seal_part",
]
