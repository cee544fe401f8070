"""Raw NIXL baseline: what NIXL alone does between two processes, with no daemon around it.

One sender agent (this process) and one receiver agent (a spawned child) move ``total_bytes``
DRAM→DRAM as one WRITE per chunk, one descriptor per chunk, keeping ``in_flight`` WRITEs
outstanding. Each WRITE carries a notification naming its chunk. The receiver checks every
byte against a pattern derived from the seed, so a benchmark that is fast but wrong fails.

The descriptor lists are prepared once (``prep_xfer_dlist``) and each chunk is posted with
``make_prepped_xfer``, the cheapest per-post path NIXL offers (see docs/nixl-notes.md), so the
baseline is the best a hand-written NIXL user gets on this machine.

Usage::

    python -m kvxferd.bench.raw_nixl --total 512MiB --chunk 4MiB --in-flight 16
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxferd.config import ConfigError, parse_size
from kvxferd.transports.nixl import apply_ucx_env_defaults

logger = logging.getLogger(__name__)

# The pattern is generated and checked in blocks so neither side holds a second copy of the data.
_PATTERN_BLOCK = 16 << 20
_CHUNK_TAG = b"raw-chunk "
_WARMUP_TAG = b"raw-warmup"
# The child's own timeout is a little longer than the parent's so that, on a timeout, the parent
# reports it (with context) rather than finding a child that gave up first.
_CHILD_GRACE_S = 5.0


class RawNixlError(RuntimeError):
    """The baseline run failed: a NIXL error, a timeout, or a byte mismatch."""


def pattern_blocks(seed: int, total: int) -> Any:
    """Yields (offset, uint8 array) covering [0, total): bytes derived from seed and position."""
    gen = np.random.PCG64(seed)
    off = 0
    while off < total:
        n = min(_PATTERN_BLOCK, total - off)
        words = gen.random_raw((n + 7) // 8)
        yield off, words.view(np.uint8)[:n]
        off += n


def _make_agent(name: str, progress_thread: bool) -> Any:
    # Imported here: the parent only needs NIXL once it starts, and a failed import should be
    # reported as a run failure, not an import error of the module.
    from kvxferd.transports.nixl import nixl_api

    api = nixl_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RawNixlError("NIXL has no UCX backend on this machine")
    return agent


def _receiver(conn: Connection, total: int, num_chunks: int, seed: int, progress_thread: bool,
              timeout_s: float) -> None:
    """Child process: owns the destination buffer, counts notifications, verifies the bytes."""
    parent = os.getppid()
    deadline = time.monotonic() + timeout_s + _CHILD_GRACE_S
    try:
        agent = _make_agent(f"raw-nixl-rx-{os.getpid()}", progress_thread)
        buf = np.empty(total, dtype=np.uint8)
        buf.fill(0)  # fault the pages in now: the benchmark measures NIXL, not first-touch faults
        agent.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM")
        conn.send(("ready", agent.get_agent_metadata(), buf.ctypes.data))
        seen: set[int] = set()
        last_notif = 0.0
        sender_done = False
        while not (sender_done and len(seen) == num_chunks):
            got = False
            for msgs in agent.get_new_notifs().values():
                for msg in msgs:
                    got = True
                    if msg.startswith(_CHUNK_TAG):
                        seen.add(int(msg[len(_CHUNK_TAG):]))
                        last_notif = time.monotonic()
            if conn.poll():
                cmd = conn.recv()
                if cmd[0] == "abort":
                    return
                sender_done = True
            if time.monotonic() > deadline:
                conn.send(("error", f"receiver timed out: {len(seen)} of {num_chunks} notifications arrived"))
                return
            if os.getppid() != parent:
                return  # the parent died: nobody is listening
            if not got:
                # Polling in a tight loop would take a core from the sender on small machines.
                time.sleep(0.0001)
        t_verify = time.monotonic()
        bad = -1
        for off, want in pattern_blocks(seed, total):
            have = buf[off:off + len(want)]
            if not np.array_equal(have, want):
                bad = off + int(np.flatnonzero(have != want)[0])
                break
        conn.send(("result", {"first_bad_byte": bad, "notifs": len(seen), "last_notif": last_notif,
                              "verify_seconds": time.monotonic() - t_verify}))
    except Exception as exc:  # reported to the parent, which raises it
        try:
            conn.send(("error", f"receiver failed: {type(exc).__name__}: {exc}"))
        except OSError:
            pass


def _recv(conn: Connection, proc: Any, deadline: float, what: str) -> tuple[Any, ...]:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RawNixlError(f"timed out waiting for the receiver ({what})")
        if conn.poll(min(left, 0.2)):
            try:
                msg: tuple[Any, ...] = conn.recv()
            except EOFError:
                raise RawNixlError(f"receiver exited (code {proc.exitcode}) while {what}") from None
            if msg[0] == "error":
                raise RawNixlError(str(msg[1]))
            return msg
        if not proc.is_alive():
            raise RawNixlError(f"receiver exited (code {proc.exitcode}) while {what}")


def _stop_child(proc: Any, conn: Connection) -> None:
    """Makes sure the child is gone: ask, then terminate, then kill."""
    if proc.is_alive():
        try:
            conn.send(("abort",))
        except OSError:
            pass
        proc.join(2.0)
    if proc.is_alive():
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)


def _wait_done(agent: Any, handle: Any, deadline: float) -> None:
    state = agent.transfer(handle)
    while state == "PROC":
        if time.monotonic() > deadline:
            raise RawNixlError("timed out waiting for the warm-up WRITE")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RawNixlError(f"warm-up WRITE ended in {state}")


def run_raw_nixl(total_bytes: int, chunk_bytes: int, in_flight: int, progress_thread: bool = False,
                 timeout_s: float = 120, seed: int = 1234) -> dict[str, Any]:
    """Moves total_bytes to a receiver process, one WRITE per chunk; returns throughput.

    Raises RawNixlError on any failure (NIXL error, timeout, wrong bytes); the receiver
    process is always gone when this returns or raises.
    """
    if total_bytes <= 0 or chunk_bytes <= 0 or in_flight <= 0:
        raise ValueError("total_bytes, chunk_bytes and in_flight must be positive")
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    chunk_bytes = min(chunk_bytes, total_bytes)
    num_chunks = -(-total_bytes // chunk_bytes)
    deadline = time.monotonic() + timeout_s
    apply_ucx_env_defaults()  # before any agent exists; the child inherits the environment

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver, args=(child_conn, total_bytes, num_chunks, seed, progress_thread, timeout_s),
        name="raw-nixl-receiver", daemon=True,
    )
    proc.start()
    child_conn.close()
    agent = None
    handles: deque[Any] = deque()
    try:
        agent = _make_agent(f"raw-nixl-tx-{os.getpid()}", progress_thread)
        src = np.empty(total_bytes, dtype=np.uint8)
        for off, block in pattern_blocks(seed, total_bytes):
            src[off:off + len(block)] = block
        agent.register_memory([(src.ctypes.data, total_bytes, 0, "")], "DRAM")
        _, metadata, dst = _recv(conn, proc, deadline, "starting")
        remote = agent.add_remote_agent(metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote

        spans = [(i * chunk_bytes, min(chunk_bytes, total_bytes - i * chunk_bytes)) for i in range(num_chunks)]
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + o, n, 0) for o, n in spans], "DRAM")
        far = agent.prep_xfer_dlist(remote, [(dst + o, n, 0) for o, n in spans], "DRAM")

        # Connection set-up (UCX wire-up) happens on the first WRITE; keep it out of the timing.
        warm = agent.make_prepped_xfer("WRITE", local, [0], far, [0], _WARMUP_TAG)
        _wait_done(agent, warm, deadline)
        warm.release()

        next_chunk = 0
        cpu0 = time.process_time()  # all threads of this process, NIXL's progress thread included
        t0 = time.monotonic()
        while next_chunk < num_chunks or handles:
            while next_chunk < num_chunks and len(handles) < in_flight:
                h = agent.make_prepped_xfer("WRITE", local, [next_chunk], far, [next_chunk],
                                            _CHUNK_TAG + str(next_chunk).encode())
                state = agent.transfer(h)
                if state == "ERR":
                    raise RawNixlError(f"posting chunk {next_chunk} failed")
                handles.append(h)
                next_chunk += 1
            for _ in range(len(handles)):
                h = handles.popleft()
                state = agent.check_xfer_state(h)
                if state == "DONE":
                    h.release()
                elif state == "PROC":
                    handles.append(h)
                else:
                    raise RawNixlError(f"a WRITE ended in {state}")
            if time.monotonic() > deadline:
                raise RawNixlError(f"timed out after {next_chunk} of {num_chunks} chunks were posted")
        seconds = time.monotonic() - t0
        sender_cpu = time.process_time() - cpu0

        conn.send(("done",))
        _, result = _recv(conn, proc, deadline, "verifying")
        if result["notifs"] != num_chunks:
            raise RawNixlError(f"{result['notifs']} notifications for {num_chunks} chunks")
        if result["first_bad_byte"] >= 0:
            raise RawNixlError(f"byte {result['first_bad_byte']} differs at the receiver")
        local.release()
        far.release()
        return {
            "bytes": total_bytes,
            "seconds": seconds,
            "gbps": total_bytes / seconds / 1e9,
            "verified": True,
            "chunk_bytes": chunk_bytes,
            "in_flight": in_flight,
            "chunks": num_chunks,
            "progress_thread": progress_thread,
            # When the last notification was seen by the receiver, from the first post (same clock).
            "landed_seconds": result["last_notif"] - t0,
            # CPU seconds the sender burnt while moving the bytes: unlike wall time, this barely
            # depends on what else the machine runs.
            "sender_cpu_seconds": sender_cpu,
        }
    except RawNixlError:
        raise
    except Exception as exc:
        raise RawNixlError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for h in handles:
            try:
                h.release()
            except Exception:  # an in-flight WRITE that cannot be cancelled; the process is ending it anyway
                logger.debug("release of an unfinished WRITE failed", exc_info=True)
        _stop_child(proc, conn)
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvxferd.bench.raw_nixl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", default="512MiB", help="bytes to move (e.g. 512MiB)")
    parser.add_argument("--chunk", default="4MiB", help="bytes per WRITE (one descriptor)")
    parser.add_argument("--in-flight", type=int, default=16, help="WRITEs kept outstanding")
    parser.add_argument("--progress-thread", action="store_true", help="enable the NIXL progress thread on both agents")
    parser.add_argument("--repeat", type=int, default=1, help="runs; each is printed")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run before it is abandoned")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    try:
        total, chunk = parse_size(args.total), parse_size(args.chunk)
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for _ in range(args.repeat):
        try:
            res = run_raw_nixl(total, chunk, args.in_flight, args.progress_thread, args.timeout, args.seed)
        except (RawNixlError, ValueError) as exc:
            print(f"raw_nixl: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
