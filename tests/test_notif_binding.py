"""Issue #36 class 2: NIXL notifications are bound to the daemon that writes their room.

Real daemons (decode `d`, prefill `p`, shared-secret mode), real NIXL over loopback. A hostile
but authenticated peer (it holds the secret, handshakes with both daemons, owns real NIXL agents)
sends notifications for the legit room while it is in flight: under its own agent, naming the
writer's real credit (read from the decode daemon's debug log: the worst case, an id that leaked);
under the writer's own agent name (NIXL takes the name the sender states), naming the real credit,
credits next to it and random ones, a writer rank of no reader, with a guessed room token or in
the format that had none; for rooms that do not exist; and malformed ones. Then the same against
a zero-copy room (no credit at all: only the room's token tells the writer's notifications from
the spoofer's). None may count: each is dropped by reason (kvxferd_notifs_dropped), and each room
then finishes byte-exact, SUCCESS on both sides.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvxfer_client import DecodeReceiver, PrefillSender, RoomState
from kvxferd.core.types import DaemonRef, RoomKey
from kvxferd.datapath.notif import encode_notif, new_token
from kvxferd.transports.nixl import NixlTransport
from tests.conftest import DaemonProc, spawn_daemon
from tests.peer_client import CHUNK, LAYOUT, Client, closed_port, running, secret_file

ROOM = 77


def scrape(d: DaemonProc) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def dropped(d: DaemonProc) -> dict[str, float]:
    text = scrape(d)
    return {m[1]: float(m[2]) for m in re.finditer(r'^kvxferd_notifs_dropped_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def wait_for(what: str, cond: Callable[[], bool], budget: float) -> None:
    deadline = time.monotonic() + budget
    while not cond():
        assert time.monotonic() < deadline, f"waited {budget:g} s for {what}"
        time.sleep(0.05)


def test_notifications_from_anyone_but_the_rooms_writer_change_nothing() -> None:
    wd = Path(tempfile.mkdtemp(prefix="kvxnb-"))
    secret = secrets.token_hex(24).encode()
    procs = {n: spawn_daemon(wd, n, "--set", f"peer_secret_file={secret_file(wd, n, secret)}",
                             "--set", "heartbeat_interval_s=2.0", "--set", "heartbeat_misses=3",
                             *(("--set", "log_level=debug") if n == "d" else ()), wait=False)
             for n in ("d", "p")}
    agents: list[NixlTransport] = []
    with contextlib.ExitStack() as stack:
        d, p = stack.enter_context(running(procs)).values()
        # The hostile peer: authenticated with both daemons, so it knows their agent names.
        hostile = NixlTransport(f"kvx-hostile-{os.getpid()}", progress_thread=False)
        agents.append(hostile)
        stack.callback(hostile.close)
        to_d, to_p = stack.enter_context(closing(Client(d, secret, wd))), stack.enter_context(closing(Client(p, secret, wd)))
        ref = DaemonRef("hostile", "h-1", f"127.0.0.1:{closed_port()}")
        d_reply, _ = to_d.handshake(ref, hostile.name, hostile.metadata())
        p_reply, _ = to_p.handshake(ref, hostile.name, hostile.metadata())
        d_agent = hostile.add_remote(bytes(d_reply.nixl_metadata))
        # A second agent of the hostile process under the writer's own agent name.
        spoof = NixlTransport(p_reply.agent_name, progress_thread=False)
        agents.append(spoof)
        stack.callback(spoof.close)
        assert spoof.add_remote(bytes(d_reply.nixl_metadata)) == d_agent

        chunks = [secrets.token_bytes(CHUNK) for _ in range(3)]
        tx = PrefillSender(socket=p.socket, group="pg", layout=LAYOUT, ring_bytes=1 << 20)
        stack.callback(tx.close)
        rx = DecodeReceiver(socket=d.socket, group="dg", layout=LAYOUT, ring_bytes=1 << 20)
        stack.callback(rx.close)
        rx.expect(ROOM, p.peer_address, "pg", 48)
        tx.send_chunk(ROOM, 0, 0, 16, chunks[0])
        grant = re.compile(r"credit (\d+): \d+ B of ring \S+ granted to (\S+)")
        wait_for("the writer's credit in d's log", lambda: grant.search(d.log_text()) is not None, 30)
        credit = int(next(m[1] for m in grant.finditer(d.log_text()) if m[2] == p_reply.sender.daemon_id))

        key = RoomKey(ROOM)
        forged = {"sender": 0, "token": 0, "stale": 0, "malformed": 0}
        guess = new_token()  # the room's token is sent to its writer alone: a spoofer can only guess

        def send(agent: NixlTransport, reason: str, msg: bytes) -> None:
            agent._agent.send_notif(d_agent, msg)
            forged[reason] += 1

        for cid in (1, 2):
            spec: Any = SimpleNamespace(chunk_id=cid, token_start=16 * cid, num_tokens=16, last=cid == 2, layer_group=0,
                                       layer_end=0)
            for off in (0, CHUNK * cid, CHUNK * 2 * cid):
                # Under its own agent, with the writer's real credit: not the room's writer.
                send(hostile, "sender", encode_notif(key, spec, 0, 0, credit, off, token=guess))
            # Under the writer's agent name: it holds neither the room's token nor the writer's credits.
            for cr in (credit, credit + 1, credit - 1, credit + 16, secrets.randbits(63) or 1):
                send(spoof, "token", encode_notif(key, spec, 0, 0, cr, 0, token=guess))
            send(spoof, "token", encode_notif(key, spec, 5, 0, credit, 0, token=guess))  # a writer rank of no reader
            send(hostile, "stale", encode_notif(RoomKey(ROOM + 1), spec, 0, 0, credit, 0, token=guess))
            send(spoof, "stale", encode_notif(RoomKey(ROOM, 9), spec, 0, 0, credit, 0, token=guess))  # old generation
            # The format before tokens: a notification that carries none does not decode.
            send(spoof, "malformed", encode_notif(key, spec, 0, 0, credit, 0, token=guess).rpartition(b" ")[0])
        send(hostile, "malformed", b"kvx3 77 0 1 0 0")


        def settled() -> bool:
            for a in agents:  # (a NIXL agent with no progress thread sends when polled)
                a.get_notifs()
            st = rx.poll(ROOM)
            return st.finished or len(st.landed) > 1 or all(dropped(d).get(r, 0) >= n for r, n in forged.items())

        wait_for(f"every forged notification dropped and counted ({forged}), or the room changed", settled, 30)
        st = rx.poll(ROOM)
        assert not st.finished and [c.chunk_id for c in st.landed] == [0], f"forged notifications counted: {st}"
        assert all(dropped(d).get(r, 0) >= n for r, n in forged.items()), (dropped(d), forged)

        # The legit writer finishes the room: every byte is its own, SUCCESS on both sides.
        tx.send_chunk(ROOM, 1, 16, 16, chunks[1])
        tx.send_chunk(ROOM, 2, 32, 16, chunks[2], last=True, aux=b"aux")
        got, st = rx.receive(ROOM, timeout=30)
        assert [got[i] for i in range(3)] == chunks and st.aux == b"aux", "room bytes differ"
        assert tx.wait(ROOM, timeout=10).state.name == "SUCCESS"
        zero_copy_room(stack, d, p, lambda reason, msg: send(spoof, reason, msg), forged, agents)
        assert "MISMATCH" not in d.log_text() and "MISMATCH" not in p.log_text()


def zero_copy_room(stack: contextlib.ExitStack, d: DaemonProc, p: DaemonProc, spoof: Callable[[str, bytes], None],
                   forged: dict[str, int], agents: list[NixlTransport]) -> None:
    """A zero-copy room has no credit: notifications under the writer's agent name with a guessed
    token, or none, must still land nothing (before tokens, one marked a chunk landed before a
    byte of it was written, and the engine read what its pages held before)."""
    room, tokens, split, slots = ROOM + 100, 40, 24, 8 * LAYOUT.page_size
    pool_bytes = LAYOUT.num_layers * 2 * slots * LAYOUT.total_kv_heads * LAYOUT.head_dim * LAYOUT.dtype_bytes
    ztx = PrefillSender(socket=p.socket, group="zp", layout=LAYOUT, zero_copy=True, ring_bytes=pool_bytes)
    stack.callback(ztx.close)
    zrx = DecodeReceiver(socket=d.socket, group="zd", layout=LAYOUT, zero_copy=True, ring_bytes=pool_bytes)
    stack.callback(zrx.close)
    src = np.frombuffer(ztx.view(0, pool_bytes), dtype=np.uint8)
    dst = np.frombuffer(zrx.view(0, pool_bytes), dtype=np.uint8)
    src[:] = np.random.default_rng(36).integers(0, 256, pool_bytes, dtype=np.uint8)
    dst[:] = 0xAB
    ppages, dpages = [5, 1, 6], [2, 7, 0]
    zrx.expect(room, p.peer_address, "zp", tokens, pages=dpages)
    wait_for("the zero-copy room bootstrapped", lambda: zrx.poll(room).state is RoomState.WAITING_FOR_INPUT, 30)
    key, guess = RoomKey(room), new_token()
    for cid, (start, n) in enumerate(((0, split), (split, tokens - split))):
        spec: Any = SimpleNamespace(chunk_id=cid, token_start=start, num_tokens=n, last=cid == 1, layer_group=0,
                                   layer_end=0)
        for _ in range(3):
            spoof("token", encode_notif(key, spec, 0, 0, token=new_token()))
        spoof("token", encode_notif(key, spec, 0, 0, token=guess))
        spoof("malformed", encode_notif(key, spec, 0, 0, token=guess).rpartition(b" ")[0])

    def settled() -> bool:
        for a in agents:
            a.get_notifs()
        st = zrx.poll(room)
        return st.finished or bool(st.landed) or all(dropped(d).get(r, 0) >= n for r, n in forged.items())

    wait_for(f"every forged zero-copy notification dropped and counted ({forged}), or the room changed", settled, 30)
    st = zrx.poll(room)
    assert not st.finished and not st.landed, f"forged notifications marked zero-copy chunks landed: {st}"
    assert all(dropped(d).get(r, 0) >= n for r, n in forged.items()), (dropped(d), forged)
    lay = LAYOUT
    ztx.enqueue(room, 0, 0, split, pages=lay.chunk_pages(ppages, 0, split)[0])
    ztx.enqueue(room, 1, split, tokens - split, pages=lay.chunk_pages(ppages, split, tokens - split)[0], last=True,
                aux=b"zc")
    assert ztx.wait(room, timeout=30).state is RoomState.SUCCESS
    st = zrx.wait(room, timeout=30)
    assert st.state is RoomState.SUCCESS and st.aux == b"zc" and sorted(c.chunk_id for c in st.landed) == [0, 1]
    # [layers, K/V, slots, bytes per token slot]: every token of the room, from its own page, byte-exact.
    sv, dv = (a.reshape(lay.num_layers, 2, slots, -1) for a in (src, dst))
    for t in range(tokens):
        pi, off = divmod(t, lay.page_size)
        ps, pd = ppages[pi] * lay.page_size + off, dpages[pi] * lay.page_size + off
        assert np.array_equal(dv[:, :, pd], sv[:, :, ps]), f"token {t} differs"
    assert (dv[:, :, 16:32] == 0xAB).all(), "a page outside the room was written"
