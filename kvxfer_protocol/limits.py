"""Limits both sides of the engine API and the peer protocol enforce: a client checks them before a
call so that what it sends is never refused for size, and the daemon refuses what passes them."""

from __future__ import annotations

# Chunk ids of one room count from 0 and stay below this (a room's chunk count is at most this).
MAX_CHUNK_ID = 1 << 20
# A room's aux data (engine state beside the KV, sent with its last chunk).
MAX_AUX_BYTES = 64 << 10
# Chunks one EnqueueChunks call may carry (the daemon refuses more with INVALID_ARGUMENT).
MAX_BATCH_CHUNKS = 4096
# Layers a layer-wise chunk may name (layer parts, protocol 1.1): so at most this many parts a chunk
# per writer, and a per-(writer, chunk) layer mask stays a small int.
MAX_LAYERS = 1024
