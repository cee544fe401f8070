"""Reattach: one engine registration that heals by itself when its daemon restarts, stalls or
comes back, for adapters (the vLLM connector, others) that must never restart their engine for it.

``Reattach(factory)`` registers at once (``factory()`` builds a PrefillSender or a
DecodeReceiver). The adapter takes the client with ``get()`` before each use, and hands every
KvxferError a call raised to ``failed(exc, epoch)``. An error that says the registration is gone
(the daemon restarted: NOT_FOUND "earlier instance", or forgot the engine: "unknown engine") or
that the daemon cannot be reached in time (UNAVAILABLE, DEADLINE_EXCEEDED) marks the path DOWN:
``get()`` then raises :class:`Detached` at once, without touching the daemon, so an engine's
step never waits on a daemon that is away. A thread of its own probes the daemon every
``retry_s`` (KeepAlive: one small call), so a daemon that restarted while the engine was idle is
registered with again before the engine's next transfer needs it; while DOWN:

* the same registration still answers (a stalled daemon resumed in time): UP again, same epoch;
  its rooms go on;
* the daemon is back but forgot the engine (restarted, or the lease lapsed while it was
  stopped): a new registration (new ring, same group and rank), ``epoch`` + 1, UP.

Epochs are how an adapter never delivers a wrong byte: a room started under one epoch is
failed by the adapter (never resumed) once ``epoch`` moved on; its slots and landed chunks
belonged to a ring that is gone. The old client is closed a grace period later (the adapter's
threads may be finishing a copy out of its ring mapping).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

from kvxfer_client._sync import _EngineClient
from kvxfer_client.errors import KvxferError
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=_EngineClient)

# Codes that say the daemon could not be reached in time; NOT_FOUND only with these words (a
# room unknown to the daemon is the room's own business, not the registration's).
_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_GONE_WORDS = ("earlier instance", "unknown engine")
# A retired client's ring mapping outlives its retirement by this much: a copy out of it that
# started before the swap ends long before.
_RETIRE_GRACE_S = 5.0


class Detached(KvxferError):
    """The transfer path is down (the daemon is away, or the engine is registering again): the
    call was not sent."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"{what}: kvxferd transfer path is down ({reason})")


def registration_lost(exc: BaseException) -> bool:
    """Does this error say that the registration, or the way to the daemon, is gone?"""
    if isinstance(exc, Detached) or not isinstance(exc, KvxferError):
        return False
    if exc.code in _AWAY:
        return True
    return exc.code is grpc.StatusCode.NOT_FOUND and any(w in exc.message for w in _GONE_WORDS)


