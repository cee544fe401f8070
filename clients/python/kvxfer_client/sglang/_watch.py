"""Room events for the sglang backend: each rank reads its engine's WatchRooms stream on a thread
of its own, so that sglang's per-step ``poll()`` and the decode loader learn of landed chunks and
room ends by push instead of asking the daemon (PollRoom) for every room on every step.

Events can be lost only with the stream (the daemon restarted, a watcher fell too far behind).
The thread opens a new stream and bumps :attr:`RoomWatch.epoch`; a room whose last sync is from
an older epoch, or that has heard nothing for :data:`RESYNC_S`, is asked for once with PollRoom.
A lost event so costs at most that delay and one call, never a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvxfer_client.errors import KvxferError
from kvxfer_client.types import RoomEvent, RoomState, RoomStatus

logger = logging.getLogger(__name__)

# A room with no event for this long is polled once: covers an event lost with its stream while
# a new stream was being opened (the daemon does not replay what happened in between).
RESYNC_S = 1.0
_REOPEN_S = 0.2


class RoomWatch:
    """Reads one engine's WatchRooms stream on a named daemon thread and passes each batch of
    events that arrived together to `on_batch` (on that thread)."""

    def __init__(self, client: Any, name: str, on_batch: Callable[[list[RoomEvent]], None]) -> None:
        self._client = client
        self._on_batch = on_batch
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self.epoch = 0  # streams opened so far; a room synced under an older one polls once
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stream = self._client.watch()
                with self._lock:
                    if self._stop.is_set():
                        stream.cancel()
                        return
                    self._stream = stream
                    self.epoch += 1
                for batch in stream.batches():
                    self._on_batch(batch)
            except KvxferError as exc:
                logger.debug("room event stream ended: %s", exc)
            except Exception:
                logger.exception("room event stream: handler failed; reopening the stream")
            self._stop.wait(_REOPEN_S)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()


class RoomView:
    """What one room's events said last, kept by the watch thread and read by sglang's thread:
    the state only moves forward (a poll answered before an event that overtook it cannot undo
    it) and SUCCESS/FAILED stay."""

    def __init__(self) -> None:
        self.state: RoomState | None = None
        self.failure = ""
        self.aux = b""
        self.epoch = -1  # the watch epoch of the last event or poll
        self.synced_at = 0.0

    def update(self, said: RoomEvent | RoomStatus, epoch: int) -> None:
        """Takes what an event or a PollRoom answer says of the room, heard under stream `epoch`."""
        state = said.state
        if self.state is None or (self.state not in (RoomState.SUCCESS, RoomState.FAILED) and state > self.state):
            # The reason and aux first: another thread that sees the new state reads them too.
            self.failure = f"{said.failure_code}: {said.failure_reason}"
            if said.aux:
                self.aux = said.aux
            self.state = state
        self.epoch = max(self.epoch, epoch)
        self.synced_at = time.monotonic()

    def stale(self, epoch: int) -> bool:
        """True when the events may have missed something: never synced, synced under an older
        stream, or silent for RESYNC_S."""
        if self.state in (RoomState.SUCCESS, RoomState.FAILED):
            return False
        return self.state is None or self.epoch != epoch or time.monotonic() - self.synced_at > RESYNC_S
