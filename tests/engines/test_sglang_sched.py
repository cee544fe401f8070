"""The kvxferd backend under sglang's OWN PD scheduler code (tests/engines/sglang_sched.py).

Real: sglang 0.5.23's plugin loader (``load_plugins``: our entry point registers, its hooks are
applied, the CLI takes ``--disaggregation-transfer-backend kvxferd``); the scheduler mixins'
methods an sglang server runs (``process_decode_queue``, ``process_disagg_prefill_inflight_queue``,
``send_kv_chunk``, ``checkpoint_disagg_prefill``, ``_retire_aborted_prefill_result``,
``handle_inflight_transfer_failure``); the queues (``PrefillBootstrapQueue``,
``DecodePreallocQueue`` with ``try_ensure_parallel_info``/``prefill_info_table``,
``DecodeTransferQueue`` with its metadata gate); ``Req``, ``ServerArgs`` published into sglang's
runtime context, ``MHATokenToKVPool`` (on CPU), ``ReqToTokenPool``, ``PagedTokenToKVPoolAllocator``,
``RadixCache`` (disabled, as with ``--disable-radix-cache``), ``MetadataBuffers``; each side's TP
ranks all-reduce their polls over a real gloo group; two real daemons, prefill and decode ranks in
processes of their own; every KV byte (read back through the decode request's req-to-token row)
and the first output token checked.

Stand-ins, and why:
* the model forward: no model runs on CPU here. ``sglang_sched._forward`` allocates a prefill
  chunk's KV slots (req row, whole pages, from the real allocator) and writes known KV, as the
  extend batch and the forward would; the last chunk's sampled token is appended to
  ``output_ids`` and the request handed to the inflight queue and ``send_kv_chunk`` as
  ``process_batch_result_disagg_prefill`` does (that method needs the batch/logits objects).
* the scheduler object itself (sglang's ``Scheduler`` builds a model runner, ZMQ sockets, CUDA
  streams): ``sglang_sched._Host`` holds the attributes the mixins and queues read. Its output
  streamer records streamed requests (no detokenizer), its batch result processor's reasoning
  token count does nothing (no reasoning parser), metrics are off, ``model_config`` and
  ``tp_worker.model_runner`` give the layer/head counts and ``kv_cache_dtype_str`` ("auto", as a
  server without ``--kv-cache-dtype`` has), and ``attn_tp_group`` is the gloo group.
* ``torchvision``: sglang's model configs import it and no CPU build loads here; the helper
  process installs an import stand-in (tests/engines/sglang_cpu.py), never the pytest process.
Client aborts go through ``prepare_abort`` and the mixin's ``_retire_aborted_prefill_result``
(the path ``Scheduler.abort_request`` takes for a request between two chunks).

One helper process loads sglang once (a minute on a loaded 2-core box) and runs both TP pairs;
the ranks fork from it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, spawn_daemon, stop_all
from tests.engines import sglang_sched as ss

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="needs sglang (make install-test installs it)")

PAIRS = [(2, 1), (1, 2)]
BASE = 940_000


def plans(base: int) -> list[ss.Plan]:
    # Rooms differ per pair: a failed room stays FAILED on the daemons until its deadline. The
    # orphan (its prefill never answers: sglang's decode queue gives up after 15 route lookups a
    # second apart) is in the first pair only, for the 15 s it costs.
    orphan = [ss.Plan(room=base + 6, tokens=8, chunk_tokens=8, orphan=True)] if base == BASE else []
    return [
        ss.Plan(room=base + 1, tokens=45, chunk_tokens=16),  # chunked prefill: 16 + 16 + 13 tokens
        ss.Plan(room=base + 2, tokens=8, chunk_tokens=64),
        ss.Plan(room=base + 3, tokens=24, chunk_tokens=8, abort_after=1),  # client abort after one chunk
        ss.Plan(room=base + 4, tokens=17, chunk_tokens=12),
        ss.Plan(room=base + 5, tokens=40, chunk_tokens=8, repeat_chunk=2),  # chunk 2 reuses chunk 1's id
        *orphan,
    ]


@pytest.fixture(scope="module")
def report() -> Iterator[dict[str, Any]]:
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="sgs", dir="/tmp"))  # short: unix socket paths
    p, d = spawn_daemon(work, "sgs-p"), spawn_daemon(work, "sgs-d")
    try:
        arg = json.dumps([[vars(pl) for pl in plans(BASE + 100 * i)] for i in range(len(PAIRS))])
        run = subprocess.run(
            [sys.executable, "-m", "tests.engines.sglang_sched", "--prefill-socket", p.socket, "--decode-socket",
             d.socket, "--pairs", ",".join(f"{a}:{b}" for a, b in PAIRS), "--plans", arg],
            cwd=ROOT, capture_output=True, text=True, timeout=540)
        assert run.returncode == 0, f"sglang scheduler helper failed:\n{run.stderr[-6000:]}"
        yield json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        stop_all(p, d)


def test_plugin_loads_through_sglangs_loader(report: dict[str, Any]) -> None:
    facts = report["plugin"]
    assert facts["cli_backend"] == "kvxferd"  # the CLI choice register() added
    assert facts["member"] == "KVXFERD"  # the TransferBackend REPLACE hook
    assert facts["classes"] == {"kvargs": "KVArgs", "manager": "KvxferdKVManager", "sender": "KvxferdKVSender",
                                "receiver": "KvxferdKVReceiver", "bootstrap_server": "KvxferdKVBootstrapServer"}
    assert facts["nixl_manager"] == "NixlKVManager"  # other backends still sglang's own
    assert facts["scheduler_modules_bound"], "decode.py/prefill.py imported the unpatched names"


@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=[f"{a}to{b}" for a, b in PAIRS])
def test_sglang_scheduler_pd(report: dict[str, Any], pair: int) -> None:
    got = report["pairs"][pair]
    ptp, dtp = got["tp"]
    assert len(got["ranks"]) == ptp + dtp
    errors = [f"{r['role']} {r['rank']}: {r['error']}" for r in got["ranks"] if r["error"]]
    assert not errors, "\n".join(errors)
    pls = plans(BASE + 100 * pair)
    aborted, repeated = str(pls[2].room), str(pls[4].room)
    want_ok = {str(pl.room) for pl in pls if not pl.fails}
    reasons: dict[str, list[str]] = {aborted: [], repeated: []}
    for r in got["ranks"]:
        who, rooms = (r["role"], r["rank"]), r["result"]["rooms"]
        assert len(rooms) == len(pls) - (r["role"] == "prefill") * sum(pl.orphan for pl in pls), (who, rooms)
        # Every rank of both sides agrees on each room's outcome (sglang all-reduces the polls).
        assert {room for room, st in rooms.items() if st == "Success"} == want_ok, (who, rooms)
        assert rooms[aborted].startswith("Failed") and rooms[repeated].startswith("Failed"), (who, rooms)
        assert r["result"]["free_meta"] == ss.META_SLOTS, (who, "a metadata buffer slot was not given back")
        if r["role"] == "prefill":
            assert rooms[aborted] == "Failed: aborted", (who, rooms)
            # The refusal of the repeated chunk failed the room (on a rank that came after
            # another had failed it, the daemon said so).
            assert any(why in rooms[repeated] for why in ("was already enqueued", "already FAILED")), (who, rooms)
        else:
            heads = len(ss.local_heads(dtp, r["rank"]))
            want = sum(pl.tokens for pl in pls if not pl.fails) * ss.LAYERS * 2 * heads * ss.HEAD_DIM * 2
            assert r["result"]["checked_bytes"] == want, who
            for pl in pls:
                if pl.orphan:  # the receiver sglang aborts fails the handshake, no daemon needed
                    assert rooms[str(pl.room)].startswith("Failed: Decode handshake failed"), (who, rooms)
            reasons[aborted].append(rooms[aborted])
            reasons[repeated].append(rooms[repeated])
    # A decode rank fails a room with the daemon's reason or, when another rank of its TP group
    # saw the failure first, with sglang's propagated "transfer failed"; one of them says why.
    assert any(w in x for x in reasons[aborted] for w in ("aborted by the prefill engine", "already FAILED")), reasons
    assert any(w in x for x in reasons[repeated] for w in ("was already enqueued", "already FAILED", "never sent")), reasons
