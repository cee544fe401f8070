"""The measured paths of ``kvxferd bench loopback``: kvxferd (same and mixed TP, blocking per
chunk), raw NIXL (one descriptor per chunk, per-token descriptors) and Mooncake, each as timed
points and as a byte-by-byte verification pass, in the sweep's fixed order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvxfer_protocol.slot_layout import bytes_per_head, plan, rank_heads
from kvxferd.bench._common import iter_chunks, latency_summary
from kvxferd.bench.loopback_raw import RawSpec, raw_plan
from kvxferd.bench.loopback_setup import EngineGroup, LoopbackRig
from kvxferd.bench.loopback_spec import RoomPlan, RunSpec, Settings


def summarize(admit: Sequence[float], done: Sequence[float], room_bytes: Sequence[int], in_flight: int) -> dict[str, Any]:
    """Throughput over the full pipeline and room latencies (see :mod:`kvxferd.bench.loopback`)."""
    n = len(admit)
    order = sorted(range(n), key=lambda i: done[i])
    # Closed loop: once the first min(N, n/4) rooms are done the pipeline is full. With no more
    # rooms than slots in flight everything starts at once: then the whole span counts.
    warm = max(1, min(in_flight, n // 4)) if n > in_flight else 0
    t_a = done[order[warm - 1]] if warm else min(admit)
    t_b = done[order[-1]]
    steady = sum(room_bytes[i] for i in order[warm:])
    total = sum(room_bytes)
    span = max(t_b - min(admit), 1e-9)
    gbps = steady / max(t_b - t_a, 1e-9) / 1e9 if warm and t_b > t_a else total / span / 1e9
    lat = [done[i] - admit[i] for i in range(n)]
    samples = lat[in_flight:] if n > in_flight else lat
    return {
        "rooms": n,
        "bytes": total,
        "seconds": span,
        "throughput_gbps": gbps,
        "span_gbps": total / span / 1e9,
        "latency_ms": latency_summary(samples),
        "latency_samples_ms": [round(x * 1e3, 3) for x in samples],
    }


class LoopbackBench(LoopbackRig):
    """The measured paths on the rig: timed points, the byte-by-byte verification, the warm-up."""

    def __init__(self, settings: Settings, keep_logs: bool = False, profile_dir: str | None = None,
                 mooncake: bool = True) -> None:
        super().__init__(settings, keep_logs, profile_dir, mooncake)
        self.points: list[dict[str, Any]] = []
        self.verification: list[dict[str, Any]] = []
        self._room = 1

    # ------------------------------------------------------------------ kvxferd points

    def _plans(self, n: int, chunks: Sequence[int]) -> tuple[RoomPlan, ...]:
        out = tuple(RoomPlan(self._room + i, tuple(chunks)) for i in range(n))
        self._room += n
        return out

    def _rooms_for(self, in_flight: int, budget: int, room_bytes: int) -> int:
        return max(math.ceil(budget / room_bytes), self.s.rooms_per_in_flight * in_flight + in_flight, 2)

    def kvx_run(self, g: EngineGroup, plans: tuple[RoomPlan, ...], in_flight: int, mode: str,
                profile: bool = False) -> dict[str, Any]:
        s = self.s
        spec = RunSpec(f"{g.name}/{mode}", plans, in_flight, mode, s.timeout_s, s.enqueue_wait)
        pre = self.daemons["prefill"]
        for d in g.decode:
            d.send("expect", spec, pre.peer_address, f"{g.name}-prefill")
        for d in g.decode:
            d.recv(90)
        keys = ["daemon_prefill", "daemon_decode", *(c.name for c in [*g.prefill, *g.decode])]
        meter = self._meter(keys)
        spies = self._start_profile(g, spec) if profile else []
        meter.start()
        for p in g.prefill:
            p.send("produce", spec)
        for d in g.decode:
            d.send("collect", s.timeout_s)
        pres = [p.recv(s.timeout_s + 60) for p in g.prefill]
        dres = [d.recv(s.timeout_s + 60) for d in g.decode]
        cpu = meter.stop()
        self._stop_profile(spies)
        admit = [min(r["admit"][p.room] for r in pres) for p in plans]
        done = [max(r["done"][p.room] for r in dres) for p in plans]
        errors = [e for r in dres for e in r["errors"]]
        for r in [*pres, *dres]:
            errors += [f"room {k}: {v}" for k, v in r["states"].items() if v != "SUCCESS"][:5]
        tokens = [p.num_tokens for p in plans]
        out = summarize(admit, done, [t * s.shape.bytes_per_token for t in tokens], in_flight)
        out.update({
            "cpu_s": _cpu_groups(cpu),
            "cpu_s_by_thread": meter.threads,
            "acquire_wait_s": max(r["acquire_wait_s"] for r in pres),
            "stamps_checked": sum(r["stamps_checked"] for r in dres),
            "bytes_checked": sum(r["bytes_checked"] for r in dres),
            "errors": errors[:10],
            "ok": not errors,
        })
        return out

    def kvx_point(self, g: EngineGroup, chunk_tokens: int, in_flight: int, mode: str = "stamp",
                  path: str | None = None, profile: bool = False, repeat: int = 0, **extra: Any) -> dict[str, Any]:
        s = self.s
        chunks = tuple(iter_chunks(s.room_tokens, chunk_tokens))
        n = self._rooms_for(in_flight, s.point_bytes, s.room_bytes)
        if mode == "blocking":
            n = max(math.ceil(s.point_bytes / 2 / s.room_bytes), 4)
        out = self.kvx_run(g, self._plans(n, chunks), in_flight, mode, profile)
        return self._record(path or g.path, chunk_tokens, in_flight, out, tp=f"{g.ptp}->{g.dtp}", repeat=repeat,
                            **extra)

    def _record(self, path: str, chunk_tokens: int, in_flight: int, out: dict[str, Any], **extra: Any) -> dict[str, Any]:
        point = {"path": path, "chunk_tokens": chunk_tokens, "chunk_bytes": self.s.chunk_bytes(chunk_tokens),
                 "in_flight": in_flight, **extra, **out}
        if not out.get("ok", False):
            self.failures.append(f"{path} chunk {chunk_tokens} in flight {in_flight}: {out.get('errors')}")
        self.points.append(point)
        return point

    # ------------------------------------------------------------------ raw points

    def raw_spec(self, tag: str, chunk_tokens: int, in_flight: int, rooms: int, full: bool,
                 per_token: tuple[int, int] | None = None) -> RawSpec:
        s = self.s
        cb = s.chunk_bytes(chunk_tokens)
        slot = cb
        slots = max(s.ring_bytes // slot, 1)
        cpr = len(list(iter_chunks(s.room_tokens, chunk_tokens)))
        if s.room_tokens % chunk_tokens:
            raise ValueError("raw paths need room_tokens to be a multiple of every chunk size")
        base = RawSpec(tag=tag, src_slot=slot, dst_slot=slot, slots=slots, rooms=rooms, chunks_per_room=cpr,
                       in_flight=in_flight, full=full, timeout_s=s.timeout_s, chunk_bytes=cb,
                       head_block=bytes_per_head(s.shape.kv_layout(), chunk_tokens))
        if per_token is None:
            return base
        ptp, dtp = per_token
        heads = s.shape.kv_heads
        wh = rank_heads(heads, ptp, 0).count
        slices = tuple((x.reader, x.src_head, x.dst_head, x.num_heads) for x in plan(ptp, dtp, heads) if x.writer == 0)
        bph = bytes_per_head(s.shape.kv_layout(), chunk_tokens)
        readers = sorted({x[0] for x in slices})
        rh_list = []
        off = 0
        for r in readers:
            rh = rank_heads(heads, dtp, r).count
            rh_list.append((r, rh, off))
            off += rh * bph
        return replace(base, desc="per_token", src_slot=wh * bph, dst_slot=off, slots=max(s.ring_bytes // max(off, wh * bph), 1),
                       layers=s.shape.layers, planes=2, tokens=chunk_tokens, head_bytes=s.shape.head_bytes,
                       writer_heads=wh, slices=slices, reader_heads=tuple(rh_list))

    def raw_run(self, backend: str, spec: RawSpec) -> dict[str, Any]:
        ini, tgt = self.raw[backend]
        meter = self._meter([f"{backend}_initiator", f"{backend}_target"])
        tgt.send("begin")
        meter.start()
        res = ini.call("run", spec, timeout=spec.timeout_s + 60)
        cpu = meter.stop()
        tgt.send("end", res["chunks"] if backend.startswith("nixl") else 0)
        notes = tgt.recv(60)
        chk = tgt.call("check", spec, res["last_seq"], timeout=300)
        errors = list(chk["errors"])
        if backend.startswith("nixl") and notes["notifs"] < res["chunks"]:
            errors.append(f"{notes['notifs']}/{res['chunks']} notifications arrived")
        return self._raw_out(spec, res, chk, cpu, errors)

    def _raw_out(self, spec: RawSpec, res: dict[str, Any], chk: dict[str, Any], cpu: dict[str, float],
                 errors: list[str]) -> dict[str, Any]:
        moved = res["moved_per_chunk"] * spec.chunks_per_room
        out = summarize(res["admit"], res["done"], [moved] * spec.rooms, spec.in_flight)
        out.update({"cpu_s": _cpu_groups(cpu), "stamps_checked": chk["stamps_checked"],
                    "bytes_checked": chk["bytes_checked"], "errors": errors[:10], "ok": not errors})
        return out

    def copy_run(self, spec: RawSpec) -> dict[str, Any]:
        """The memcpy ceiling: the tuned initiator's threads copy the chunks between two of its pools."""
        ini, _ = self.raw["nixl_tuned"]
        meter = self._meter(["nixl_tuned_initiator"])
        meter.start()
        res = ini.call("copy", spec, timeout=spec.timeout_s + 60)
        cpu = meter.stop()
        chk = ini.call("copy_check", spec, res["last_seq"], timeout=300)
        return self._raw_out(spec, res, chk, cpu, list(chk["errors"]))

    def copy_point(self, chunk_tokens: int, in_flight: int, repeat: int = 0) -> dict[str, Any]:
        rooms = self._rooms_for(in_flight, self.s.point_bytes, self.s.room_bytes)
        out = self.copy_run(self.raw_spec("memcpy", chunk_tokens, in_flight, rooms, False))
        return self._record("memcpy", chunk_tokens, in_flight, out, threads=self.workers, repeat=repeat)

    def raw_point(self, backend: str, chunk_tokens: int, in_flight: int, path: str,
                  per_token: tuple[int, int] | None = None, budget: int | None = None, repeat: int = 0) -> dict[str, Any]:
        s = self.s
        room_bytes = s.room_bytes
        if per_token is not None:
            spec0 = self.raw_spec(path, chunk_tokens, in_flight, 1, False, per_token)
            room_bytes = raw_plan(spec0).moved * spec0.chunks_per_room
            rooms = max(math.ceil((budget or s.per_token_bytes) / room_bytes), 2)
        else:
            rooms = self._rooms_for(in_flight, budget or s.point_bytes, room_bytes)
            if backend == "mooncake":
                rooms = max(math.ceil((budget or s.mooncake_point_bytes) / room_bytes), 2 * in_flight)
        spec = self.raw_spec(path, chunk_tokens, in_flight, rooms, False, per_token)
        out = self.raw_run(backend, spec)
        extra: dict[str, Any] = {"repeat": repeat}
        if backend == "nixl_tuned":
            extra["threads"] = self.workers
        if per_token is not None:
            rp = raw_plan(spec)
            extra = {"tp": f"{per_token[0]}->{per_token[1]}", "descriptors_per_chunk": len(rp.stamp_src),
                     "descriptor_bytes": int(rp.descs[0, 2]) if rp.descs is not None else 0, "repeat": repeat}
        return self._record(path, chunk_tokens, in_flight, out, **extra)

    # ------------------------------------------------------------------ verification, warm-up

    def verify(self, status: Callable[[str], None]) -> None:
        """Every byte compared with the pattern, per path (ragged chunks for kvxferd)."""
        s = self.s
        ragged = _ragged_chunks(s.room_tokens, s.shape.page_size)
        for (ptp, dtp), g in self.groups.items():
            status(f"verify every byte: kvxferd TP {ptp}→{dtp}")
            out = self.kvx_run(g, self._plans(3, ragged), 2, "full")
            self._verified(g.path, out, chunks=list(ragged))
        status("verify every byte: raw NIXL")
        out = self.raw_run("nixl", self.raw_spec("verify", s.headline_chunk, 2, 3, True))
        self._verified("raw_nixl", out)
        status(f"verify every byte: raw NIXL, tuned ({self.workers} threads), and memcpy")
        # More rooms than threads: every posting thread moves some.
        rooms = max(3, self.workers)
        out = self.raw_run("nixl_tuned", self.raw_spec("verify", s.headline_chunk, self.workers, rooms, True))
        self._verified("raw_nixl_tuned", out)
        out = self.copy_run(self.raw_spec("verify", s.headline_chunk, self.workers, rooms, True))
        self._verified("memcpy", out)
        for ptp, dtp in s.mixed_tp:
            status(f"verify every byte: per-token TP {ptp}→{dtp}")
            out = self.raw_run("nixl", self.raw_spec("verify", s.headline_chunk, 2, 2, True, (ptp, dtp)))
            self._verified(f"per_token_tp{ptp}to{dtp}", out)
        if "mooncake" in self.raw:
            status("verify every byte: Mooncake")
            out = self.raw_run("mooncake", self.raw_spec("verify", s.headline_chunk, 2, 3, True))
            self._verified("mooncake_tcp", out)

    def _verified(self, path: str, out: dict[str, Any], **extra: Any) -> None:
        rec = {"path": path, "rooms": out["rooms"], "bytes_checked": out["bytes_checked"],
               "ok": out["ok"] and out["bytes_checked"] > 0, "errors": out["errors"], **extra}
        if not rec["ok"]:
            self.failures.append(f"verification {path}: {out['errors'] or 'no bytes checked'}")
        self.verification.append(rec)

    def warm_up(self, status: Callable[[str], None]) -> None:
        """Touches every ring page through the real path, so page faults stay out of the timings."""
        s = self.s
        if s.quick:
            return  # small rings: first-touch faults are noise next to what --quick can resolve
        for (ptp, dtp), g in self.groups.items():
            status(f"warm-up: kvxferd TP {ptp}→{dtp}")
            n = max(math.ceil(1.5 * s.ring_bytes / s.room_bytes), 4)
            self.kvx_run(g, self._plans(n, tuple(iter_chunks(s.room_tokens, max(s.chunk_tokens)))),
                         s.headline_concurrency, "stamp")
        spec = self.raw_spec("warm-up", s.headline_chunk, s.headline_concurrency,
                             max(2, math.ceil(s.ring_bytes / s.room_bytes)), False)
        for backend in self.raw:
            status(f"warm-up: {backend}")
            self.raw_run(backend, spec)
        status("warm-up: memcpy")
        self.copy_run(spec)


