"""kvxfer_client._reattach against a real daemon: a registration that heals by itself.

- kill -9 and restart at the same socket: the healer registers again (epoch + 1, a new engine id,
  the old rooms' epoch marked lost) with no call from the engine; the old registration's calls
  are refused by the new daemon ("earlier instance"), the new one's work;
- SIGSTOP: the path goes DOWN within a few probes and get() then fails at once (never waits on
  the stopped daemon); SIGCONT: UP again with the same registration (epoch unchanged, nothing lost);
- errors that are not about the registration (a room unknown) leave the path up.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import grpc
import pytest

from kvxfer_client import KvxferError, Layout, PrefillSender
from kvxfer_client._reattach import Detached, Reattach
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2
from tests.faults.harness import wait_until

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16, dtype="float16")




def _alive(tx: PrefillSender) -> None:
    tx.stub.KeepAlive(engine_pb2.KeepAliveRequest(engine_id=tx.engine_id), timeout=5)


def test_reattach_after_kill_restart_and_stall(daemons: Any) -> None:
    d = daemons("ra", "--set", "engine_lease_s=60")
    changes: list[tuple[bool, int]] = []
    link = Reattach(lambda: PrefillSender(group="ra", layout=LAYOUT, ring_bytes=4 << 20, socket=d.socket,
                                          call_timeout=1.0),
                    "ra rank 0", probe_timeout_s=0.5, retry_s=0.2, on_change=lambda up, e, why: changes.append((up, e)))
    stopped = False
    try:
        tx0, e0 = link.get()
        assert e0 == 0 and link.up and link.lost_epoch == -1
        # A room the daemon does not know is the room's business, not the registration's.
        with pytest.raises(KvxferError) as nf:
            tx0.poll(12345)
        assert not link.failed(nf.value, e0) and link.up

        d.kill()
        d = daemons("ra", "--set", "engine_lease_s=60")
        wait_until(lambda: link.up and link.epoch == 1, 20, "registered again with the restarted daemon")
        tx1, e1 = link.get()
        assert e1 == 1 and tx1 is not tx0 and tx1.engine_id != tx0.engine_id
        assert link.lost_epoch == 0  # rooms begun with the old registration are failed, never resumed
        _alive(tx1)
        with pytest.raises(KvxferError):
            _alive(tx0)  # this thread's lane connection was to the dead daemon: lost
        with pytest.raises(KvxferError) as old:
            _alive(tx0)
        assert old.value.code is grpc.StatusCode.NOT_FOUND and "earlier instance" in old.value.message
        assert link.failed(old.value, e0)  # an old epoch's error: handled, and the path stays up
        assert link.up and changes[:2] == [(False, 0), (True, 1)], changes

        d.proc.send_signal(signal.SIGSTOP)
        stopped = True
        wait_until(lambda: not link.up, 10, "the stall noticed")
        t = time.monotonic()
        with pytest.raises(Detached):
            link.get()
        assert time.monotonic() - t < 0.1
        assert link.lost_epoch == 0  # a stall loses nothing yet
        d.proc.send_signal(signal.SIGCONT)
        stopped = False
        wait_until(lambda: link.up, 15, "up again after the resume")
        tx2, e2 = link.get()
        assert tx2 is tx1 and e2 == 1 and link.lost_epoch == 0
        _alive(tx2)
    finally:
        if stopped:
            d.proc.send_signal(signal.SIGCONT)
        link.close()
