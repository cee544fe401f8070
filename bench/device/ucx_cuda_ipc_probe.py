"""Why UCX does not use CUDA IPC between two daemons on one host (issue #38; device diagnostic).

Two processes, each a kvxferd NixlTransport (NIXL agent, UCX backend, the daemon's UCX env), WRITE
VRAM to VRAM. Variants, each in fresh processes:
  own: each side registers memory it cudaMalloc'd itself (what UCX's cuda_ipc transport can export:
       its memory registration calls cuIpcGetMemHandle on the range);
  ipc: each side registers a range another process exported and it imported with
       cudaIpcOpenMemHandle (the daemon's GPU-ring case: the engine owns the allocation).
and GPU 0 -> GPU 0 / GPU 0 -> GPU 1. Also tries cudaIpcGetMemHandle on an imported range (can
imported memory be re-exported at all?). Prints one JSON line per variant with GB/s, byte-exactness
and the UCX protocol lines that name the transport (UCX_PROTO_INFO=y), and writes them to argv[1].
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from typing import Any

SIZE = 64 << 20


def torch_copy_gbps(sd: int, dd: int, reps: int = 20) -> float:
    """SIZE bytes GPU sd -> GPU dd between tensors of this process (cudaMemcpyPeerAsync across GPUs)."""
    import torch

    a = torch.empty(SIZE, dtype=torch.uint8, device=f"cuda:{sd}")
    b = torch.empty(SIZE, dtype=torch.uint8, device=f"cuda:{dd}")
    b.copy_(a)
    torch.cuda.synchronize(sd)
    torch.cuda.synchronize(dd)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize(sd)
    torch.cuda.synchronize(dd)
    return round(SIZE * reps / (time.perf_counter() - t0) / 1e9, 3)


def _run_child(ctx: Any, target: Any, handles: dict[int, Any]) -> dict[str, Any]:
    a_conn, b_conn = ctx.Pipe()
    p = ctx.Process(target=target, args=(handles, b_conn))
    p.start()
    got: dict[str, Any] = a_conn.recv() if a_conn.poll(120) else {"error": "no answer"}
    p.join(30)
    return got


def _redirect(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def _memory(kind: str, device: int, handle: Any, fill: bool) -> tuple[Any, int, Any]:
    """(keep-alive object, pointer, uint8 tensor view) of SIZE bytes on `device`."""
    import torch

    from kvxfer_protocol import cuda_ipc

    if kind == "own":
        t = torch.zeros(SIZE, dtype=torch.uint8, device=f"cuda:{device}")
        keep: Any = t
    else:
        keep = cuda_ipc.open_handle(handle)
        t = keep.as_tensor()
    if fill:
        t.copy_(torch.arange(SIZE, device=t.device, dtype=torch.int64).remainder_(251).to(torch.uint8))
        torch.cuda.synchronize(t.device)
    return keep, t.data_ptr(), t


def child(role: str, kind: str, device: int, handle: Any, conn: Any, log: str) -> None:
    _redirect(log)
    out: dict[str, Any] = {}
    try:
        from kvxferd.transports.interface import XferState
        from kvxferd.transports.nixl import NixlTransport

        tr = NixlTransport(f"probe-{role}")
        import torch

        keep, ptr, view = _memory(kind, device, handle, fill=role == "src")
        tr.register_region(ptr, SIZE, "VRAM", device)
        if kind == "ipc":
            from kvxfer_protocol import cuda_ipc

            libs = cuda_ipc._load()
            h = cuda_ipc._IpcMemHandle()
            rc = libs.cudart.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(keep._base))
            out["reexport_imported"] = "ok" if rc == 0 else f"CUDA error {rc} ({libs.cudart.cudaGetErrorString(rc).decode()})"
            libs.cudart.cudaGetLastError()
        conn.send((tr.metadata(), ptr, device))
        if role == "dst":
            # Progress UCX here until the source is done: over TCP the receiving worker must run.
            while not conn.poll(0.0005):
                tr.get_notifs()
            conn.recv()
            want = torch.arange(SIZE, device=view.device, dtype=torch.int64).remainder_(251).to(torch.uint8)
            out["byte_exact"] = bool(torch.equal(view, want))
        else:
            md, rptr, rdev = conn.recv()
            name = tr.add_remote(md)
            reps, t0 = 0, time.perf_counter()
            while reps < 20 and (reps < 2 or time.perf_counter() - t0 < 2.0):
                xh = tr.post_write(name, [(ptr, rptr, SIZE)], b"probe", "VRAM", "VRAM", device, rdev)
                while tr.check(xh) is XferState.PENDING:
                    time.sleep(0.0001)
                assert tr.check(xh) is XferState.DONE, xh.error
                tr.release(xh)
                reps += 1
                if reps == 1:
                    t0 = time.perf_counter()  # the first WRITE sets the connection up: not timed
            out["gb_per_s"] = round(SIZE * (reps - 1) / (time.perf_counter() - t0) / 1e9, 3)
            out["timed_writes"] = reps - 1
        tr.close()
        del keep
    except Exception:
        out["error"] = traceback.format_exc()[-1500:]
    conn.send(out)


def run(kind: str, src_dev: int, dst_dev: int, handles: dict[int, Any], tmp: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    logs = {r: os.path.join(tmp, f"{kind}-{src_dev}{dst_dev}-{r}.log") for r in ("src", "dst")}
    a_src, b_src = ctx.Pipe()
    a_dst, b_dst = ctx.Pipe()
    hs = handles.get(src_dev * 10 + src_dev) if kind == "ipc" else None
    hd = handles.get(dst_dev * 10 + dst_dev + 100) if kind == "ipc" else None
    ps = [ctx.Process(target=child, args=("src", kind, src_dev, hs, b_src, logs["src"])),
          ctx.Process(target=child, args=("dst", kind, dst_dev, hd, b_dst, logs["dst"]))]
    for p in ps:
        p.start()
    res: dict[str, Any] = {"memory": kind, "gpus": f"{src_dev}->{dst_dev}", "bytes": SIZE}
    try:
        got = {}
        for role, conn in (("src", a_src), ("dst", a_dst)):
            if not conn.poll(60):
                raise TimeoutError(f"{role} never got ready")
            got[role] = conn.recv()
            if isinstance(got[role], dict):  # it failed before it was ready
                res[role] = got[role]
                return res
        a_src.send(got["dst"])
        if not a_src.poll(45):
            raise TimeoutError("the WRITEs never finished")
        res["src"] = a_src.recv()
        a_dst.send("done")
        res["dst"] = a_dst.recv() if a_dst.poll(60) else {"error": "no verdict"}
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
        lines = []
        for log in logs.values():
            with open(log, errors="replace") as fh:
                # UCX_PROTO_INFO tables: a header naming the operation and memory types, then rows.
                lines += [ln.split("]", 2)[-1].strip() for ln in fh if "|" in ln or "ucp_" in ln.lower()]
        lines = [ln for ln in lines if ln.strip("|-+ ")]
        keep, on = [], False
        for ln in lines:  # the tables whose operation moves cuda memory, header and rows
            if "memory" in ln and ("ucp_" in ln):
                on = "cuda" in ln
            if on:
                keep.append(ln)
        res["ucx_proto_lines"] = keep[:60]
    return res


def copy_child(handles: dict[int, Any], conn: Any) -> None:
    """The daemon's same-node copy (kvxferd.buffers.gpu_rings.device_copies) between rings imported by CUDA IPC,
    against a device copy between tensors of this process (torch: cudaMemcpyPeerAsync across GPUs)."""
    out: dict[str, Any] = {}
    try:
        import torch

        from kvxfer_protocol import cuda_ipc
        from kvxferd.buffers.gpu_rings import device_copies, peer_views

        rings = {k: cuda_ipc.open_handle(h) for k, h in handles.items()}
        for k, m in rings.items():  # as the daemon's importer does
            peer_views.add(m.ptr, m.size, handles[k], m.device_index)
        for name, (sk, dk, sd, dd) in {"0->0": (0, 100, 0, 0), "0->1": (0, 111, 0, 1)}.items():
            if dk not in rings:
                continue
            src, dst = rings[sk], rings[dk]
            src.as_tensor().copy_(torch.arange(SIZE, device=f"cuda:{sd}", dtype=torch.int64).remainder_(253)
                                  .to(torch.uint8))
            torch.cuda.synchronize(sd)
            row: dict[str, Any] = {}
            for parts in (1, 4):
                n = SIZE // parts
                pairs = [(src.ptr + i * n, dst.ptr + i * n, n) for i in range(parts)]
                link = device_copies(pairs, "VRAM", sd, "VRAM", dd)
                t0 = time.perf_counter()
                for _ in range(20):
                    device_copies(pairs, "VRAM", sd, "VRAM", dd)
                row[f"kvxferd_{parts}_pairs_gb_per_s"] = round(SIZE * 20 / (time.perf_counter() - t0) / 1e9, 3)
                row["link"] = link
            row["byte_exact"] = bool(torch.equal(src.as_tensor().to(f"cuda:{dd}"), dst.as_tensor()))
            row["torch_copy_gb_per_s"] = torch_copy_gbps(sd, dd)
            row["ratio_1_pair"] = round(row["kvxferd_1_pairs_gb_per_s"] / row["torch_copy_gb_per_s"], 3)
            out[name] = row
        for m in rings.values():
            peer_views.remove(m.ptr)
            m.close()
    except Exception:
        out["error"] = traceback.format_exc()[-1500:]
    conn.send(out)


def copy_variants(handles: dict[int, Any], conn: Any) -> None:
    """GPU 0 ring -> GPU 1 ring, both imported by CUDA IPC, 64 MiB x 20 each way of issuing the copy:
    push (cudaMemcpyAsync on GPU 0's stream: kvxferd's form), pull (on GPU 1's stream),
    cudaMemcpyPeerAsync, and the GPU 1 ring opened a second time with GPU 0 current (a peer
    mapping in GPU 0's context) then pushed."""
    out: dict[str, Any] = {}
    try:
        import torch

        from kvxfer_protocol import cuda_ipc
        from kvxferd.buffers.gpu_rings import peer_access

        libs = cuda_ipc._load()
        rt = libs.cudart
        src, dst = cuda_ipc.open_handle(handles[0]), cuda_ipc.open_handle(handles[111])
        peer_access.link("VRAM", 0, "VRAM", 1)

        def timed(name: str, dev: int, issue: Any) -> None:
            try:
                with cuda_ipc._OnDevice(libs, dev):
                    stream = ctypes.c_void_p()
                    libs.check(rt.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "stream")
                    issue(stream)
                    libs.check(rt.cudaStreamSynchronize(stream), "sync")
                    t0 = time.perf_counter()
                    for _ in range(20):
                        issue(stream)
                    libs.check(rt.cudaStreamSynchronize(stream), "sync")
                    out[name] = round(SIZE * 20 / (time.perf_counter() - t0) / 1e9, 3)
            except Exception as exc:
                out[name] = f"{type(exc).__name__}: {exc}"

        def memcpy(d: int, s_: int) -> Any:
            return lambda st: libs.check(rt.cudaMemcpyAsync(ctypes.c_void_p(d), ctypes.c_void_p(s_),
                                                            ctypes.c_size_t(SIZE), 4, st), "cudaMemcpyAsync")

        timed("push_src_stream", 0, memcpy(dst.ptr, src.ptr))
        timed("pull_dst_stream", 1, memcpy(dst.ptr, src.ptr))
        timed("memcpy_peer_async", 0, lambda st: libs.check(rt.cudaMemcpyPeerAsync(
            ctypes.c_void_p(dst.ptr), 1, ctypes.c_void_p(src.ptr), 0, ctypes.c_size_t(SIZE), st), "cudaMemcpyPeerAsync"))
        # The GPU 1 ring mapped again, GPU 0 current.
        raw = cuda_ipc._IpcMemHandle()
        ctypes.memmove(ctypes.byref(raw), handles[111].handle, cuda_ipc.IPC_HANDLE_BYTES)
        base = ctypes.c_void_p()
        with cuda_ipc._OnDevice(libs, 0):
            rc = rt.cudaIpcOpenMemHandle(ctypes.byref(base), raw, 1)
        out["reopen_on_gpu0"] = "ok" if rc == 0 else f"CUDA error {rc}"
        rt.cudaGetLastError()
        if rc == 0:
            out["reopen_same_pointer"] = base.value == dst.ptr - handles[111].offset
            timed("push_peer_mapping", 0, memcpy(base.value + handles[111].offset, src.ptr))
        t = torch.empty(SIZE, dtype=torch.uint8, device="cuda:0")
        u = torch.empty(SIZE, dtype=torch.uint8, device="cuda:1")
        timed("own_memory_push", 0, memcpy(u.data_ptr(), t.data_ptr()))
        timed("own_to_imported_push", 0, memcpy(dst.ptr, t.data_ptr()))
        timed("imported_to_own_push", 0, memcpy(u.data_ptr(), src.ptr))
    except Exception:
        out["error"] = traceback.format_exc()[-1500:]
    conn.send(out)


def main() -> None:
    os.environ["UCX_PROTO_INFO"] = "y"
    import torch

    from kvxfer_protocol import cuda_ipc

    ngpu = torch.cuda.device_count()
    keep, handles = [], {}
    for dev in range(min(ngpu, 2)):
        for dst in (0, 100):  # one range to write from and one to write into, per GPU
            t = torch.empty(SIZE, dtype=torch.uint8, device=f"cuda:{dev}")
            keep.append(t)
            handles[dev * 10 + dev + dst] = cuda_ipc.export_tensor(t)
    pairs = [(0, 0)] + ([(0, 1)] if ngpu > 1 else [])
    ctx = mp.get_context("spawn")
    copies = _run_child(ctx, copy_child, handles)
    print(json.dumps({"same_node_copies": copies}), flush=True)
    variants: dict[str, Any] = {}
    if ngpu > 1:
        variants = _run_child(ctx, copy_variants, handles)
        print(json.dumps({"cross_gpu_copy_variants": variants}), flush=True)
    if os.environ.get("PROBE_COPIES_ONLY"):
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as fh:
                json.dump({"same_node_copies": copies, "cross_gpu_copy_variants": variants}, fh, indent=1)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("own", "ipc"):
            for s, d in pairs:
                r = run(kind, s, d, handles, tmp)
                print(json.dumps(r), flush=True)
                rows.append(r)
    # Device copies in the same run, for the ratios.
    base = {f"{s}->{d}": torch_copy_gbps(s, d) for s, d in pairs}
    print(json.dumps({"device_copy_gb_per_s": base}), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump({"same_node_copies": copies, "cross_gpu_copy_variants": variants, "variants": rows,
                       "device_copy_gb_per_s": base}, fh, indent=1)


if __name__ == "__main__":
    main()
