"""The engine API's fast lane: its unary calls (and the WatchRooms stream) framed by hand on a
Unix socket beside the gRPC one. The daemon serves it (kvxferd/engine_api/lane.py), the client
calls it (clients/python/kvxfer_client/_lane.py); this is the one definition both use.

Frames (little-endian). Request: payload length u32, call id u32, timeout ms u32 (0 = none),
method name length u8, then the method name and the serialized request. Reply: payload length
u32, call id u32, status code u8 (gRPC's numbering), then the serialized reply (code 0) or the
error message in UTF-8. A connection may have many calls outstanding; replies carry their id.

Server streams (WatchRooms): each message is a reply frame with status STREAM_MORE; the stream
ends with an ordinary reply frame (code 0 and no payload, or an error).
"""

from __future__ import annotations

import struct

# The lane's socket is the engine socket's path with this suffix.
LANE_SUFFIX = ".lane"
REQUEST = struct.Struct("<IIIB")
REPLY = struct.Struct("<IIB")
# Status of a reply frame that carries one message of a server stream; more follow.
STREAM_MORE = 0xFF


def request_frame(name: bytes, call_id: int, timeout_ms: int, body: bytes) -> bytes:
    return REQUEST.pack(len(name) + len(body), call_id, timeout_ms, len(name)) + name + body


def reply_frame(call_id: int, code: int, payload: bytes) -> bytes:
    return REPLY.pack(len(payload), call_id, code) + payload
