from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvxfer_protocol import cuda_ipc
from kvxfer_protocol.cuda_ipc import IPC_HANDLE_BYTES, CudaIpcError, CudaIpcHandle, export_tensor, open_handle

UUID = "GPU-0123abcd-4567-89ab-cdef-0123456789ab"
GOOD = bytes(range(1, IPC_HANDLE_BYTES + 1))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_handle_normalizes_uuid() -> None:
    h = CudaIpcHandle(handle=GOOD, device_uuid="0123ABCD-4567-89ab-cdef-0123456789AB", size=10, offset=4)
    assert h.device_uuid == UUID
    assert h == CudaIpcHandle(handle=GOOD, device_uuid=UUID, size=10, offset=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"handle": GOOD[:-1]}, "64 bytes, got 63"),
        ({"handle": GOOD + b"x"}, "64 bytes, got 65"),
        ({"handle": b""}, "64 bytes, got 0"),
        ({"handle": GOOD.hex()}, "64 bytes, got str"),
        ({"handle": bytes(IPC_HANDLE_BYTES)}, "all zeros"),
        ({"device_uuid": "GPU-not-a-uuid"}, "not a GPU UUID"),
        ({"device_uuid": ""}, "not a GPU UUID"),
        ({"device_uuid": 3}, "must be a str"),
        ({"size": 0}, "size must be positive"),
        ({"size": True}, "size must be an int"),
        ({"offset": -1}, "offset must be >= 0"),
        ({"offset": 1.5}, "offset must be an int"),
    ],
)
def test_malformed_handles_rejected(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"handle": GOOD, "device_uuid": UUID, "size": 16, "offset": 0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CudaIpcHandle(**args)  # type: ignore[arg-type]


def test_open_rejects_non_handle() -> None:
    with pytest.raises(ValueError, match="CudaIpcHandle"):
        open_handle(GOOD)  # type: ignore[arg-type]


def test_export_rejects_cpu_tensor() -> None:
    with pytest.raises(ValueError, match="CUDA tensors"):
        export_tensor(torch.zeros(4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_clear_error_without_cuda() -> None:
    with pytest.raises(CudaIpcError, match="needs a CUDA GPU"):
        open_handle(CudaIpcHandle(handle=GOOD, device_uuid=UUID, size=16))
    assert cuda_ipc._libs is None  # nothing was half-loaded


_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from kvxfer_protocol.cuda_ipc import CudaIpcHandle, open_handle
    msg = json.loads(sys.stdin.read())
    h = CudaIpcHandle(bytes.fromhex(msg["handle"]), msg["uuid"], msg["size"], msg["offset"])
    mem = open_handle(h)
    view = mem.as_tensor(torch.int32)
    seen = view.cpu()
    want = torch.arange(seen.numel(), dtype=torch.int32) * 3 + 1
    ok = bool(torch.equal(seen, want))
    view.mul_(-1)  # write back through the mapping for the parent to see
    torch.cuda.synchronize()
    mem.close()
    mem.close()  # idempotent
    print(json.dumps({"ok": ok, "closed": mem.closed, "ptr_nonzero": mem.ptr != 0}))
    """
)


@needs_cuda
def test_export_import_across_processes() -> None:
    big = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    # A slice at a non-zero offset proves base + offset arithmetic on both sides.
    part = big[12_345 : 12_345 + 50_000]
    part.copy_(torch.arange(part.numel(), dtype=torch.int32, device="cuda") * 3 + 1)
    torch.cuda.synchronize()
    h = export_tensor(part)
    assert h.offset >= 12_345 * 4 and h.size == 50_000 * 4
    msg = {"handle": h.handle.hex(), "uuid": h.device_uuid, "size": h.size, "offset": h.offset}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(msg),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"ok": True, "closed": True, "ptr_nonzero": True}
    want = -(torch.arange(part.numel(), dtype=torch.int32, device="cuda") * 3 + 1)
    assert torch.equal(part, want)
    # Bytes around the slice were not touched by the child.
    assert int(big[:12_345].abs().sum()) == 0 and int(big[12_345 + 50_000 :].abs().sum()) == 0


@needs_cuda
def test_open_unknown_gpu_is_clear() -> None:
    h = CudaIpcHandle(handle=GOOD, device_uuid=UUID, size=16)
    with pytest.raises(CudaIpcError, match="not visible"):
        open_handle(h)
