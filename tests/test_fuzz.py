"""Property-based bad input over every RPC of both services (Engine and Peer), against one
in-process daemon (serve() on its own uvloop thread, real NIXL agent).

Each Hypothesis example is one RPC with fields drawn to hit the edges: wrong sizes, offsets outside
rings, unknown or stale rooms and generations, duplicate chunks, chunks after the last, huge counts,
malformed CUDA IPC handles and NIXL metadata, a wrong layout for a registered group, senders that
are unknown, stale or forged. Interleaved with them, real rooms move bytes between two engines of
the same daemon (the same-node copy path), so bad input meets rooms that are mid-transfer.

Properties: every call ends in a clean gRPC status (never UNKNOWN/INTERNAL, never a hang, never
UNAVAILABLE from a daemon that is not draining); the daemon never dies; and no byte of the host
pool changes outside the decode rings' slots: guard patterns fill everything outside the rings
and the prefill rings (which the daemon only reads), and are checked at the end.

KVX_FUZZ_EXAMPLES scales the run (default 2,500 per test: 10,000 examples, ~14,000 RPCs).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer_client._requests import registration
from kvxfer_client._rings import receive_pool
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxfer_protocol.version import PROTOCOL_VERSION
from kvxferd.app import Ready, serve
from kvxferd.config import load_config

EXAMPLES = int(os.environ.get("KVX_FUZZ_EXAMPLES", "2500"))  # per test; 4 tests: 10,000 examples
CLEAN = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
}
LAYOUT = common_pb2.KVLayout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
TOKEN_BYTES = 2 * 2 * 2 * 16 * 2  # one TP-1 rank: heads x layers x K/V x head_dim x dtype
RING = 256 << 10
G_OUT, G_PRE, G_DEC = 0x5A, 0x3C, 0xC3  # outside the rings / prefill rings / decode rings
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1


# --------------------------------------------------------------------------- the daemon and a fake peer


class ThreadDaemon:
    """serve() on a uvloop in a thread: the daemon runs in this process, the test calls it over
    its real Unix socket and TCP peer port with blocking stubs."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        self.config = load_config(None, env={}, overrides=overrides)
        self.ready = threading.Event()
        self.info: Ready | None = None
        self.error: BaseException | None = None
        self.rc: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, name="fuzz-daemon", daemon=True)
        self.thread.start()
        if not self.ready.wait(60):
            raise AssertionError(f"daemon not ready: {self.error!r}")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        self._loop = loop
        try:
            self.rc = loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to the test, not swallowed
            self.error = exc
            self.ready.set()
        finally:
            loop.close()

    async def _main(self) -> int:
        self._stop = asyncio.Event()

        def ready(r: Ready) -> None:
            self.info = r
            self.ready.set()

        return await serve(self.config, self._stop, ready=ready)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(60)


class FakePeer(peer_pb2_grpc.PeerServicer):
    """A second "daemon" that answers the fuzzed daemon: handshakes with real NIXL metadata (an agent
    in this process) and keeps a control stream alive; it never answers a bootstrap, never writes."""

    def __init__(self) -> None:
        from kvxferd.transports.nixl import NixlTransport

        self.transport = NixlTransport(f"kvx-fuzzpeer-{os.getpid()}", progress_thread=False)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        peer_pb2_grpc.add_PeerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.ref = peer_pb2.DaemonRef(daemon_id="fuzzpeer", instance_id="fuzz-instance-1", address=self.address)
        self.server.start()

    def Heartbeat(self, request: Any, context: Any) -> peer_pb2.HeartbeatReply:
        return peer_pb2.HeartbeatReply(sender=self.ref)

    def Handshake(self, request: Any, context: Any) -> peer_pb2.HandshakeReply:
        return peer_pb2.HandshakeReply(sender=self.ref, agent_name=self.transport.name,
                                       nixl_metadata=self.transport.metadata(), version=PROTOCOL_VERSION)

    def Session(self, request_iterator: Any, context: Any) -> Iterator[peer_pb2.PeerBatch]:
        # Reads (and drops) what the daemon sends; a keep-alive batch every 0.3 s keeps it up.
        def drain() -> None:
            try:
                for _ in request_iterator:
                    pass
            except grpc.RpcError:
                pass  # the daemon closed or reset the stream: expected in a fuzz run

        threading.Thread(target=drain, daemon=True).start()
        while context.is_active():
            yield peer_pb2.PeerBatch()
            time.sleep(0.3)

    def close(self) -> None:
        self.server.stop(0)
        self.transport.close()


@dataclass
class World:
    daemon: ThreadDaemon
    peer: FakePeer
    engine: Any  # EngineStub
    peer_stub: Any  # PeerStub
    engines: dict[str, engine_pb2.RegisterEngineReply]
    pool: mmap.mmap
    own_address: str
    own_ref: peer_pb2.DaemonRef
    slots: list[tuple[str, common_pb2.Slot]] = field(default_factory=list)  # acquired, not enqueued
    cases: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    flow_room: int = 1_000_000

    def eid(self, ref: str) -> str:
        if ref in self.engines:
            return self.engines[ref].engine_id
        return {"UNKNOWN": "0" * 32, "EMPTY": ""}.get(ref, ref)

    def rings(self) -> list[tuple[str, int, int]]:
        return [(n, r.ring_offset, r.ring_bytes) for n, r in self.engines.items()]


