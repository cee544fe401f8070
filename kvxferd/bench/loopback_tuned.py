"""The tuned raw pair of ``kvxferd bench loopback``: raw NIXL at its best on this node, the
baseline kvxferd is held to, and the memcpy ceiling under it.

Why a second raw pair: the one-thread pair (:mod:`~kvxferd.bench.loopback_raw`) is what an engine
that embeds NIXL does, but over CMA each UCX worker copies on its posting thread at about one
core's speed, so a daemon with N transfer threads beat it by ~N x and the ratio said nothing about
kvxferd's own cost (issue #38: "3.0x raw NIXL" at 4 workers was 0.94 of raw NIXL with 4). Here:

* the NIXL agent has the daemon's number of UCX workers (``num_workers``, thread-safe agent) and
  the initiator posts from as many threads, each bound to its own worker (NIXL hands each posting
  thread the next worker in turn), as :mod:`kvxferd.datapath.workers` does;
* both buffers are host pools made the way the daemons make theirs (:class:`kvxferd.buffers.host_pool.HostPool`,
  the default ``auto`` backing: huge pages where the daemon gets them), prefaulted;
* the memcpy ceiling: the same threads copying the same chunks between two such pools in the
  initiator, the same closed loop of rooms, stamps and the same byte check.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxferd.bench.loopback_raw import (
    ClosedLoop,
    NixlSide,
    RawSpec,
    fill_pattern,
    post_loop,
    raw_check,
    raw_plan,
    serve_side,
)
from kvxferd.buffers.host_pool import HostPool


def _pool(nbytes: int, tag: str) -> tuple[HostPool, np.ndarray]:
    pool = HostPool("/dev/shm", nbytes, tag, backing="auto")
    pool.prefault()  # the daemons prefault theirs: first-touch faults stay out of both
    return pool, np.frombuffer(pool.view(0, nbytes), dtype=np.uint8)


class TunedNixlSide(NixlSide):
    """A NIXL agent with `workers` UCX workers over a host pool like the daemon's."""

    def __init__(self, name: str, nbytes: int, fill: bool, workers: int) -> None:
        from kvxferd.transports.nixl import apply_ucx_env_defaults, nixl_api

        apply_ucx_env_defaults()  # the UCX environment the daemons run with
        api = nixl_api()
        # The daemon's agent settings (kvxferd.transports.nixl): thread-safe, one UCX worker per poster.
        self.agent = api.nixl_agent(name, api.nixl_agent_config(
            enable_prog_thread=False, backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW))
        self.agent.create_backend("UCX", {"num_workers": str(workers)})
        self.pool, self.buf = _pool(nbytes, f"bench-tuned-{os.getpid()}")
        if fill:
            fill_pattern(self.buf)
        self.addr = self.pool.base_addr
        self.agent.register_memory([(self.addr, nbytes, 0, "")], "DRAM")
        self.remote = ""
        self.raddr = 0
        self.workers = workers
        self.scratch: np.ndarray | None = None
        self._scratch_pool: HostPool | None = None

    def info(self) -> dict[str, Any]:
        return {**super().info(), "workers": self.workers, "backing": self.pool.backing,
                "page_size": self.pool.page_size, "huge_bytes": self.pool.huge_bytes()}

    def scratch_buffer(self) -> np.ndarray:
        """The memcpy ceiling's destination: a second pool of the same kind, made on first use."""
        if self.scratch is None:
            self._scratch_pool, self.scratch = _pool(len(self.buf), f"bench-copy-{os.getpid()}")
        return self.scratch

    def close(self) -> None:
        # A pool that fell back to a named file in /dev/shm is unlinked here (views may keep the mapping).
        for pool in (self.pool, self._scratch_pool):
            if pool is not None:
                pool.close()


class _Copier:
    """A 'transport' whose post is a memcpy from the source pool into the scratch pool."""

    def __init__(self, side: TunedNixlSide) -> None:
        self.src = side.addr
        self.dst = int(side.scratch_buffer().ctypes.data)

    def post(self, src: int, dst: int, length: int, descs: Any, notif: bytes) -> Any:
        ctypes.memmove(self.dst + dst, self.src + src, length)  # ctypes drops the GIL for the call
        return None

    def check(self, h: Any) -> int:
        return 1

    def release(self, h: Any) -> None:
        pass


def tuned_run(side: TunedNixlSide, spec: RawSpec, threads: int, copy: bool) -> dict[str, Any]:
    """The initiator: `threads` posting threads over one closed loop (copy: memcpy into the scratch pool)."""
    if spec.desc != "chunk":
        raise ValueError("the tuned pair posts one descriptor per chunk")
    rp = raw_plan(spec)
    loop = ClosedLoop(spec, side.buf, rp)
    poster = _Copier(side) if copy else side
    # Each thread keeps its share of the window in flight (over CMA a post returns once copied).
    most = max(1, -(-spec.slots // threads))
    deadline = time.monotonic() + spec.timeout_s
    pool = [threading.Thread(target=post_loop, args=(poster, loop, most, deadline),
                             name=f"bench-post-{i}", daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return loop.result()


def tuned_entry(conn: Connection, role: str, nbytes: int, workers: int, log_path: str) -> None:
    serve_side(conn, log_path, lambda: TunedNixlSide(f"bench-tuned-{role}-{os.getpid()}", nbytes,
                                                     role == "initiator", workers), {
        "run": lambda side, msg: tuned_run(side, msg[1], workers, copy=False),
        "copy": lambda side, msg: tuned_run(side, msg[1], workers, copy=True),
        "copy_check": lambda side, msg: raw_check(side.scratch_buffer(), msg[1], msg[2]),
    })
