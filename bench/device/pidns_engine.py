"""One engine process for bench/device/pidns_cuda_ipc.sh: a prefill and a decode engine whose staging
rings are CUDA tensors the daemons import by CUDA IPC (cudaIpcGetMemHandle here, cudaIpcOpenMemHandle
in the daemon, which may sit in another PID namespace). One room of random bytes goes from the
prefill ring through the prefill daemon and NIXL to the decode daemon and into the decode ring;
the bytes that land are compared with the bytes sent, on the GPU.

argv: prefill daemon socket, decode daemon socket, JSON file to write. Prints the same JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from kvxfer_client import DecodeReceiver, Layout, PrefillSender, RoomState

DEVICE = "cuda:0"
RING = 16 << 20
TOKENS = 509  # not a page multiple: the last page is partial
ROOM = 41


def _ns(kind: str) -> str:
    return os.readlink(f"/proc/self/ns/{kind}")


def move_one_room(tx_sock: str, rx_sock: str) -> dict[str, object]:
    layout = Layout(num_layers=8, total_kv_heads=8, head_dim=128, dtype_bytes=2, page_size=16)
    tx_ring = torch.zeros(RING, dtype=torch.uint8, device=DEVICE)
    rx_ring = torch.full((RING,), 0xAB, dtype=torch.uint8, device=DEVICE)
    torch.cuda.synchronize()
    with PrefillSender(socket=tx_sock, group="pidns-p", layout=layout, ring_bytes=RING, ring_tensor=tx_ring) as tx, \
            DecodeReceiver(socket=rx_sock, group="pidns-d", layout=layout, ring_bytes=RING, ring_tensor=rx_ring) as rx:
        slot = tx.acquire(TOKENS)
        gen = torch.Generator(device=DEVICE).manual_seed(ROOM)
        sent = torch.randint(0, 256, (slot.chunk_bytes,), dtype=torch.uint8, device=DEVICE, generator=gen)
        tx.tensor(slot.offset, slot.chunk_bytes).copy_(sent)
        torch.cuda.synchronize()  # the daemon reads the ring as soon as the chunk is enqueued
        rx.expect(ROOM, tx.peer_address, "pidns-p", TOKENS)
        t0 = time.monotonic()
        tx.enqueue(ROOM, 0, 0, TOKENS, slot, last=True)
        got: torch.Tensor | None = None
        while True:
            st = rx.poll(ROOM)
            for c in st.landed:
                got = rx.tensor(c.offset, c.chunk_bytes).clone()
                rx.watermark(ROOM, [c.chunk_id])
            if st.state is RoomState.FAILED:
                raise RuntimeError(f"room failed: {st.failure_code} {st.failure_reason}")
            if st.state is RoomState.SUCCESS and got is not None:
                break
            if time.monotonic() - t0 > 60:
                raise TimeoutError(f"room still {st.state.name} after 60 s")
            time.sleep(0.002)
        seconds = time.monotonic() - t0
        torch.cuda.synchronize()
        return {"bytes": int(sent.numel()), "byte_exact": bool(torch.equal(got, sent)), "seconds": round(seconds, 4),
                "tx_data_path": tx.status().gpu_data_path}


def main() -> int:
    tx_sock, rx_sock, out = sys.argv[1:4]
    if os.environ.get("KVX_ENGINE_NOT_PID1") and os.getpid() == 1:
        # PID 1 of a new namespace, like the daemon in its own: work in a child (PID 2) so the two
        # PIDs differ, which tells a PID clash from a PID namespace boundary.
        child = os.fork()
        if child:
            return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    res: dict[str, object] = {"engine_pid": os.getpid(), "engine_pidns": _ns("pid"), "engine_ipcns": _ns("ipc")}
    try:
        res.update(move_one_room(tx_sock, rx_sock))
        res["ok"] = res["byte_exact"]
    except Exception as exc:  # the outcome is the result: recorded, not raised
        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-2000:]
    text = json.dumps(res)
    with open(out, "w") as fh:
        fh.write(text + "\n")
    print(text)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
