"""The kvxferd transfer backend for sglang (kvxfer_client.sglang), driven as sglang's scheduler
drives a backend: real sglang base classes, KVPoll and KVArgs over CPU tensors laid out as sglang's
token-to-KV pool, prefill and decode ranks in separate processes on two real daemons, with the
backend's own bootstrap server. Covers chunked sends (several send() calls per room), a prefill
abort mid-room (the decode side fails with the reason, never hangs), heterogeneous TP both ways
(the daemon slices heads), and every landed byte and aux item checked.

These drive the backend through sglang's base classes with hand-written loops (cheap: only
sglang's base module imports), and count the daemon calls sglang's per-step polls cost; the same
backend under sglang's own scheduler queues and mixins, and its loading through sglang's plugin
loader, is tests/engines/test_sglang_sched.py."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvxfer_client.sglang._watch import RESYNC_S
from tests.engines import sglang_ranks as sr

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="needs sglang (make install-test installs it)")

PLANS = [
    sr.RoomPlan(room=910_001, tokens=45, chunk_pages=(4, 4, 4)),  # 12 pages, three chunks, last page partial
    sr.RoomPlan(room=910_002, tokens=8, chunk_pages=(2,)),
    sr.RoomPlan(room=910_003, tokens=24, chunk_pages=(2, 2, 2), abort_after=1),
    sr.RoomPlan(room=910_004, tokens=17, chunk_pages=(3, 2)),
    sr.RoomPlan(room=910_005, tokens=40, chunk_pages=(2, 2, 2, 2, 2), repeat_chunk=2),
]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_sglang_backend_pd(daemons: Any, prefill_tp: int, decode_tp: int) -> None:
    p, d = daemons("sgl-p"), daemons("sgl-d")
    try:
        got = sr.run_pair(p.socket, d.socket, prefill_tp, decode_tp, PLANS)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    errors = [g[3] for g in got if g[3]]
    assert not errors, "\n".join(f"{g[0]} {g[1]}: {g[2]} {g[3]}" for g in got)
    for role, rank, res, _ in got:
        rooms = res["rooms"]
        assert rooms[910_001] == rooms[910_002] == rooms[910_004] == "Success", (role, rank, rooms)
        assert rooms[910_003].startswith("Failed"), (role, rank, rooms)
        assert rooms[910_005].startswith("Failed"), (role, rank, rooms)
        # Room states and landed chunks come by push: the daemon is asked (PollRoom) about twice
        # per room (before a rank's first chunk, once after it) plus one resync per silent second,
        # however often sglang polls (each poll used to be a PollRoom).
        budget = 2 * len(PLANS) + res["seconds"] / RESYNC_S
        assert res["daemon_polls"] <= budget < res["polls"], (role, rank, res)
        if role == "decode":
            # ABORTED; or, for a decode rank that expects after the abort, the refusal (the room is
            # already FAILED). Either way a clean failure, never a hang.
            assert "aborted by the prefill engine" in rooms[910_003] or "already FAILED" in rooms[910_003], rooms
            # The repeated chunk was refused without the prefill rank waiting for the verdict; the
            # rank failed the room with the daemon's reason, or (the refusal reached it after the
            # room's last chunk was written) the daemons failed it for the tokens it left out,
            # never SUCCESS with a hole.
            assert any(why in rooms[910_005] for why in ("was already enqueued", "already FAILED",
                                                         "were never sent")), rooms
            heads = len(sr.local_heads(decode_tp, rank))
            want = sum(pl.tokens for pl in PLANS if pl.abort_after < 0 and pl.repeat_chunk < 0) * sr.LAYERS * 2 * heads * sr.HEAD_DIM * 2
            assert res["checked_bytes"] == want


def test_plugin_entry_point_is_installed() -> None:
    # The entry point sglang's load_plugins() discovers (installed package metadata); the loading
    # itself, through sglang's loader and hook registry, is in test_sglang_sched.py.
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvxferd"]
    assert [ep.value for ep in eps] == ["kvxfer_client.sglang:register"]


def test_hook_routes_only_kvxferd_and_enum_gains_member() -> None:
    import enum

    import kvxfer_client.sglang as plugin
    from kvxfer_client.sglang._conn import KvxferdKVManager
    from kvxfer_client.sglang._receiver import KvxferdKVReceiver

    class Backend(enum.Enum):
        NIXL = "nixl"

    class Kind(enum.Enum):
        MANAGER = "manager"
        RECEIVER = "receiver"

    extended: Any = plugin.extended_transfer_backend(Backend)
    assert extended("kvxferd").name == "KVXFERD" and extended("nixl").name == "NIXL"
    calls: list[Any] = []
    assert plugin.get_kv_class_hook(lambda *a: calls.append(a), extended("kvxferd"), Kind.MANAGER) is KvxferdKVManager
    assert plugin.get_kv_class_hook(lambda *a: calls.append(a), extended("kvxferd"), Kind.RECEIVER) is KvxferdKVReceiver
    assert not calls
    plugin.get_kv_class_hook(lambda *a: calls.append(a), extended("nixl"), Kind.MANAGER)
    assert len(calls) == 1


def test_route_lookup_as_sglangs_decode_queue_does_it() -> None:
    # sglang's decode KVArgs carry no head counts, so the rank registers only once a prefill route
    # says the layout; until then nothing here needs a daemon.
    import json
    import urllib.error
    import urllib.request

    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvxfer_client.sglang._bootstrap import KvxferdKVBootstrapServer, PrefillRoute, put_route
    from kvxfer_client.sglang._conn import KvxferdKVManager
    from kvxfer_client.sglang._receiver import KvxferdKVReceiver

    port = sr.free_port()
    boot = KvxferdKVBootstrapServer("127.0.0.1", port)
    addr = f"127.0.0.1:{port}"
    try:
        bad = urllib.request.Request(f"http://{addr}/kvxferd/route", data=b'{"group": 1}', method="PUT")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=5)
        assert err.value.code == 400 and "malformed kvxferd route" in json.loads(err.value.read())["error"]

        args = sr.Pool(1, 0).kv_args(0)
        del args.kv_head_num, args.total_kv_head_num  # as sglang's DecodePreallocQueue builds them
        mgr = KvxferdKVManager(args, "decode", sr.server_args(port + 1, 1), False)
        assert mgr.rx is None and not mgr.try_ensure_parallel_info(addr)  # nothing registered yet (404)
        recv = KvxferdKVReceiver(mgr, addr, 77)
        recv.init(0)
        assert recv.poll() == KVPoll.Failed and recv.conclude_state == KVPoll.Failed
        with pytest.raises(Exception, match="no kvxferd route"):
            recv.failure_exception()
        recv.abort()  # sglang aborts requests whose prefill never answered: no daemon to tell, no error
        recv.clear()

        page_bytes = sr.PAGE * sr.TOTAL_HEADS * sr.HEAD_DIM * 2
        route = PrefillRoute("g", "127.0.0.1:1", 2, sr.PAGE * 2, sr.TOTAL_HEADS, sr.HEAD_DIM, 2, False)
        put_route(addr, route)
        with pytest.raises(RuntimeError, match="page size mismatch"):
            mgr.try_ensure_parallel_info(addr)
        put_route(addr, PrefillRoute("g", "127.0.0.1:1", 2, sr.PAGE, sr.TOTAL_HEADS * 2, sr.HEAD_DIM, 2, False))
        with pytest.raises(RuntimeError, match=f"would be {2 * page_bytes} B; it is {page_bytes} B"):
            mgr.try_ensure_parallel_info(addr)
        assert mgr.rx is None and addr not in mgr.prefill_info_table  # nothing half-done
        mgr.close()
    finally:
        boot.close()
