"""Property-based attacks on the peer side of a daemon in shared-secret mode, from two kinds of
peers (real subprocess daemons, real gRPC and NIXL over loopback):

- an unauthenticated one: handshakes, Session streams and heartbeats with random, forged, stale
  or missing proofs, random and real daemon ids (the legit peer's included), random metadata;
- an authenticated but hostile one: it holds the secret and a real NIXL agent, completes real
  handshakes, then sends arbitrary PeerMsgs on its Session: bootstraps, completes, aborts and
  releases for the legit peer's room, grants with wild addresses and lengths, credit returns and
  revokes for credits it does not hold, huge or duplicate ids, wrong generations, Hellos mid-stream,
  batches over the cap.

Every example runs while a real room between the two real daemons is in flight (one chunk landed,
the last one not sent). Invariants after each: every answer is a clean status; the daemon is alive
and its health service answers SERVING; every peer cap's use is within its limit; no forged message
made the legit room finish (SUCCESS or FAILED); once the last chunk is sent the room is byte-exact.

KVX_FUZZ_EXAMPLES scales both properties (default 150 hostile-peer and 300 unauthenticated examples).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer_client import DecodeReceiver, Layout, PrefillSender, RoomState
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, peer_pb2
from kvxferd.core.types import DaemonRef
from kvxferd.peer.auth import Proof
from tests.conftest import DaemonProc, spawn_daemon, wait_ready
from tests.peer_client import Client, caps, closed_port, code_of, secret_file, status

BASE = int(os.environ.get("KVX_FUZZ_EXAMPLES", "150"))
CLEAN = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
}
LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
CHUNK = 16 * 256
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1
T = 10.0


@dataclass
class World:
    d: DaemonProc  # the daemon under attack (decode side of the legit room)
    p: DaemonProc  # the legit peer (prefill side)
    agent: Any
    hostile: Client
    stranger: Client  # no secret
    liar: Client  # another secret
    rx: DecodeReceiver
    tx: PrefillSender
    d_prefill: PrefillSender  # a prefill engine on d, for the hostile peer's bootstraps
    hostile_ref: DaemonRef
    p_instance: str
    room: int = 100
    codes: dict[str, int] = field(default_factory=dict)
    examples: int = 0

    def note(self, what: str, code: grpc.StatusCode) -> None:
        key = f"{what}:{code.name}"
        self.codes[key] = self.codes.get(key, 0) + 1
        assert code in CLEAN, f"{what} answered {code.name}"


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    from kvxferd.transports.nixl import NixlTransport

    wd = Path(tempfile.mkdtemp(prefix="kvxfp-"))
    secret = secrets.token_hex(24).encode()
    files = {n: secret_file(wd, n, secret) for n in ("d", "p")}
    # Heartbeats as in the soak (2 s x 3): on a loaded 2-core machine 1 s x 2 loses a starved peer
    # now and then, which would fail the legit room for a reason that has nothing to do with input.
    procs = {n: spawn_daemon(wd, n, "--set", f"peer_secret_file={files[n]}", "--set", "max_peers=8",
                             "--set", "heartbeat_interval_s=2.0", "--set", "heartbeat_misses=3", wait=False)
             for n in ("d", "p")}
    agent = NixlTransport(f"kvx-fuzzpeer-{os.getpid()}", progress_thread=False)
    clients: list[Client] = []
    engines: list[Any] = []
    try:
        for proc in procs.values():
            wait_ready(proc)
        d, p = procs["d"], procs["p"]
        clients = [Client(d, secret, wd), Client(d, None, wd), Client(d, secrets.token_hex(24).encode(), wd)]
        rx = DecodeReceiver(socket=d.socket, group="dd", layout=LAYOUT, ring_bytes=1 << 20)
        tx = PrefillSender(socket=p.socket, group="pp", layout=LAYOUT, ring_bytes=1 << 20)
        d_prefill = PrefillSender(socket=d.socket, group="fp", layout=LAYOUT, ring_bytes=1 << 20)
        engines = [rx, tx, d_prefill]
        probe = Client(p, None, wd)
        p_instance = probe.stub.Heartbeat(peer_pb2.HeartbeatRequest(), timeout=T).sender.instance_id
        probe.close()
        w = World(d, p, agent, *clients, rx, tx, d_prefill,
                  DaemonRef("hostile", "h-1", f"127.0.0.1:{closed_port()}"), p_instance)
        legit_room(w, forged=None)  # warm: the pair is handshaken with a live session
        yield w
        print(f"peer fuzz: {w.examples} examples; status codes: {dict(sorted(w.codes.items()))}")
    finally:
        for e in engines:
            e.close()
        for c in clients:
            c.close()
        for proc in procs.values():
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.stop(timeout=30)
        agent.close()
        shutil.rmtree(wd, ignore_errors=True)


def check_daemon(w: World) -> None:
    assert w.d.proc.poll() is None, f"daemon died:\n{w.d.log_text()[-3000:]}"
    with grpc.insecure_channel(f"unix:{w.d.socket}") as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=T)
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    for name, (used, limit) in caps(w.d).items():
        assert used <= limit, f"cap {name}: {used} > {limit}"


def _logs(w: World) -> str:
    return "".join(f"--- {d.name} log (end) ---\n{d.log_text()[-3000:]}\n" for d in (w.d, w.p))


def legit_room(w: World, forged: Any) -> None:
    """A room p -> d: first chunk, then `forged()` (the attack), then the room must still be open;
    then the last chunk, and every byte must be right."""
    w.room += 1
    r = w.room
    data = [secrets.token_bytes(CHUNK), secrets.token_bytes(CHUNK)]
    w.rx.expect(r, w.p.peer_address, "pp", 32)
    w.tx.send_chunk(r, 0, 0, 16, data[0], last=False)
    if forged is not None:
        forged(r)
        st_ = w.rx.poll(r)
        assert st_.state not in (RoomState.SUCCESS, RoomState.FAILED), \
            f"a hostile peer's messages finished the legit room: {st_}\n{_logs(w)}"
    w.tx.send_chunk(r, 1, 16, 16, data[1], last=True, aux=b"end")
    got, st_ = w.rx.receive(r, timeout=30)
    assert [got[0], got[1]] == data and st_.aux == b"end", "legit room bytes differ"
    w.tx.wait(r, timeout=10)
    w.rx.release(r)
    w.tx.release(r)


# --------------------------------------------------------------------------- strategies

u64 = st.one_of(st.integers(0, 64), st.integers(0, U64), st.sampled_from([U64, 1 << 63, 1 << 32]))
u32 = st.one_of(st.integers(0, 64), st.integers(0, U32))
# Room references resolved per example: the legit room in flight, it with another generation, the
# previous legit room, or anything.
room_ref = st.one_of(st.sampled_from(["LEGIT", "LEGIT_GEN", "PREV"]), st.tuples(u64, st.integers(0, 3) | u64))
credit_id = st.one_of(st.integers(0, 64), u64)
layouts = st.one_of(st.just(LAYOUT.to_pb()), st.builds(
    common_pb2.KVLayout, num_layers=u32, total_kv_heads=u32, head_dim=u32, dtype_bytes=u32, page_size=u32))
text = st.text(max_size=40)

# Each message is built once the example's legit room is known: (kind, fields).
MSG = st.one_of(
    st.tuples(st.just("bootstrap"), st.fixed_dictionaries({
        "room": room_ref, "group": st.sampled_from(["fp", "pp", ""]) | text, "reader": u32,
        "tp": st.sampled_from([1, 2, 0]) | u32, "layout": layouts, "tokens": st.sampled_from([16, 32]) | u32,
        "ring": text, "deadline": st.sampled_from([0, 1]) | u64,
        "zc": st.none() | st.tuples(u64, u64, st.lists(u32, max_size=4))})),
    st.tuples(st.just("bootstrap_reply"), st.fixed_dictionaries({
        "room": room_ref, "reader": st.integers(0, 2), "code": st.integers(-5, 20), "tp": u32, "layout": layouts})),
    st.tuples(st.just("grant"), st.fixed_dictionaries({
        "credits": st.lists(st.tuples(credit_id, st.sampled_from(["RING"]) | text, u64, u64,
                                      st.sampled_from(["DRAM", "VRAM", "", "HBM"]), u32), max_size=4)})),
    st.tuples(st.just("credit_request"), st.fixed_dictionaries({"ring": st.sampled_from(["RING"]) | text, "n": u64})),
    st.tuples(st.just("credit_return"), st.fixed_dictionaries({"ids": st.lists(credit_id, max_size=8)})),
    st.tuples(st.just("revoke"), st.fixed_dictionaries({"ids": st.lists(credit_id, max_size=8), "reason": text})),
    st.tuples(st.just("reclaim"), st.fixed_dictionaries({"ring": st.sampled_from(["RING"]) | text})),
    st.tuples(st.just("release"), st.fixed_dictionaries({
        "ranges": st.lists(st.tuples(credit_id, u64), max_size=4), "rooms": st.lists(room_ref, max_size=3)})),
    st.tuples(st.just("complete"), st.fixed_dictionaries({
        "room": room_ref, "reader": st.integers(0, 2), "n": st.sampled_from([1, 2]) | u32,
        "aux": st.binary(max_size=64)})),
    st.tuples(st.just("complete_ack"), st.fixed_dictionaries({
        "room": room_ref, "reader": st.integers(0, 2), "code": st.integers(-3, 20)})),
    st.tuples(st.just("abort"), st.fixed_dictionaries({
        "room": room_ref, "code": st.integers(-(1 << 31), (1 << 31) - 1), "reason": st.text(max_size=300),
        "quiesced": st.booleans()})),
    st.tuples(st.just("hello"), st.just({})),
    st.tuples(st.just("empty"), st.just({})),
)


def room_pb(ref: Any, legit: int) -> common_pb2.RoomKey:
    if ref == "LEGIT":
        return common_pb2.RoomKey(id=legit)
    if ref == "LEGIT_GEN":
        return common_pb2.RoomKey(id=legit, generation=1)
    if ref == "PREV":
        return common_pb2.RoomKey(id=legit - 1)
    return common_pb2.RoomKey(id=ref[0], generation=ref[1])


def build(w: World, m: tuple[str, dict[str, Any]], legit: int) -> peer_pb2.PeerMsg:
    kind, f = m

    def ring(r: str) -> str:
        return str(w.rx.engine_id) if r == "RING" else r

    if kind == "bootstrap":
        b = peer_pb2.Bootstrap(room=room_pb(f["room"], legit), prefill_group=f["group"], reader_rank=f["reader"],
                               decode_tp=f["tp"], layout=f["layout"], num_tokens=f["tokens"], reader_ring=f["ring"],
                               deadline_unix_ms=f["deadline"])
        if f["zc"] is not None:
            b.zero_copy.CopyFrom(peer_pb2.ZeroCopyTarget(address=f["zc"][0], num_slots=f["zc"][1], pages=f["zc"][2]))
        return peer_pb2.PeerMsg(bootstrap=b)
    if kind == "bootstrap_reply":
        return peer_pb2.PeerMsg(bootstrap_reply=peer_pb2.BootstrapReply(
            room=room_pb(f["room"], legit), reader_rank=f["reader"], code=f["code"], prefill_tp=f["tp"],
            layout=f["layout"]))
    if kind == "grant":
        return peer_pb2.PeerMsg(grant=peer_pb2.CreditGrant(credits=[
            peer_pb2.Credit(id=i, ring=ring(r), address=a, length=n, mem=mem, device=dev)
            for i, r, a, n, mem, dev in f["credits"]]))
    if kind == "credit_request":
        return peer_pb2.PeerMsg(credit_request=peer_pb2.CreditRequest(ring=ring(f["ring"]), bytes=f["n"]))
    if kind == "credit_return":
        return peer_pb2.PeerMsg(credit_return=peer_pb2.CreditReturn(ids=f["ids"]))
    if kind == "revoke":
        return peer_pb2.PeerMsg(revoke=peer_pb2.CreditRevoke(ids=f["ids"], reason=f["reason"]))
    if kind == "reclaim":
        return peer_pb2.PeerMsg(reclaim=peer_pb2.Reclaim(ring=ring(f["ring"])))
    if kind == "release":
        return peer_pb2.PeerMsg(release=peer_pb2.RangeRelease(
            ranges=[peer_pb2.Range(credit_id=c, offset=o) for c, o in f["ranges"]],
            rooms=[room_pb(r, legit) for r in f["rooms"]]))
    if kind == "complete":
        return peer_pb2.PeerMsg(complete=peer_pb2.Complete(
            room=room_pb(f["room"], legit), reader_rank=f["reader"], num_chunks=f["n"], aux=f["aux"]))
    if kind == "complete_ack":
        return peer_pb2.PeerMsg(complete_ack=peer_pb2.CompleteAck(
            room=room_pb(f["room"], legit), reader_rank=f["reader"], code=f["code"]))
    if kind == "abort":
        return peer_pb2.PeerMsg(abort=peer_pb2.Abort(
            room=room_pb(f["room"], legit), code=f["code"], reason=f["reason"], quiesced=f["quiesced"]))
    if kind == "hello":
        return w.hostile.hello(w.hostile_ref, "x", None)
    return peer_pb2.PeerMsg()


FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))


# One Hypothesis run is one pytest test: its time limit grows with the examples asked for.
@pytest.mark.timeout(120 + BASE // 2)
@settings(FUZZ, max_examples=BASE)
@given(batches=st.lists(st.lists(MSG, max_size=8), min_size=1, max_size=3),
       oversize=st.integers(0, 9).map(lambda i: i == 9), restart=st.booleans())
def test_an_authenticated_hostile_peer_cannot_touch_what_it_does_not_own(
        world: World, batches: list[list[tuple[str, dict[str, Any]]]], oversize: bool, restart: bool) -> None:
    w = world
    w.examples += 1

    def attack(legit: int) -> None:
        ref = w.hostile_ref
        if restart:  # a "restarted" hostile peer: a new instance id
            ref = DaemonRef(ref.daemon_id, f"h-{w.examples}", ref.address)
        reply, binding = w.hostile.handshake(ref, w.agent.name, w.agent.metadata())
        hello = w.hostile.hello(ref, reply.sender.instance_id, binding)
        out = [peer_pb2.PeerBatch(msgs=[hello])]
        out += [peer_pb2.PeerBatch(msgs=[build(w, m, legit) for m in batch]) for batch in batches]
        if oversize:
            out.append(peer_pb2.PeerBatch(msgs=[peer_pb2.PeerMsg()] * 4097))
        code, why = code_of(lambda: list(w.hostile.stub.Session(iter(out), timeout=T)))
        w.note("hostile_session", code)
        if oversize:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "peer_batch_msgs" in why, (code, why)

    legit_room(w, attack)
    check_daemon(w)


UNAUTH = st.one_of(
    st.tuples(st.just("handshake"), st.fixed_dictionaries({
        "who": st.sampled_from(["d", "p", "hostile"]) | text, "inst": st.sampled_from(["P", "x"]) | text,
        "addr": st.sampled_from(["P", "127.0.0.1:1", "[::1]:2", "10.0.0.1:7471"]),
        "md": st.just("VALID") | st.binary(max_size=300),
        "proof": st.sampled_from(["NONE", "RANDOM", "OTHER_SECRET", "EMPTY"]),
        "client": st.sampled_from(["stranger", "liar"])})),
    st.tuples(st.just("session"), st.fixed_dictionaries({
        "who": st.sampled_from(["p", "hostile"]) | text, "inst": st.sampled_from(["P", "x"]),
        "proof": st.sampled_from(["NONE", "RANDOM", "OTHER_SECRET"]), "target": st.sampled_from(["D", "x"]),
        "msgs": st.lists(MSG, max_size=4), "client": st.sampled_from(["stranger", "liar"])})),
    st.tuples(st.just("heartbeat"), st.fixed_dictionaries({"who": st.sampled_from(["p", "", "hostile"]) | text})),
)


def _ref(w: World, who: str, inst: str, addr: str = "P") -> DaemonRef:
    return DaemonRef(who, w.p_instance if inst == "P" else inst, w.p.peer_address if addr == "P" else addr)


def _proof(w: World, kind: str, client: Client, ref: DaemonRef, md: bytes) -> Proof | None:
    if kind == "NONE":
        return None
    if kind == "EMPTY":
        return Proof()
    if kind == "RANDOM":
        return Proof(secrets.token_bytes(16), 0, secrets.token_bytes(32), secrets.token_bytes(16))
    liar = w.liar
    if client is liar or kind == "OTHER_SECRET":
        return liar.auth.request_proof(ref, w.agent.name, md, liar.auth.signing_keys()[0], liar.challenge())
    return None


@pytest.mark.timeout(120 + BASE // 2)
@settings(FUZZ, max_examples=2 * BASE)
@given(o=UNAUTH)
def test_unauthenticated_peer_requests_are_refused_and_change_nothing(world: World, o: tuple[str, dict[str, Any]]) -> None:
    w = world
    w.examples += 1
    kind, f = o
    client = w.liar if f.get("client") == "liar" else w.stranger
    peers_before = {p.daemon_id for p in status(w.d).peers}
    if kind == "handshake":
        ref = _ref(w, f["who"], f["inst"], f["addr"])
        md = w.agent.metadata() if f["md"] == "VALID" else f["md"]
        req = client.request(ref, w.agent.name, md, proof=_proof(w, f["proof"], client, ref, md))
        code, _ = code_of(lambda: client.stub.Handshake(req, timeout=T))
        w.note("unauth_handshake", code)
        assert code != grpc.StatusCode.OK, "a handshake without the secret was accepted"
    elif kind == "session":
        ref = _ref(w, f["who"], f["inst"])
        target = w.p_instance if f["target"] == "D" else "x"
        hello = client.hello(ref, target, None)
        proof = _proof(w, f["proof"], client, ref, b"")
        if proof is not None:
            hello.hello.proof.CopyFrom(peer_pb2.PeerProof(nonce=proof.nonce, mac=proof.mac, peer_nonce=proof.peer_nonce))
        msgs = [hello, *(build(w, m, w.room) for m in f["msgs"])]
        code, _ = code_of(lambda: list(client.stub.Session(iter([peer_pb2.PeerBatch(msgs=msgs)]), timeout=T)))
        w.note("unauth_session", code)
        assert code != grpc.StatusCode.OK, "a stream without a handshake bound to it was accepted"
    else:
        req = peer_pb2.HeartbeatRequest()
        if f["who"]:
            req.sender.CopyFrom(peer_pb2.DaemonRef(daemon_id=f["who"], instance_id="i", address="127.0.0.1:1"))
        w.note("unauth_heartbeat", code_of(lambda: client.stub.Heartbeat(req, timeout=T))[0])
    assert {p.daemon_id for p in status(w.d).peers} <= peers_before | {"hostile"} and "p" in peers_before
    if w.examples % 25 == 0:
        legit_room(w, forged=None)
        check_daemon(w)


def test_after_the_peer_fuzz_the_legit_pair_still_works(world: World) -> None:
    w = world
    assert w.examples >= 3 * BASE, w.examples
    legit_room(w, forged=None)
    check_daemon(w)
    peers = {p.daemon_id: p.state for p in status(w.d).peers}
    assert peers.get("p") == "up", peers
    # A message handler that raised anything but a domain error is a bug, even if the daemon lived.
    log = w.d.log_text()
    assert "Traceback" not in log and "message failed" not in log, log[-5000:]
