"""RoomView, the sglang backend's record of one room's events (kvxfer_client.sglang._watch): the
state only moves forward, an outcome stays, and a view says when the events may have missed
something (so the backend asks the daemon once instead of waiting for ever)."""

from __future__ import annotations

import time

import pytest

from kvxfer_client.sglang import _watch
from kvxfer_client.sglang._watch import RoomView
from kvxfer_client.types import RoomEvent, RoomState


def said(state: RoomState, code: str = "", reason: str = "", aux: bytes = b"") -> RoomEvent:
    return RoomEvent(room=1, generation=0, state=state, failure_code=code, failure_reason=reason, aux=aux)


def test_state_moves_forward_and_outcomes_stay() -> None:
    v = RoomView()
    v.update(said(RoomState.TRANSFERRING), epoch=1)
    v.update(said(RoomState.BOOTSTRAPPING), epoch=1)  # a poll answered before a later event
    assert v.state is RoomState.TRANSFERRING
    v.update(said(RoomState.FAILED, "ABORTED", "gone"), epoch=1)
    v.update(said(RoomState.SUCCESS, aux=b"late"), epoch=1)
    assert (v.state, v.failure, v.aux) == (RoomState.FAILED, "ABORTED: gone", b"")


def test_success_keeps_its_aux() -> None:
    v = RoomView()
    v.update(said(RoomState.SUCCESS, aux=b"first-token"), epoch=1)
    v.update(said(RoomState.SUCCESS), epoch=1)
    assert (v.state, v.aux) == (RoomState.SUCCESS, b"first-token")


def test_stale_until_synced_under_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    v = RoomView()
    assert v.stale(epoch=1)  # never heard of
    v.update(said(RoomState.TRANSFERRING), epoch=1)
    assert not v.stale(epoch=1)
    assert v.stale(epoch=2)  # the stream was reopened: events in between may be lost
    v.update(said(RoomState.TRANSFERRING), epoch=2)
    assert not v.stale(epoch=2)
    monkeypatch.setattr(_watch, "RESYNC_S", 0.01)
    time.sleep(0.02)
    assert v.stale(epoch=2)  # silent too long


def test_outcome_is_never_stale() -> None:
    v = RoomView()
    v.update(said(RoomState.SUCCESS), epoch=1)
    assert not v.stale(epoch=5)
