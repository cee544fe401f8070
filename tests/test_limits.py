"""Caps on what engines can make a daemon hold (issue #14, engine side): every cap refuses with
RESOURCE_EXHAUSTED naming itself and its config key, a caller at its cap changes nothing for the
others (their rooms still move byte-exact), every cap's figure is in GetStatus, `kvxferd status`
and /metrics, and names from callers are length-checked with INVALID_ARGUMENT.

One daemon pair, started once for the module, with small caps.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvxfer_client import DecodeReceiver, KvxferError, Layout, PrefillSender
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from kvxferd.config import Config
from kvxferd.core.caps import Limits
from kvxferd.core.room_events import EventHub
from kvxferd.core.types import RoomEvent, RoomKey, RoomState
from kvxferd.errors import CapExceeded
from tests.conftest import ROOT, DaemonProc, daemon_env, spawn_daemon, stop_all, wait_ready
from tests.faults.harness import status, wait_until

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
TOKEN = 2 * 2 * 2 * 16 * 2  # bytes per token of a TP-1 rank
RE = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class Pair:
    pre: DaemonProc
    dec: DaemonProc


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    wd = Path(tempfile.mkdtemp(prefix="kvxl-"))
    pre = spawn_daemon(wd, "pre", "--set", "max_rooms_per_engine=4", "--set", "max_engines=4",
                       "--set", "max_watchers_per_engine=2", "--set", "max_streams_per_engine=2",
                       "--set", "max_open_streams=6", "--set", "max_rooms_per_peer=3", wait=False)
    dec = spawn_daemon(wd, "dec", "--set", "max_rooms_per_engine=4", "--set", "max_rooms_per_peer=6", wait=False)
    try:
        wait_ready(pre)
        wait_ready(dec)
        yield Pair(pre, dec)
    finally:
        stop_all(pre, dec)
        shutil.rmtree(wd, ignore_errors=True)


def caps(d: DaemonProc) -> dict[str, tuple[int, int]]:
    return {c.name: (c.used, c.limit) for c in status(d.socket).caps}


def refused(exc: KvxferError | grpc.RpcError, cap: str) -> None:
    code = exc.code() if isinstance(exc, grpc.RpcError) else exc.code
    text = exc.details() if isinstance(exc, grpc.RpcError) else exc.message
    assert code == RE, exc
    assert f"{cap} cap reached" in text and f"config max_{cap}" in text, text


def move_room(tx: PrefillSender, rx: DecodeReceiver, pre: DaemonProc, room: int, group: str) -> None:
    """One two-chunk room, every byte checked on the decode side."""
    data = [bytes([(room * 7 + i) % 251 + 1]) * (16 * TOKEN) for i in range(2)]
    rx.expect(room, pre.peer_address, group, 32)
    for i, chunk in enumerate(data):
        tx.send_chunk(room, i, 16 * i, 16, chunk, last=i == 1, aux=b"ok" if i == 1 else b"")
    got, st = rx.receive(room, timeout=30)
    assert [got[0], got[1]] == data and st.aux == b"ok"
    tx.wait(room, timeout=10)
    rx.release(room)
    tx.release(room)


def test_an_engine_at_its_room_cap_is_refused_and_other_engines_still_move_bytes(pair: Pair) -> None:
    pre, dec = pair.pre, pair.dec
    with DecodeReceiver(socket=dec.socket, group="capped", layout=LAYOUT, ring_bytes=1 << 20) as full, \
            DecodeReceiver(socket=dec.socket, group="free", layout=LAYOUT, ring_bytes=1 << 20) as rx, \
            PrefillSender(socket=pre.socket, group="pfull", layout=LAYOUT, ring_bytes=1 << 20) as pfull, \
            PrefillSender(socket=pre.socket, group="src", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        # Decode side: 4 rooms expected from a group that never sends; the 5th is refused.
        for room in range(100, 104):
            full.expect(room, pre.peer_address, "never", 16, deadline_ms=60_000)
        with pytest.raises(KvxferError) as ei:
            full.expect(104, pre.peer_address, "never", 16, deadline_ms=60_000)
        refused(ei.value, "rooms_per_engine")
        assert caps(dec)["rooms_per_engine"] == (4, 4)
        # Prefill side: chunks parked in 4 rooms nobody expects; a 5th room is refused, its slot
        # still ours to release.
        for room in range(200, 204):
            pfull.send_chunk(room, 0, 0, 16, b"\1" * (16 * TOKEN), last=True)
        slot = pfull.acquire(16)
        with pytest.raises(KvxferError) as ei:
            pfull.enqueue(204, 0, 0, 16, slot, last=True)
        refused(ei.value, "rooms_per_engine")
        pfull.release_slot(slot)
        # Both capped engines are stuck at their cap; another engine pair is not affected at all.
        for room in (1, 2, 3):
            move_room(tx, rx, pre, room, "src")
        # The cap counts rooms held: released ones make room again.
        full.release(100)
        full.expect(104, pre.peer_address, "never", 16, deadline_ms=60_000)
        pfull.release(200)
        pfull.send_chunk(204, 0, 0, 16, b"\1" * (16 * TOKEN), last=True)
        wait_until(lambda: metric_sample(dec, "kvxferd_cap_used", "rooms_per_engine") == 4, 5, "the gauge")
        assert metric_sample(dec, "kvxferd_cap_limit", "rooms_per_engine") == 4
        for room in range(101, 105):  # rooms of a gone engine would stay (counted) until collected
            full.release(room)
            pfull.release(room + 100)
    wait_until(lambda: caps(dec)["rooms_per_engine"][0] == 0 and caps(pre)["rooms_per_engine"][0] == 0, 10,
               "engines gone, rooms forgotten")


def metric_sample(d: DaemonProc, name: str, cap: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf'^{name}{{cap="{cap}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else -1.0


def test_rooms_per_peer_cap_counts_rooms_of_one_prefill_daemon(pair: Pair) -> None:
    pre, dec = pair.pre, pair.dec
    dead = "127.0.0.1:9"  # nothing listens: these rooms fail PEER_LOST, and stay held until released
    with DecodeReceiver(socket=dec.socket, group="p1", layout=LAYOUT, ring_bytes=1 << 20) as a, \
            DecodeReceiver(socket=dec.socket, group="p2", layout=LAYOUT, ring_bytes=1 << 20) as b, \
            DecodeReceiver(socket=dec.socket, group="p3", layout=LAYOUT, ring_bytes=1 << 20) as rx, \
            PrefillSender(socket=pre.socket, group="src", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        for room in range(300, 304):
            a.expect(room, dead, "g", 16)
        for room in range(304, 306):
            b.expect(room, dead, "g", 16)
        with pytest.raises(KvxferError) as ei:
            b.expect(306, dead, "g", 16)
        refused(ei.value, "rooms_per_peer")
        assert dead in ei.value.message
        assert caps(dec)["rooms_per_peer"] == (6, 6)
        move_room(tx, rx, pre, 7, "src")  # another peer: unaffected
        a.release(300)
        b.expect(306, dead, "g", 16)


def test_the_prefill_side_counts_rooms_per_bootstrapping_peer(pair: Pair) -> None:
    pre, dec = pair.pre, pair.dec
    with DecodeReceiver(socket=dec.socket, group="q1", layout=LAYOUT, ring_bytes=1 << 20) as a, \
            DecodeReceiver(socket=dec.socket, group="q2", layout=LAYOUT, ring_bytes=1 << 20) as b, \
            PrefillSender(socket=pre.socket, group="src", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        for room in (500, 501, 502):
            a.expect(room, pre.peer_address, "src", 16)
        wait_until(lambda: caps(pre)["rooms_per_peer"][0] == 3, 10, "three rooms bootstrapped on the prefill side")
        b.expect(503, pre.peer_address, "src", 16)  # the prefill daemon refuses its bootstrap
        st = wait_failed(b, 503)
        assert "rooms_per_peer cap reached" in st.failure_reason and "config max_rooms_per_peer" in st.failure_reason
        assert caps(pre)["rooms_per_peer"] == (3, 3)
        # The rooms already bootstrapped still complete, byte-exact.
        data = b"\x42" * (16 * TOKEN)
        tx.send_chunk(500, 0, 0, 16, data, last=True)
        got, _ = a.receive(500, timeout=30)
        assert got[0] == data
        tx.wait(500, timeout=10)
        for room in (500, 501, 502):
            a.release(room)
            tx.release(room)
        b.release(503)
        wait_until(lambda: caps(pre)["rooms_per_peer"][0] == 0, 10, "the count to go back to 0")


def wait_failed(rx: DecodeReceiver, room: int) -> Any:
    wait_until(lambda: rx.poll(room).state.name == "FAILED", 10, f"room {room} to fail")
    return rx.poll(room)


def test_engines_per_daemon_cap_and_re_registration_at_the_cap(pair: Pair) -> None:
    pre = pair.pre
    held: list[PrefillSender] = []
    assert not status(pre.socket).engines
    try:
        with pytest.raises(KvxferError) as ei:
            for i in range(10):
                held.append(PrefillSender(socket=pre.socket, group=f"e{i}", layout=LAYOUT, ring_bytes=1 << 20))
        refused(ei.value, "engines")
        assert len(held) == 4
        assert caps(pre)["engines"] == (4, 4)
        # A restarted rank (same group and rank) replaces its old registration even at the cap.
        again = PrefillSender(socket=pre.socket, group="e0", layout=LAYOUT, ring_bytes=1 << 20)
        held.append(again)
        assert caps(pre)["engines"] == (4, 4)
    finally:
        for e in held:
            e.close()
    assert caps(pre)["engines"][0] == 0


class RequestFeed:
    """Requests for a bidi stream, fed from the test thread."""

    def __init__(self) -> None:
        self.q: queue.Queue[Any] = queue.Queue()

    def __iter__(self) -> Iterator[Any]:
        while (item := self.q.get()) is not None:
            yield item


def test_stream_and_watcher_caps(pair: Pair) -> None:
    pre = pair.pre
    ch = grpc.insecure_channel(f"unix:{pre.socket}")
    stub = engine_pb2_grpc.EngineStub(ch)
    calls: list[Any] = []
    feeds: list[RequestFeed] = []
    try:
        with PrefillSender(socket=pre.socket, group="s1", layout=LAYOUT, ring_bytes=1 << 20) as e1, \
                PrefillSender(socket=pre.socket, group="s2", layout=LAYOUT, ring_bytes=1 << 20) as e2:
            def opened(n: int) -> None:
                wait_until(lambda: caps(pre)["open_streams"][0] == n, 10, f"{n} streams open")

            for _ in range(2):
                calls.append(stub.WatchRooms(engine_pb2.WatchRoomsRequest(engine_id=e1.engine_id)))
            opened(2)
            third = stub.WatchRooms(engine_pb2.WatchRoomsRequest(engine_id=e1.engine_id))
            with pytest.raises(grpc.RpcError) as ei:
                next(third)
            refused(ei.value, "watchers_per_engine")
            calls.append(stub.WatchRooms(engine_pb2.WatchRoomsRequest(engine_id=e2.engine_id)))
            opened(3)  # another engine's watcher is not affected
            assert caps(pre)["watchers_per_engine"] == (2, 2)
            # Idle EnqueueStream streams (no request yet) count against open_streams.
            for _ in range(3):
                feed = RequestFeed()
                feeds.append(feed)
                calls.append(stub.EnqueueStream(iter(feed)))
            opened(6)
            extra = stub.EnqueueStream(iter(RequestFeed()))
            with pytest.raises(grpc.RpcError) as ei:
                next(extra)
            refused(ei.value, "open_streams")
            # Streams naming one engine: the third is refused per request; other engines still go.
            bad_chunk = engine_pb2.EnqueueChunkRequest(engine_id=e1.engine_id, room=common_pb2.RoomKey(id=9),
                                                       num_tokens=1, slot=common_pb2.Slot(offset=1 << 40))
            codes = []
            for call, feed in zip(calls[3:], feeds, strict=True):
                feed.q.put(bad_chunk)
                codes.append(next(call).code)
            assert codes[:2] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 2, codes  # judged on content
            assert codes[2] == RE.value[0], codes
            feeds[2].q.put(engine_pb2.EnqueueChunkRequest(
                engine_id=e2.engine_id, room=common_pb2.RoomKey(id=9), num_tokens=1,
                slot=common_pb2.Slot(offset=1 << 40)))
            assert next(calls[5]).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert caps(pre)["streams_per_engine"] == (2, 2)
            # Closing streams gives their counts back.
            for feed in feeds:
                feed.q.put(None)
            for c in calls:
                c.cancel()
            opened(0)
            assert caps(pre)["streams_per_engine"][0] == 0
            assert caps(pre)["watchers_per_engine"][0] == 0
    finally:
        for feed in feeds:
            feed.q.put(None)
        for c in calls:
            c.cancel()
        ch.close()


def test_names_from_callers_are_length_checked(pair: Pair) -> None:
    pre, dec = pair.pre, pair.dec
    with grpc.insecure_channel(f"unix:{dec.socket}") as ch:
        stub = engine_pb2_grpc.EngineStub(ch)

        def invalid(call: Any, req: Any, field: str) -> None:
            with pytest.raises(grpc.RpcError) as ei:
                call(req, timeout=5)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
            assert field in ei.value.details() and "x" * 100 not in ei.value.details()

        base = {"role": engine_pb2.ROLE_DECODE, "layout": LAYOUT.to_pb(),
                "parallel": common_pb2.Parallelism(tp_size=1), "ring_bytes": 1 << 20}
        invalid(stub.RegisterEngine, engine_pb2.RegisterEngineRequest(group="x" * 129, **base), "group")
        invalid(stub.RegisterEngine, engine_pb2.RegisterEngineRequest(group="g", name="x" * 257, **base), "name")
        invalid(stub.RegisterEngine, engine_pb2.RegisterEngineRequest(group="g", registration_id="x" * 65, **base),
                "registration_id")
        invalid(stub.RegisterEngine, engine_pb2.RegisterEngineRequest(
            group="g", cuda_ring=engine_pb2.CudaIpcRing(handle=b"\0" * 64, device_uuid="x" * 200, size=1), **base),
            "device_uuid")
        invalid(stub.KeepAlive, engine_pb2.KeepAliveRequest(engine_id="x" * (1 << 20)), "engine_id")
        with DecodeReceiver(socket=dec.socket, group="len", layout=LAYOUT, ring_bytes=1 << 20) as rx:
            long_host = "x" * 300 + ":1"
            for addr, group, field in ((long_host, "g", "prefill_address"), (pre.peer_address, "x" * 129,
                                                                             "prefill_group")):
                invalid(stub.ExpectRoom, engine_pb2.ExpectRoomRequest(
                    engine_id=rx.engine_id, room=common_pb2.RoomKey(id=1), prefill_address=addr,
                    prefill_group=group, num_tokens=16), field)
            assert caps(dec)["rooms_per_engine"][0] == 0
    assert dec.proc.poll() is None


def test_status_cli_prints_every_cap(pair: Pair) -> None:
    out = subprocess.run([sys.executable, "-m", "kvxferd", "status", "--socket", pair.pre.socket, "--json"],
                         capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = {c["name"]: (int(c["used"]), int(c["limit"])) for c in json.loads(out.stdout)["caps"]}
    assert got["engines"][1] == 4 and got["rooms_per_engine"][1] == 4 and got["open_streams"][1] == 6
    assert set(got) == {"engines", "rooms_per_engine", "rooms_per_peer", "open_streams", "watchers_per_engine",
                        "streams_per_engine", "watch_backlog", "tombstones"}
    table = subprocess.run([sys.executable, "-m", "kvxferd", "status", "--socket", pair.pre.socket],
                           capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert table.returncode == 0 and "rooms_per_engine" in table.stdout and "caps" in table.stdout


def test_a_watcher_that_stops_reading_is_cut_off_alone() -> None:
    """The watch backlog (events a WatchRooms reader has not taken) is capped per stream: the slow
    stream ends with RESOURCE_EXHAUSTED, the engine's other watcher keeps every event."""
    eng = SimpleNamespace(id="e1", watchers=set(), progress_watchers=set(), layer_watchers=set())
    table = SimpleNamespace(limits=Limits(Config(max_watch_backlog=16, max_watchers_per_engine=2)),
                            engines={"e1": eng}, get=lambda engine_id: eng)
    hub = EventHub(table)  # type: ignore[arg-type]
    slow, fast = hub.watch("e1"), hub.watch("e1")
    with pytest.raises(CapExceeded, match=r"watchers_per_engine cap reached.*config max_watchers_per_engine"):
        hub.watch("e1")
    for i in range(40):
        hub.publish(eng, RoomEvent(RoomKey(i), RoomState.TRANSFERRING))  # type: ignore[arg-type]
        while fast.qsize():
            fast.get_nowait()
    got = [slow.get_nowait() for _ in range(slow.qsize())]
    assert len(got) == 17 and isinstance(got[-1], CapExceeded) and "config max_watch_backlog" in str(got[-1])
    assert eng.watchers == {fast} and hub.backlog() == 0
