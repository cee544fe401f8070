"""Registrations whose GPU ring is still being imported.

A CUDA IPC import (CUDA context, IPC open, NIXL VRAM registration) took seconds per ring on a GPU
box with eight ranks per side starting at once, and registrations queue behind each other in the
blocking executor: a RegisterEngine that waited for its import ran past the client's call
deadline. A client that sets ``accept_pending`` gets an answer at once (or as soon as a quick
import finished) with a registration id, and asks again with that id until the engine exists;
no single call has to outlive the import. The engine is added to the node only once its ring is
imported, so no other code path ever sees an engine without a ring.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from kvxferd.core.engines import Engine
from kvxferd.errors import NotFound, ResourceExhausted

logger = logging.getLogger(__name__)

# A quick import is answered by the first call; a slow one is re-asked after at most this long.
FIRST_WAIT_S = 0.5
POLL_WAIT_S = 2.0
# A finished registration nobody came back for is forgotten (its engine then lapses by lease).
KEEP_S = 120.0
MAX_PENDING = 4096


class PendingRegistrations:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Engine]] = {}
        self._finished_at: dict[str, float] = {}

    def start(self, registration: Coroutine[Any, Any, Engine]) -> str:
        self._prune()
        if len(self._tasks) >= MAX_PENDING:
            registration.close()
            raise ResourceExhausted(f"{MAX_PENDING} registrations are already pending")
        reg_id = uuid.uuid4().hex
        task = asyncio.ensure_future(registration)
        self._tasks[reg_id] = task
        task.add_done_callback(lambda t, r=reg_id: self._done(r, t))  # type: ignore[misc]
        return reg_id

    def _done(self, reg_id: str, task: asyncio.Task[Engine]) -> None:
        self._finished_at[reg_id] = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            # Retrieved here so an abandoned failure is logged once, not as "never retrieved".
            logger.info("pending registration %s failed: %s", reg_id, task.exception())

    def _prune(self) -> None:
        cutoff = time.monotonic() - KEEP_S
        for reg_id in [r for r, at in self._finished_at.items() if at < cutoff]:
            self._finished_at.pop(reg_id, None)
            self._tasks.pop(reg_id, None)

    async def wait(self, reg_id: str, wait_s: float) -> Engine | None:
        """The registered engine, None while the import runs on after ``wait_s``; raises what the
        registration raised. A result is handed out once."""
        task = self._tasks.get(reg_id)
        if task is None:
            raise NotFound(f"no pending registration {reg_id!r} (finished and collected, or expired)")
        await asyncio.wait({task}, timeout=wait_s)
        if not task.done():
            return None
        self._tasks.pop(reg_id, None)
        self._finished_at.pop(reg_id, None)
        return task.result()
