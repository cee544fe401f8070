"""kvxferd.core.types.quick_init: the faster __init__ of the per-chunk frozen dataclasses must build
the same objects the dataclass's own __init__ builds, and keep them frozen."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from kvxferd.core.types import ChunkSpec, LandedChunk, RoomEvent, RoomKey, RoomState, SlotRef, quick_init


@dataclass(frozen=True, slots=True)
class _PlainSlots:
    a: int
    b: str = "b"
    c: tuple[int, ...] = ()


@dataclass(frozen=True)
class _PlainDict:
    a: int
    b: str = "b"


QuickSlots = quick_init(dataclass(frozen=True, slots=True)(type("QuickSlots", (), {
    "__annotations__": {"a": int, "b": str, "c": tuple}, "b": "b", "c": ()})))
QuickDict = quick_init(dataclass(frozen=True)(type("QuickDict", (), {"__annotations__": {"a": int, "b": str}, "b": "b"})))


@pytest.mark.parametrize("quick,plain,args,kwargs", [
    (QuickSlots, _PlainSlots, (1,), {}),
    (QuickSlots, _PlainSlots, (1, "x", (2, 3)), {}),
    (QuickSlots, _PlainSlots, (), {"a": 4, "c": (5,)}),
    (QuickDict, _PlainDict, (1,), {}),
    (QuickDict, _PlainDict, (), {"b": "y", "a": 2}),
])
def test_quick_init_builds_what_the_dataclass_builds(quick: type, plain: type, args: tuple, kwargs: dict) -> None:
    q, p = quick(*args, **kwargs), plain(*args, **kwargs)
    assert dataclasses.astuple(q) == dataclasses.astuple(p)
    assert q == quick(*args, **kwargs) and hash(q) == hash(quick(*args, **kwargs))
    assert q != quick(99)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.a = 7
    assert q.a == dataclasses.astuple(p)[0]
    assert pickle.loads(pickle.dumps(q)) == q and copy.copy(q) == q
    assert dataclasses.replace(q, a=8).a == 8
    with pytest.raises(TypeError):
        quick(1, 2, 3, 4)  # more arguments than fields
    with pytest.raises(TypeError):
        quick(*args, nope=1, **kwargs)


def test_the_per_chunk_domain_types_use_it_and_stay_frozen_and_ordered() -> None:
    key = RoomKey(3)
    assert key == RoomKey(3, 0) and RoomKey(1) < RoomKey(1, 1) < RoomKey(2) and str(key) == "3.0"
    spec = ChunkSpec(key, 1, 0, 4, SlotRef(64, 128), True, b"aux")
    assert (spec.pages, spec.claim, spec.slot.length) == ((), 0, 128)
    ev = RoomEvent(key, RoomState.SUCCESS, landed=LandedChunk(1, SlotRef(0, 8), 0, 4, True, 8))
    assert ev.failure_reason == "" and ev.landed is not None and ev.landed.chunk_bytes == 8
    for obj, name in ((key, "id"), (spec, "chunk_id"), (ev, "state")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 5)
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_quick_init_refuses_what_it_cannot_build_the_same() -> None:
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            raise ValueError

    @dataclass(frozen=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    @dataclass(frozen=True)
    class Hidden:
        a: int = field(default=0, init=False)

    for cls in (Mutable, Checked, Factory, Hidden):
        with pytest.raises(TypeError):
            quick_init(cls)