WORLD_ENGINES = {
    # name: (role, group, tp_size, tp_rank)
    "P1": (engine_pb2.ROLE_PREFILL, "fp", 1, 0),
    "D1": (engine_pb2.ROLE_DECODE, "fd", 1, 0),
    "P2a": (engine_pb2.ROLE_PREFILL, "fp2", 2, 0),
    "P2b": (engine_pb2.ROLE_PREFILL, "fp2", 2, 1),
    "D2a": (engine_pb2.ROLE_DECODE, "fd2", 2, 0),
    "D2b": (engine_pb2.ROLE_DECODE, "fd2", 2, 1),
}
PREFILL = ["P1", "P2a", "P2b"]
DECODE = ["D1", "D2a", "D2b"]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    # Thousands of refused requests would each log a line; keep the run quiet and fast.
    logging.getLogger("kvxferd").setLevel(logging.ERROR)
    if os.environ.get("KVX_FUZZ_LOG"):  # debugging a failure: the daemon's log at INFO in a file
        h = logging.FileHandler(os.environ["KVX_FUZZ_LOG"])
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logging.getLogger("kvxferd").addHandler(h)
        logging.getLogger("kvxferd").setLevel(logging.INFO)
    short = Path("/tmp") / f"kvxfz-{os.getpid()}"  # Unix socket paths must stay short
    short.mkdir(exist_ok=True)
    daemon = ThreadDaemon({
        "socket": str(short / "d.sock"), "peer_listen": "127.0.0.1:0", "metrics_port": -1,
        "host_pool_bytes": "8MiB", "daemon_id": "fuzzd", "heartbeat_interval_s": 1.0, "engine_lease_s": 3600,
        "room_deadline_s": 5, "drain_grace_s": 1,
        # Unauthenticated on purpose: the fuzz reaches past the handshake (test_fuzz_peer fuzzes proofs).
        "insecure_peers": True,
    })
    peer = FakePeer()
    assert daemon.info is not None
    ech = grpc.insecure_channel(f"unix:{daemon.info.socket}")
    pch = grpc.insecure_channel(daemon.info.peer_address)
    engine = engine_pb2_grpc.EngineStub(ech)
    peer_stub = peer_pb2_grpc.PeerStub(pch)
    engines = {}
    for name, (role, group, tp, rank) in WORLD_ENGINES.items():
        engines[name] = engine.RegisterEngine(engine_pb2.RegisterEngineRequest(
            role=role, group=group, layout=LAYOUT, parallel=common_pb2.Parallelism(tp_size=tp, tp_rank=rank),
            ring_bytes=RING, name=f"fuzz-{name}",
        ), timeout=10)
    reg = engines["P1"]
    fd = receive_pool(registration(reg)) if reg.pool_socket else os.open(reg.pool_path, os.O_RDWR)
    try:
        pool = mmap.mmap(fd, reg.pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # The fuzz peer handshakes for real: Peer RPCs from it pass the sender checks.
    reply = peer_stub.Handshake(peer_pb2.HandshakeRequest(
        sender=peer.ref, agent_name=peer.transport.name, nixl_metadata=peer.transport.metadata(), version=PROTOCOL_VERSION,
    ), timeout=10)
    w = World(daemon, peer, engine, peer_stub, engines, pool, daemon.info.peer_address, reply.sender)
    paint(w)
    try:
        yield w
    finally:
        print(f"fuzz: {w.cases} cases; status codes: {dict(sorted(w.codes.items()))}")
        ech.close()
        pch.close()
        daemon.close()
        peer.close()
        pool.close()
        for f in short.iterdir():
            f.unlink()
        short.rmdir()


def paint(w: World) -> None:
    """Guard patterns: one byte value outside the rings, one in prefill rings, one in decode rings."""
    mv = memoryview(w.pool)
    mv[:] = bytes([G_OUT]) * len(mv)
    for name, off, size in w.rings():
        mv[off: off + size] = bytes([G_PRE if name in PREFILL else G_DEC]) * size
    mv.release()


def guard_violations(w: World) -> list[str]:
    data = bytes(w.pool)
    bad = []
    inside = sorted((off, off + size, name) for name, off, size in w.rings())
    pos = 0
    for start, end, name in [*inside, (len(data), len(data), "")]:
        gap = data[pos:start]
        if gap.count(G_OUT) != len(gap):
            first = next(i for i, b in enumerate(gap) if b != G_OUT)
            bad.append(f"byte {pos + first} outside every ring changed")
        if name:
            ring = data[start:end]
            if name in PREFILL and ring.count(G_PRE) != len(ring):
                bad.append(f"prefill ring {name} was written (the daemon only reads it)")
            if name in DECODE and ring.count(G_PRE) + ring.count(G_DEC) != len(ring):
                bad.append(f"decode ring {name} holds bytes no chunk carried")
        pos = end
    return bad


# --------------------------------------------------------------------------- strategies

u64 = st.one_of(st.integers(0, 4096), st.integers(0, U64), st.sampled_from([U64, 1 << 63, RING, RING - 1, 8 << 20]))
u32 = st.one_of(st.integers(0, 2048), st.integers(0, U32), st.sampled_from([U32, 1 << 24, (1 << 24) + 1]))
small_room = st.integers(0, 40)
room_key = st.builds(common_pb2.RoomKey, id=st.one_of(small_room, u64), generation=st.one_of(st.integers(0, 3), u64))
engine_ref = st.one_of(st.sampled_from([*PREFILL, *DECODE, "UNKNOWN", "EMPTY"]), st.text(max_size=40))
names = st.one_of(st.sampled_from(["fp", "fd", "fp2", "fd2", "nope", ""]), st.text(max_size=200))
# Only addresses that need no resolver: the daemon dials what it accepts.
addresses = st.sampled_from([
    "OWN", "PEER", "127.0.0.1:1", "127.0.0.1:0", "", "nocolon", ":", "127.0.0.1", "127.0.0.1:99999",
    "127.0.0.1:-1", "[::1]:1", "127.0.0.1:1:2",
])
layouts = st.one_of(
    st.just(LAYOUT),
    st.builds(common_pb2.KVLayout, num_layers=u32, total_kv_heads=u32, head_dim=u32, dtype_bytes=u32,
              page_size=u32, mla=st.booleans(), dtype=st.text(max_size=10)),
    st.builds(common_pb2.KVLayout, num_layers=st.integers(1, 4), total_kv_heads=st.integers(1, 8),
              head_dim=st.sampled_from([8, 16, 32]), dtype_bytes=st.sampled_from([1, 2, 4]), page_size=st.just(16),
              mla=st.booleans()),
)
slot_ref = st.one_of(
    st.just("TRACKED"), st.just("RING_END"), st.just("FAR"),
    st.builds(lambda o, n: (o, n), u64, u64),
)
aux = st.one_of(st.just(b""), st.binary(max_size=64), st.sampled_from([b"x" * (64 << 10), b"x" * ((64 << 10) + 1)]))
senders = st.one_of(
    st.sampled_from(["PEER", "PEER_STALE", "UNKNOWN", "SELF_OTHER", "NONE", "EMPTY_IDS"]),
    st.builds(lambda a, b: ("RANDOM", a, b), st.text(max_size=20), st.text(max_size=20)),
)


def resolve_address(w: World, a: str) -> str:
    return {"OWN": w.own_address, "PEER": w.peer.address}.get(a, a)


def sender_pb(w: World, s: Any, address: str = "PEER") -> peer_pb2.DaemonRef | None:
    addr = resolve_address(w, address)
    if s == "PEER":
        return peer_pb2.DaemonRef(daemon_id=w.peer.ref.daemon_id, instance_id=w.peer.ref.instance_id, address=addr)
    if s == "PEER_STALE":
        return peer_pb2.DaemonRef(daemon_id="fuzzpeer", instance_id="fuzz-instance-0", address=addr)
    if s == "UNKNOWN":
        return peer_pb2.DaemonRef(daemon_id="stranger", instance_id="s1", address=addr)
    if s == "SELF_OTHER":
        return peer_pb2.DaemonRef(daemon_id=w.own_ref.daemon_id, instance_id="not-me", address=addr)
    if s is None or s == "NONE":
        return None
    if s == "EMPTY_IDS":
        return peer_pb2.DaemonRef(address=addr)
    _, a, b = s
    return peer_pb2.DaemonRef(daemon_id=a, instance_id=b, address=addr)


def slot_pb(w: World, engine: str, ref: Any) -> common_pb2.Slot:
    if ref == "TRACKED":
        # A slot this engine acquired; forgotten here only once the daemon took it back.
        for e, s in w.slots:
            if e == engine:
                return s
        return common_pb2.Slot(offset=RING // 2 + 256, length=4096)
    if ref == "RING_END":
        return common_pb2.Slot(offset=RING, length=4096)
    if ref == "FAR":
        return common_pb2.Slot(offset=8 << 20, length=4096)
    return common_pb2.Slot(offset=ref[0], length=ref[1])


# Each op: (name, fields) -> run(world) -> status codes seen.
Op = tuple[str, dict[str, Any]]


def op(kind: str, /, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Op]:
    return st.fixed_dictionaries(fields).map(lambda f: (kind, f))


ENGINE_OPS = st.one_of(
    op("register", role=st.integers(-1, 3), group=st.one_of(st.just("fz"), st.text(max_size=140)), layout=layouts,
       tp=st.integers(0, 2000), rank=st.one_of(st.integers(0, 3), u32), pp=st.integers(0, 3), pp_rank=st.integers(0, 3),
       ring=u64, lease=u32, label=st.text(max_size=300),
       cuda=st.one_of(st.none(), st.tuples(st.binary(max_size=80), st.text(max_size=40), u64, u64))),
    op("register_wrong_layout", target=st.sampled_from(["fp", "fd2"]), layout=layouts, rank=st.integers(0, 1)),
    op("unregister", engine=st.one_of(st.sampled_from(["UNKNOWN", "EMPTY"]), st.text(max_size=40))),
    op("keepalive", engine=engine_ref),
    op("acquire", engine=engine_ref, tokens=u32),
    op("release_slot", engine=engine_ref, slot=slot_ref),
    op("expect", engine=engine_ref, room=room_key, address=addresses, group=names, tokens=u32, deadline=u32),
    op("enqueue", engine=engine_ref, room=room_key, chunk=st.one_of(st.integers(0, 8), u32), start=u32,
       tokens=st.one_of(st.integers(1, 64), u32), slot=slot_ref, last=st.booleans(), aux=aux,
       how=st.sampled_from(["unary", "batch", "stream"])),
    op("enqueue_many", n=st.sampled_from([0, 1, 2, 3, 4097, 4097, 4097, 4096])),
    op("poll", engine=engine_ref, room=st.one_of(st.none(), room_key)),
    op("abort", engine=engine_ref, room=st.one_of(st.none(), room_key), reason=st.text(max_size=2000)),
    op("release_room", engine=engine_ref, room=st.one_of(st.none(), room_key)),
    op("watermark", engine=engine_ref, room=st.one_of(st.none(), room_key),
       chunks=st.one_of(st.lists(st.integers(0, 10), max_size=5), st.lists(u32, max_size=5),
                        st.just(list(range(100_000))))),
    op("watch", engine=engine_ref),
    op("status"),
    op("flow", tokens=st.lists(st.integers(1, 48), min_size=1, max_size=3), abort=st.booleans()),
)

credit_ids = st.one_of(st.integers(0, 64), u64)
PEER_MSGS = st.one_of(
    st.builds(lambda room, group, reader, tp, lay, tokens, ring: peer_pb2.PeerMsg(bootstrap=peer_pb2.Bootstrap(
        room=room, prefill_group=group, reader_rank=reader, decode_tp=tp, layout=lay, num_tokens=tokens,
        reader_ring=ring)), room_key, names, u32, u32, layouts, u32, st.text(max_size=40)),
    st.builds(lambda room, reader, code, tp, lay: peer_pb2.PeerMsg(bootstrap_reply=peer_pb2.BootstrapReply(
        room=room, reader_rank=reader, code=code, prefill_tp=tp, layout=lay)),
        room_key, st.integers(0, 3), st.integers(-5, 20), u32, layouts),
    st.builds(lambda cid, ring, addr, n, mem: peer_pb2.PeerMsg(grant=peer_pb2.CreditGrant(credits=[peer_pb2.Credit(
        id=cid, ring=ring, address=addr, length=n, mem=mem)])), credit_ids, st.text(max_size=40), u64, u64,
        st.sampled_from(["DRAM", "VRAM", "", "HBM"])),
    st.builds(lambda ring, n: peer_pb2.PeerMsg(credit_request=peer_pb2.CreditRequest(ring=ring, bytes=n)),
              st.one_of(st.sampled_from(["D1", "D2a", "P1"]), st.text(max_size=40)), u64),
    st.builds(lambda ids: peer_pb2.PeerMsg(credit_return=peer_pb2.CreditReturn(ids=ids)), st.lists(credit_ids, max_size=8)),
    st.builds(lambda ids: peer_pb2.PeerMsg(revoke=peer_pb2.CreditRevoke(ids=ids)), st.lists(credit_ids, max_size=8)),
    st.builds(lambda ring: peer_pb2.PeerMsg(reclaim=peer_pb2.Reclaim(ring=ring)), st.text(max_size=40)),
    st.builds(lambda cid, off, rooms: peer_pb2.PeerMsg(release=peer_pb2.RangeRelease(
        ranges=[peer_pb2.Range(credit_id=cid, offset=off)], rooms=rooms)), credit_ids, u64,
        st.lists(room_key, max_size=3)),
    st.builds(lambda room, reader, n, a: peer_pb2.PeerMsg(complete=peer_pb2.Complete(
        room=room, reader_rank=reader, num_chunks=n, aux=a)), room_key, st.integers(0, 3), u32, aux),
    st.builds(lambda room, reader, code: peer_pb2.PeerMsg(complete_ack=peer_pb2.CompleteAck(
        room=room, reader_rank=reader, code=code)), room_key, st.integers(0, 3), st.integers(-3, 20)),
    st.builds(lambda room, code, reason, q: peer_pb2.PeerMsg(abort=peer_pb2.Abort(
        room=room, code=code, reason=reason, quiesced=q)),
        room_key, st.integers(-(1 << 31), (1 << 31) - 1), st.text(max_size=2000), st.booleans()),
    st.builds(lambda s_: peer_pb2.PeerMsg(hello=peer_pb2.Hello(sender=s_)), st.just(peer_pb2.DaemonRef())),
)

PEER_OPS = st.one_of(
    op("handshake", sender=senders, address=addresses, agent=st.text(max_size=40),
       md=st.one_of(st.sampled_from(["VALID", "VALID_TAIL", "EMPTY"]), st.binary(max_size=256))),
    # A control stream: its Hello names a sender (the handshaken fuzz peer, or a stranger), then
    # a batch of arbitrary messages that a hostile but authenticated peer could send.
    op("session", sender=senders, instance=st.sampled_from(["OWN", "OTHER", ""]), hello=st.booleans(),
       msgs=st.lists(PEER_MSGS, max_size=6)),
    op("heartbeat", sender=senders),
    # Decode rooms whose prefill side is the fuzz peer: stream messages from it then hit real rooms.
    op("expect_from_peer", engine=st.sampled_from(DECODE), room=st.integers(0, 40), tokens=st.integers(1, 256)),
)


# --------------------------------------------------------------------------- running ops


def code_of(fn: Callable[[], Any]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def settle_slot(w: World, engine: str, slot: common_pb2.Slot, code: grpc.StatusCode) -> None:
    """An accepted EnqueueChunk/ReleaseSlot hands the slot back to the daemon: stop tracking it."""
    if code == grpc.StatusCode.OK:
        w.slots[:] = [(e, s) for e, s in w.slots if not (e == engine and s.offset == slot.offset)]


def note(w: World, name: str, code: grpc.StatusCode) -> None:
    w.cases += 1
    key = f"{name}:{code.name}"
    w.codes[key] = w.codes.get(key, 0) + 1
    assert code in CLEAN, f"{name} answered {code.name}"


T = 5.0  # every call must answer well within this; DEADLINE_EXCEEDED means a hang


def run_engine_op(w: World, o: Op) -> None:
    name, f = o
    e = w.engine
    if name == "register":
        req = engine_pb2.RegisterEngineRequest(
            role=f["role"] if f["role"] >= 0 else 99, group=f["group"], layout=f["layout"],
            parallel=common_pb2.Parallelism(tp_size=f["tp"], tp_rank=f["rank"], pp_size=f["pp"], pp_rank=f["pp_rank"]),
            ring_bytes=f["ring"], lease_ms=f["lease"], name=f["label"],
        )
        if f["cuda"] is not None:
            h, dev, off, size = f["cuda"]
            req.cuda_ring.CopyFrom(engine_pb2.CudaIpcRing(handle=h, device_uuid=dev, offset=off, size=size))
        if f["group"] in ("fp", "fd", "fp2", "fd2"):
            req.group = "fz"  # never replace a world engine by re-registering its rank
        try:
            reply = e.RegisterEngine(req, timeout=T)
        except grpc.RpcError as exc:
            note(w, name, exc.code())
            return
        note(w, name, grpc.StatusCode.OK)
        # A new ring in the pool: it is outside the guarded rings, and the daemon never writes
        # a ring it only registered. Give it back so the pool does not fill up.
        e.UnregisterEngine(engine_pb2.UnregisterEngineRequest(engine_id=reply.engine_id), timeout=T)
    elif name == "register_wrong_layout":
        role = engine_pb2.ROLE_PREFILL if f["target"] == "fp" else engine_pb2.ROLE_DECODE
        tp = 1 if f["target"] == "fp" else 2
        lay = f["layout"]
        if lay == LAYOUT:
            lay = common_pb2.KVLayout(num_layers=3, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
        req = engine_pb2.RegisterEngineRequest(
            role=role, group=f["target"], layout=lay, parallel=common_pb2.Parallelism(tp_size=tp, tp_rank=f["rank"] % tp),
            ring_bytes=RING,
        )
        code = code_of(lambda: e.RegisterEngine(req, timeout=T))
        note(w, name, code)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"a {f['target']} rank with another layout: {code.name}"
    elif name == "unregister":
        note(w, name, code_of(lambda: e.UnregisterEngine(
            engine_pb2.UnregisterEngineRequest(engine_id=w.eid(f["engine"])), timeout=T)))
    elif name == "keepalive":
        note(w, name, code_of(lambda: e.KeepAlive(engine_pb2.KeepAliveRequest(engine_id=w.eid(f["engine"])), timeout=T)))
    elif name == "acquire":
        try:
            r = e.AcquireSlot(engine_pb2.AcquireSlotRequest(engine_id=w.eid(f["engine"]), num_tokens=f["tokens"]), timeout=T)
        except grpc.RpcError as exc:
            note(w, name, exc.code())
            return
        note(w, name, grpc.StatusCode.OK)
        w.slots.append((f["engine"], r.slot))
    elif name == "release_slot":
        slot = slot_pb(w, f["engine"], f["slot"])
        code = code_of(lambda: e.ReleaseSlot(engine_pb2.ReleaseSlotRequest(engine_id=w.eid(f["engine"]), slot=slot),
                                             timeout=T))
        note(w, name, code)
        settle_slot(w, f["engine"], slot, code)
    elif name == "expect":
        note(w, name, code_of(lambda: e.ExpectRoom(engine_pb2.ExpectRoomRequest(
            engine_id=w.eid(f["engine"]), room=f["room"], prefill_address=resolve_address(w, f["address"]),
            prefill_group=f["group"], num_tokens=f["tokens"], deadline_ms=f["deadline"]), timeout=T)))
    elif name == "enqueue":
        req = engine_pb2.EnqueueChunkRequest(
            engine_id=w.eid(f["engine"]), room=f["room"], chunk_id=f["chunk"], token_start=f["start"],
            num_tokens=f["tokens"], slot=slot_pb(w, f["engine"], f["slot"]), last=f["last"], aux=f["aux"],
        )
        if f["how"] == "unary":
            code = code_of(lambda: e.EnqueueChunk(req, timeout=T))
            note(w, name, code)
            settle_slot(w, f["engine"], req.slot, code)
        elif f["how"] == "batch":
            try:
                reply = e.EnqueueChunks(engine_pb2.EnqueueChunksRequest(chunks=[req, req]), timeout=T)
            except grpc.RpcError as exc:
                note(w, name, exc.code())
                return
            note(w, name, grpc.StatusCode.OK)
            for res in reply.results:
                note(w, "enqueue_batch_item", _status(res.code))
                settle_slot(w, f["engine"], req.slot, _status(res.code))
            # The same chunk twice in one batch can never be accepted twice.
            assert not (reply.results[0].code == 0 and reply.results[1].code == 0), "duplicate chunk accepted"
        else:
            try:
                replies = list(e.EnqueueStream(iter([req, req]), timeout=T))
            except grpc.RpcError as exc:
                note(w, name, exc.code())
                return
            note(w, name, grpc.StatusCode.OK)
            assert len(replies) == 2
            for res in replies:
                note(w, "enqueue_stream_item", _status(res.code))
                settle_slot(w, f["engine"], req.slot, _status(res.code))
            assert not (replies[0].code == 0 and replies[1].code == 0), "duplicate chunk accepted"
    elif name == "enqueue_many":
        req = engine_pb2.EnqueueChunkRequest(engine_id=w.eid("P1"), room=common_pb2.RoomKey(id=7), num_tokens=1,
                                             slot=common_pb2.Slot(offset=RING + 512, length=256))
        code = code_of(lambda: e.EnqueueChunks(engine_pb2.EnqueueChunksRequest(chunks=[req] * f["n"]), timeout=T))
        note(w, name, code)
        if f["n"] > 4096:
            assert code == grpc.StatusCode.INVALID_ARGUMENT
    elif name in ("poll", "abort", "release_room"):
        kw: dict[str, Any] = {"engine_id": w.eid(f["engine"])}
        if f["room"] is not None:
            kw["room"] = f["room"]
        if name == "poll":
            note(w, name, code_of(lambda: e.PollRoom(engine_pb2.PollRoomRequest(**kw), timeout=T)))
        elif name == "abort":
            note(w, name, code_of(lambda: e.AbortRoom(engine_pb2.AbortRoomRequest(reason=f["reason"], **kw), timeout=T)))
        else:
            note(w, name, code_of(lambda: e.ReleaseRoom(engine_pb2.ReleaseRoomRequest(**kw), timeout=T)))
    elif name == "watermark":
        kw = {"engine_id": w.eid(f["engine"]), "chunk_ids": f["chunks"]}
        if f["room"] is not None:
            kw["room"] = f["room"]
        note(w, name, code_of(lambda: e.Watermark(engine_pb2.WatermarkRequest(**kw), timeout=T)))
    elif name == "watch":
        call = e.WatchRooms(engine_pb2.WatchRoomsRequest(engine_id=w.eid(f["engine"])), timeout=0.01)
        code = code_of(lambda: list(call))
        # A live stream ends by our short deadline; anything else must be a clean refusal.
        note(w, name, grpc.StatusCode.OK if code == grpc.StatusCode.DEADLINE_EXCEEDED else code)
    elif name == "status":
        note(w, name, code_of(lambda: e.GetStatus(engine_pb2.GetStatusRequest(), timeout=T)))
    elif name == "flow":
        flow(w, f["tokens"], f["abort"])
    else:  # pragma: no cover - a strategy without a runner is a test bug
        raise AssertionError(name)


def _status(code: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)


def flow(w: World, tokens: list[int], abort: bool) -> None:
    """A real room on this daemon (prefill P1 -> decode D1, same-node copy): bad input meets
    rooms that are moving bytes. Not waited for; later ops poll, watermark and release them."""
    e = w.engine
    w.flow_room += 1
    room = common_pb2.RoomKey(id=w.flow_room % 41)  # the ids the other ops aim at
    code = code_of(lambda: e.ExpectRoom(engine_pb2.ExpectRoomRequest(
        engine_id=w.eid("D1"), room=room, prefill_address=w.own_address, prefill_group="fp",
        num_tokens=sum(tokens)), timeout=T))
    note(w, "flow_expect", code)
    start = 0
    for i, n in enumerate(tokens):
        try:
            r = e.AcquireSlot(engine_pb2.AcquireSlotRequest(engine_id=w.eid("P1"), num_tokens=n), timeout=T)
        except grpc.RpcError as exc:
            note(w, "flow_acquire", exc.code())
            return
        code = code_of(lambda r=r, i=i, n=n, start=start: e.EnqueueChunk(engine_pb2.EnqueueChunkRequest(
            engine_id=w.eid("P1"), room=room, chunk_id=i, token_start=start, num_tokens=n, slot=r.slot,
            last=i == len(tokens) - 1), timeout=T))
        note(w, "flow_enqueue", code)
        if code != grpc.StatusCode.OK:
            note(w, "flow_release", code_of(lambda r=r: e.ReleaseSlot(
                engine_pb2.ReleaseSlotRequest(engine_id=w.eid("P1"), slot=r.slot), timeout=T)))
            return
        start += n
    if abort:
        note(w, "flow_abort", code_of(lambda: e.AbortRoom(
            engine_pb2.AbortRoomRequest(engine_id=w.eid("D1"), room=room), timeout=T)))


def run_peer_op(w: World, o: Op) -> None:
    name, f = o
    p = w.peer_stub
    sender = sender_pb(w, f.get("sender"), f.get("address", "PEER"))
    kw: dict[str, Any] = {} if sender is None else {"sender": sender}
    if name == "handshake":
        md = {"VALID": w.peer.transport.metadata(), "VALID_TAIL": w.peer.transport.metadata() + b"\0tail",
              "EMPTY": b""}.get(f["md"], f["md"]) if isinstance(f["md"], str) else f["md"]
        code = code_of(lambda: p.Handshake(peer_pb2.HandshakeRequest(
            agent_name=f["agent"], nixl_metadata=md, version=PROTOCOL_VERSION, **kw), timeout=T))
        note(w, name, code)
        if f["address"] not in ("OWN", "PEER", "127.0.0.1:1", "127.0.0.1:0", "[::1]:1"):
            assert code != grpc.StatusCode.OK, f"handshake from address {f['address']!r} accepted"
    elif name == "session":
        inst = {"OWN": w.own_ref.instance_id, "OTHER": "not-this-instance", "": ""}[f["instance"]]
        first = [peer_pb2.PeerMsg(hello=peer_pb2.Hello(peer_instance_id=inst, **kw))] if f["hello"] else []
        batches = [peer_pb2.PeerBatch(msgs=first), peer_pb2.PeerBatch(msgs=f["msgs"])]
        code = code_of(lambda: list(p.Session(iter(batches), timeout=T)))
        note(w, name, code)
        # Handshakes are not authenticated yet (any daemon may handshake, the fuzz's own handshake
        # ops included), so only streams that cannot match any completed handshake must be refused.
        unmatched = not f["hello"] or f["instance"] != "OWN" or f["sender"] in ("NONE", "EMPTY_IDS", "SELF_OTHER")
        if unmatched:
            assert code != grpc.StatusCode.OK, "a stream without a matching handshake was accepted"
    elif name == "heartbeat":
        note(w, name, code_of(lambda: p.Heartbeat(peer_pb2.HeartbeatRequest(**kw), timeout=T)))
    elif name == "expect_from_peer":
        note(w, name, code_of(lambda: w.engine.ExpectRoom(engine_pb2.ExpectRoomRequest(
            engine_id=w.eid(f["engine"]), room=common_pb2.RoomKey(id=f["room"]), prefill_address=w.peer.address,
            prefill_group="fuzz-pre", num_tokens=f["tokens"]), timeout=T)))
    else:  # pragma: no cover
        raise AssertionError(name)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(o=ENGINE_OPS)
def test_engine_rpcs_answer_cleanly(world: World, o: Op) -> None:
    run_engine_op(world, o)


@FUZZ
@given(o=PEER_OPS)
def test_peer_rpcs_answer_cleanly(world: World, o: Op) -> None:
    run_peer_op(world, o)


@FUZZ
@given(ops=st.lists(st.one_of(ENGINE_OPS, PEER_OPS), min_size=1, max_size=2))
def test_mixed_sequences_answer_cleanly(world: World, ops: list[Op]) -> None:
    for o in ops:
        (run_engine_op if o[0] in ENGINE_NAMES else run_peer_op)(world, o)


ENGINE_NAMES = {
    "register", "register_wrong_layout", "unregister", "keepalive", "acquire", "release_slot", "expect", "enqueue",
    "enqueue_many", "poll", "abort", "release_room", "watermark", "watch", "status", "flow",
}


@FUZZ
@given(o=st.one_of(op("flow", tokens=st.lists(st.integers(1, 48), min_size=1, max_size=3), abort=st.booleans()),
                   ENGINE_OPS))
def test_rooms_in_flight_meet_bad_input(world: World, o: Op) -> None:
    run_engine_op(world, o)


def test_after_the_fuzz_nothing_leaked_nothing_written(world: World) -> None:
    """Runs last in this module: the daemon is alive, a clean room still works, every slot can
    be reclaimed, and the guard bytes outside the decode rings' slots are untouched."""
    w = world
    assert w.daemon.alive, repr(w.daemon.error)
    assert w.cases >= 4 * EXAMPLES, w.cases
    e = w.engine
    # Give back the slots the fuzz still holds, then let every room end (deadline 5 s) and go.
    for eng, slot in list(w.slots):
        e.ReleaseSlot(engine_pb2.ReleaseSlotRequest(engine_id=w.eid(eng), slot=slot), timeout=T)
    w.slots.clear()
    for rid in range(41):
        for eng in [*PREFILL, *DECODE]:
            for gen in range(4):
                code_of(lambda eng=eng, rid=rid, gen=gen: e.ReleaseRoom(engine_pb2.ReleaseRoomRequest(
                    engine_id=w.eid(eng), room=common_pb2.RoomKey(id=rid, generation=gen)), timeout=T))
    # A clean room end to end, bytes checked.
    room = common_pb2.RoomKey(id=999_999)
    e.ExpectRoom(engine_pb2.ExpectRoomRequest(engine_id=w.eid("D1"), room=room, prefill_address=w.own_address,
                                              prefill_group="fp", num_tokens=16), timeout=T)
    r = e.AcquireSlot(engine_pb2.AcquireSlotRequest(engine_id=w.eid("P1"), num_tokens=16), timeout=T)
    e.EnqueueChunk(engine_pb2.EnqueueChunkRequest(engine_id=w.eid("P1"), room=room, chunk_id=0, num_tokens=16,
                                                  slot=r.slot, last=True, aux=b"end"), timeout=T)
    deadline = time.monotonic() + 20
    while True:
        st_ = e.PollRoom(engine_pb2.PollRoomRequest(engine_id=w.eid("D1"), room=room), timeout=T)
        if st_.state == common_pb2.ROOM_STATE_SUCCESS:
            break
        assert st_.state != common_pb2.ROOM_STATE_FAILED, st_.failure_reason
        assert time.monotonic() < deadline, "the clean room did not finish"
        time.sleep(0.01)
    (c,) = st_.landed
    d1 = w.engines["D1"]
    got = bytes(w.pool[d1.ring_offset + c.slot.offset: d1.ring_offset + c.slot.offset + c.chunk_bytes])
    assert got == bytes([G_PRE]) * 16 * TOKEN_BYTES and st_.aux == b"end"
    e.Watermark(engine_pb2.WatermarkRequest(engine_id=w.eid("D1"), room=room, chunk_ids=[0]), timeout=T)
    e.ReleaseRoom(engine_pb2.ReleaseRoomRequest(engine_id=w.eid("D1"), room=room), timeout=T)
    e.ReleaseRoom(engine_pb2.ReleaseRoomRequest(engine_id=w.eid("P1"), room=room), timeout=T)
    # Every slot comes back: rooms end by their deadline (5 s here), and the credits granted to the
    # fuzz peer once it gives them back (it never wrote into them). It handshakes again first: the
    # hostile streams may have left it lost. (A hostile handshake may also have bound its address to
    # another daemon id that is still up; then this is refused, and the revoked credits come back by
    # their quarantine, inside the wait below.)
    code_of(lambda: w.peer_stub.Handshake(peer_pb2.HandshakeRequest(
        sender=w.peer.ref, agent_name=w.peer.transport.name, nixl_metadata=w.peer.transport.metadata(),
        version=PROTOCOL_VERSION), timeout=T))
    hello = peer_pb2.PeerMsg(hello=peer_pb2.Hello(sender=w.peer.ref, peer_instance_id=w.own_ref.instance_id))
    give_back = peer_pb2.PeerMsg(credit_return=peer_pb2.CreditReturn(ids=list(range(1, 20_000))))
    code_of(lambda: list(w.peer_stub.Session(iter([peer_pb2.PeerBatch(msgs=[hello, give_back])]), timeout=T)))
    held = -1
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        held = e.GetStatus(engine_pb2.GetStatusRequest(), timeout=T).slots_held
        if held == 0:
            break
        time.sleep(0.2)
    if held:
        st_ = e.GetStatus(engine_pb2.GetStatusRequest(), timeout=T)
        per = {e_.name: (e_.slots_held, e_.ring_used_bytes) for e_ in st_.engines}
        raise AssertionError(f"{held} slots still held after the fuzz: {per}, rooms {dict(st_.rooms_by_state)}")
    bad = guard_violations(w)
    assert not bad, bad
    assert w.daemon.alive
