"""Which VRAM registrations does NIXL/UCX accept in a daemon-like process? (device diagnostic)

Each variant runs in a fresh process, as the daemon would (NIXL agent first, then CUDA):
  own / ipc: the registered memory is a tensor of this process / a range another process
             exported and this one imported with kvxfer_protocol.cuda_ipc (the daemon's GPU-ring case)
  cache-y / cache-n: UCX_MEMTYPE_CACHE (kvxferd's transport defaults it to n)
Prints one line per variant: OK, or FAIL with the error. Usage: python3 nixl_vram_probe.py
Seen on an H200 (nixl-cu13 1.5.1): own OK; ipc/cache-y FAIL "VRAM memory is detected as host".
"""

from __future__ import annotations

import os
import subprocess
import sys


def child(variant: str, handle_hex: str, uuid: str, size: int, offset: int) -> None:
    mem, _ = variant.split("/")
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
    import torch

    from kvxfer_protocol import cuda_ipc

    if mem == "own":
        t = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        addr, n = t.data_ptr(), size
    else:
        h = cuda_ipc.CudaIpcHandle(bytes.fromhex(handle_hex), uuid, size, offset)
        m = cuda_ipc.open_handle(h)
        addr, n = m.ptr, m.size
    try:
        agent.register_memory([(addr, n, 0, "")], "VRAM")
        print(f"{variant:<22} OK", flush=True)
    except Exception as exc:
        print(f"{variant:<22} FAIL {type(exc).__name__}: {exc}", flush=True)


def main() -> None:
    import torch

    from kvxfer_protocol import cuda_ipc

    ring = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    h = cuda_ipc.export_tensor(ring)
    for variant in ("own/cache-y", "ipc/cache-y", "ipc/cache-n"):
        env = {**os.environ, "UCX_MODULES": "^efa", "UCX_MEMTYPE_CACHE": variant[-1]}
        r = subprocess.run(
            [sys.executable, __file__, variant, h.handle.hex(), h.device_uuid, str(h.size), str(h.offset)],
            capture_output=True, text=True, timeout=120, env=env,
        )
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "NIXL INFO" not in ln]
        print("\n".join(lines[-6:]) if lines else f"{variant}: no output (rc {r.returncode})", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