class Reattach(Generic[C]):
    """One registration kept alive across daemon restarts and stalls (see the module docstring).

    on_change(up, epoch, reason) is called on every transition, from the thread that saw it."""

    def __init__(self, factory: Callable[[], C], what: str, *, probe_timeout_s: float = 1.0,
                 retry_s: float = 0.5, on_change: Callable[[bool, int, str], None] | None = None) -> None:
        self._factory = factory
        self.what = what
        self._probe_timeout = probe_timeout_s
        self._retry_s = retry_s
        self._on_change = on_change or (lambda up, epoch, reason: None)
        self._lock = threading.Lock()
        self._client: C = factory()  # the first registration is the engine's start: it may raise
        self.epoch = 0
        # The newest epoch whose rooms are known gone with their daemon (it closed the connection
        # or forgot the engine); a stall (DEADLINE_EXCEEDED) loses nothing yet.
        self.lost_epoch = -1
        self.reason = ""
        self.transitions = 0  # DOWN and UP changes, for metrics and tests
        self._down = False
        self._slow = 0  # KeepAlive probes in a row that got no answer in time
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._retired: list[tuple[float, C]] = []
        self._healer = threading.Thread(target=self._heal_loop, name=f"kvxfer-reattach-{what}", daemon=True)
        self._healer.start()

    @property
    def up(self) -> bool:
        return not self._down

    def get(self) -> tuple[C, int]:
        """The client and its epoch; raises Detached at once while the path is down."""
        with self._lock:
            if self._down:
                raise Detached(self.what, self.reason)
            return self._client, self.epoch

    def current(self) -> tuple[C, int]:
        """The client and its epoch even while down (for calls that only clean up after a room)."""
        with self._lock:
            return self._client, self.epoch

    def failed(self, exc: BaseException, epoch: int) -> bool:
        """Hands an error of a call made with the client of `epoch`; True if it took the path
        DOWN (now or already), i.e. the caller must fail its room rather than retry."""
        if isinstance(exc, Detached):
            return True
        if not registration_lost(exc) or not isinstance(exc, KvxferError):
            return False
        with self._lock:
            if epoch != self.epoch:
                return True  # an older registration's error: the newer one already replaced it
            if exc.code is not grpc.StatusCode.DEADLINE_EXCEEDED:
                self.lost_epoch = max(self.lost_epoch, epoch)
            if self._down:
                return True
            self._down, self.reason = True, str(exc)
            self.transitions += 1
        logger.warning("kvxferd transfer path DOWN for %s (epoch %d): %s", self.what, epoch, exc)
        self._on_change(False, epoch, str(exc))
        self._wake.set()
        return True

    # ------------------------------------------------------------------ the healer thread

    def _heal_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self._retry_s)
            self._wake.clear()
            self._close_retired(time.monotonic())
            if not self._down:
                self._watch()
            while self._down and not self._closed.is_set():
                if self._try_heal():
                    break
                self._closed.wait(self._retry_s)

    def _watch(self) -> None:
        """While up: a daemon that restarted, died or stalled is noticed here, before the
        engine's next transfer needs it (that transfer then goes to the new registration, or
        fails at once instead of waiting out a call timeout). One slow answer is not taken for a
        stall (a loaded host is slow); two in a row are."""
        with self._lock:
            client, epoch = self._client, self.epoch
        try:
            client.stub.KeepAlive(engine_pb2.KeepAliveRequest(engine_id=client.engine_id), timeout=self._probe_timeout)
        except KvxferError as exc:
            slow = exc.code is grpc.StatusCode.DEADLINE_EXCEEDED
            self._slow = self._slow + 1 if slow else 0
            if not slow or self._slow >= 2:
                self.failed(exc, epoch)
            return
        except grpc.RpcError:
            return
        self._slow = 0

    def _try_heal(self) -> bool:
        with self._lock:
            old, epoch = self._client, self.epoch
        try:
            old.stub.KeepAlive(engine_pb2.KeepAliveRequest(engine_id=old.engine_id), timeout=self._probe_timeout)
        except KvxferError as exc:
            if not (exc.code is grpc.StatusCode.NOT_FOUND and any(w in exc.message for w in _GONE_WORDS)):
                return False  # still away (or stalled): probe again later
            return self._register_again(old, epoch, exc)
        except grpc.RpcError:
            return False
        self._set_up(epoch, "the daemon answered again; the registration still holds")
        return True

    def _register_again(self, old: C, epoch: int, why: KvxferError) -> bool:
        try:
            new = self._factory()
        except Exception as exc:  # the daemon is back but not ready to register us yet
            logger.info("%s: registering again failed (%s); retrying", self.what, exc)
            return False
        with self._lock:
            self._client, self.epoch, self.lost_epoch = new, epoch + 1, epoch
            self._retired.append((time.monotonic(), old))
        self._set_up(epoch + 1, f"registered again as {new.engine_id} ({why.message})")
        return True

    def _set_up(self, epoch: int, how: str) -> None:
        with self._lock:
            self._down, self.reason, self._slow = False, "", 0
            self.transitions += 1
        logger.warning("kvxferd transfer path UP again for %s (epoch %d): %s", self.what, epoch, how)
        self._on_change(True, epoch, how)

    def _close_retired(self, now: float, force: bool = False) -> None:
        with self._lock:
            due = [c for t, c in self._retired if force or now - t >= _RETIRE_GRACE_S]
            self._retired = [(t, c) for t, c in self._retired if not (force or now - t >= _RETIRE_GRACE_S)]
        for client in due:
            try:
                client.close(unregister=False)  # its daemon instance is gone: nothing to unregister
            except Exception as exc:
                logger.debug("%s: closing a retired registration: %s", self.what, exc)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._healer.join(timeout=5)
        self._close_retired(time.monotonic(), force=True)
        with self._lock:
            client = self._client
        client.close(unregister=not self._down)