def _cpu_groups(cpu: dict[str, float]) -> dict[str, float]:
    """Per-process CPU seconds folded into roles (engines summed per side)."""
    out: dict[str, float] = {}
    for k, v in cpu.items():
        if k.startswith("_"):
            out[k] = v
            continue
        key = k
        if "-prefill" in k:
            key = "engines_prefill"
        elif "-decode" in k:
            key = "engines_decode"
        out[key] = round(out.get(key, 0.0) + v, 4)
    return out


def _ragged_chunks(room_tokens: int, page: int) -> tuple[int, ...]:
    """Chunk sizes of one room that are not page multiples (and a 1-token chunk)."""
    sizes = [max(1, page + 1), 1, max(1, 2 * page - 3)]
    out: list[int] = []
    left = room_tokens
    i = 0
    while left > 0:
        n = min(sizes[i % len(sizes)], left)
        out.append(n)
        left -= n
        i += 1
    return tuple(out)


def _run_tag(rep: int, reps: int) -> str:
    """How the progress line names a repeated point's run ("" when it runs once)."""
    return f" (run {rep + 1}/{reps})" if reps > 1 else ""


def run_sweep(bench: LoopbackBench, progress: Callable[[str, bool], None]) -> None:
    """Points in a fixed order; each (chunk, in flight) point runs raw NIXL (one thread, then tuned),
    the memcpy ceiling (at the headline concurrency), kvxferd and Mooncake back to back."""
    s = bench.s
    same = bench.groups[(1, 1)]
    for chunk in s.chunk_tokens:
        for conc in s.concurrency:
            headline = chunk == s.headline_chunk and conc == s.headline_concurrency
            # Every chunk size's ratio to raw NIXL is a target: each is a median of interleaved runs,
            # not one run that a passing burst of load can sink.
            reps = s.headline_repeats if conc == s.headline_concurrency else 1
            for rep in range(reps):
                tag = _run_tag(rep, reps)
                progress(f"raw NIXL      chunk {chunk} tok, {conc} in flight{tag}", False)
                bench.raw_point("nixl", chunk, conc, "raw_nixl", repeat=rep)
                progress(f"raw NIXL, {bench.workers} thr chunk {chunk} tok, {conc} in flight{tag}", False)
                bench.raw_point("nixl_tuned", chunk, conc, "raw_nixl_tuned", repeat=rep)
                if conc == s.headline_concurrency:
                    progress(f"memcpy, {bench.workers} thr  chunk {chunk} tok, {conc} in flight{tag}", False)
                    bench.copy_point(chunk, conc, repeat=rep)
                progress(f"kvxferd       chunk {chunk} tok, {conc} in flight{tag}", False)
                bench.kvx_point(same, chunk, conc, profile=bool(bench.profile_dir) and headline and rep == 0,
                                repeat=rep)
                if "mooncake" in bench.raw:
                    progress(f"Mooncake TCP  chunk {chunk} tok, {conc} in flight{tag}", False)
                    bench.raw_point("mooncake", chunk, conc, "mooncake_tcp", repeat=rep)
            progress("", True)
    for chunk in s.chunk_tokens:
        progress(f"blocking per chunk, chunk {chunk} tok", False)
        bench.kvx_point(same, chunk, 1, mode="blocking", path="blocking")
        progress("", True)
    # Mixed TP runs right after a same-TP run of the same point, and the per-token path right
    # after its mixed-TP run: each ratio compares runs that saw the same machine (a shared
    # machine's load drifts over minutes). The rounds repeat, interleaved; the report takes the
    # median of the rounds' ratios.
    hc = s.headline_concurrency
    for chunk in s.chunk_tokens:
        reps = s.headline_repeats
        for rep in range(reps):
            tag = _run_tag(rep, reps)
            progress(f"kvxferd TP 1→1 (reference) chunk {chunk} tok, {hc} in flight{tag}", False)
            ref = bench.kvx_point(same, chunk, hc, path="kvxferd_same_tp_ref", repeat=rep)
            for ptp, dtp in s.mixed_tp:
                g = bench.groups[(ptp, dtp)]
                progress(f"kvxferd TP {ptp}→{dtp} chunk {chunk} tok, {hc} in flight{tag}", False)
                bench.kvx_point(g, chunk, hc, same_tp_ref_gbps=ref["throughput_gbps"], repeat=rep,
                                profile=bool(bench.profile_dir) and chunk == s.headline_chunk and rep == 0)
                if chunk == s.headline_chunk and rep == 0:
                    progress(f"per-token descriptors TP {ptp}→{dtp}", False)
                    bench.raw_point("nixl", chunk, hc, f"per_token_tp{ptp}to{dtp}", per_token=(ptp, dtp))
        progress("", True)


def sweep_steps(s: Settings, mooncake: bool) -> int:
    return len(s.chunk_tokens) * len(s.concurrency) + 2 * len(s.chunk_tokens)


def reference_raw_nixl(s: Settings) -> dict[str, Any]:
    """The project's raw two-process NIXL baseline (kvxferd.bench.raw_nixl), as a cross-check."""
    try:
        from kvxferd.bench import raw_nixl  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        return {"available": False, "reason": f"kvxferd.bench.raw_nixl not importable: {exc}"}
    try:
        cb = s.chunk_bytes(s.headline_chunk)
        total = max(cb * 16, min(s.point_bytes, 2 << 30)) // cb * cb
        out = raw_nixl.run_raw_nixl(total, cb, s.headline_concurrency)
        return {"available": True, "total_bytes": total, "chunk_bytes": cb, "in_flight": s.headline_concurrency,
                "result": out}
    except Exception as exc:
        return {"available": False, "reason": f"run_raw_nixl failed: {exc!r}"[:500]}
