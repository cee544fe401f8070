"""Issue #36 class 4: labels whose values a caller chooses stay bounded in /metrics.

A real daemon (shared-secret mode) and an authenticated peer with a real NIXL agent that
handshakes under many daemon ids of its choosing, each twice with changed NIXL metadata, so each
id earns a series in a peer-labelled metric (kvxferd_peer_metadata_reloads). Only max_peer_series
ids get their own series, the rest are counted under peer="(other)"; and once those peers are
forgotten (they never opened a stream: lost, then peer_forget_s later forgotten) their series go.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import tempfile
import time
from contextlib import closing
from pathlib import Path

from kvxferd.core.types import DaemonRef
from kvxferd.ops.metrics import OTHER_PEERS
from kvxferd.transports.nixl import NixlTransport
from tests.conftest import spawn_daemon
from tests.peer_client import Client, closed_port, running, secret_file
from tests.test_notif_binding import scrape

CAP = 4
IDS = 12
RELOADS = re.compile(r'^kvxferd_peer_metadata_reloads_total\{peer="([^"]*)"\} (\S+)$', re.M)


def test_attacker_chosen_peer_ids_leave_a_bounded_metrics_page_and_forgotten_peers_leave_none() -> None:
    wd = Path(tempfile.mkdtemp(prefix="kvxml-"))
    secret = secrets.token_hex(24).encode()
    d = spawn_daemon(wd, "d", "--set", f"peer_secret_file={secret_file(wd, 'd', secret)}",
                     "--set", f"max_peer_series={CAP}", "--set", "peer_forget_s=1", wait=False)
    with running({"d": d}), closing(Client(d, secret, wd)) as client, \
            closing(NixlTransport(f"kvx-labels-{os.getpid()}", progress_thread=False)) as agent:
        before = len(scrape(d))
        md0 = agent.metadata()
        buf = ctypes.create_string_buffer(4096)
        agent.register_region(ctypes.addressof(buf), len(buf))
        md1 = agent.metadata()  # the same agent with one more region: a metadata reload
        assert md0 != md1
        ids = [f"attacker-{i}-{secrets.token_hex(4)}" for i in range(IDS)]
        for pid in ids:
            ref = DaemonRef(pid, "i-1", f"127.0.0.1:{closed_port()}")
            client.handshake(ref, agent.name, md0)
            client.handshake(ref, agent.name, md1)
        series = {m[1]: float(m[2]) for m in RELOADS.finditer(scrape(d))}
        own = {k: v for k, v in series.items() if k != OTHER_PEERS}
        assert len(own) <= CAP and set(own) <= set(ids), series
        assert sum(series.values()) == IDS, f"every reload counted, under its id or {OTHER_PEERS}: {series}"

        # No stream follows the handshakes: each is lost (after the handshake's 5 s), then forgotten.
        deadline = time.monotonic() + 60
        while any(peer != OTHER_PEERS for peer, _ in RELOADS.findall(scrape(d))):
            assert time.monotonic() < deadline, f"forgotten peers' series still there: {RELOADS.findall(scrape(d))}"
            time.sleep(0.2)
        text = scrape(d)
        assert not any(pid in text for pid in ids)
        # What stays is one shared series per metric, not one per id.
        assert len(text) < before + 2048, (before, len(text))
