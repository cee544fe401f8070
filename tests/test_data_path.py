"""How GPU engines stage chunks: the daemon's data_path setting, its one-time VRAM probe, what
GetStatus tells engines, and the client refusing to pin without CUDA before it registers.
The pinned transfers themselves need a GPU: tests/gpu/test_gpu_host_path.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxfer_client import Layout, PrefillSender
from kvxferd.buffers.gpu_rings import _probe_vram, _ucx_has_cuda, gpu_data_path, vram_over_nixl
from kvxferd.config import ConfigError, load_config

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)


def test_vram_probe_reads_rdma_peermem_and_ucx(tmp_path: Path) -> None:
    assert vram_over_nixl(str(tmp_path)) == (False, "no RDMA device (/sys/class/infiniband is empty)")
    (tmp_path / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    # Probed once per daemon: the cached answer stands even though the tree changed.
    assert vram_over_nixl(str(tmp_path))[0] is False
    ok, why = _probe_vram(tmp_path)
    assert not ok and "mlx5_0" in why and "nvidia_peermem" in why
    (tmp_path / "module" / "nvidia_peermem").mkdir(parents=True)
    ok, why = _probe_vram(tmp_path)
    assert ok == _ucx_has_cuda(), why
    assert ("GPUDirect RDMA" in why) if ok else ("libuct_cuda" in why)


def test_settings_and_auto() -> None:
    assert gpu_data_path("host") == "host"
    assert gpu_data_path("vram") == "vram"
    assert gpu_data_path("auto") == ("vram" if vram_over_nixl()[0] else "host")


def test_data_path_is_validated(short_tmp: Path) -> None:
    cfg = load_config(None, env={}, overrides={"socket": str(short_tmp / "d.sock")})
    assert cfg.data_path == "auto"
    with pytest.raises(ConfigError, match=r"data_path must be auto\|host\|vram"):
        load_config(None, env={}, overrides={"socket": str(short_tmp / "d.sock"), "data_path": "gpu"})


@pytest.mark.parametrize("setting", ["host", "vram"])
async def test_status_tells_engines_the_data_path(inproc: Any, setting: str) -> None:
    d = await inproc(f"dp-{setting}", data_path=setting)
    tx = await asyncio.to_thread(PrefillSender, socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20)
    try:
        st = await asyncio.to_thread(tx.status)
        assert st.gpu_data_path == setting
    finally:
        await asyncio.to_thread(tx.close)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
async def test_pin_without_cuda_is_refused_before_registering(inproc: Any) -> None:
    d = await inproc("dp-nocuda", data_path="host")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        await asyncio.to_thread(PrefillSender, socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20,
                                pin_host=True)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        await asyncio.to_thread(PrefillSender, socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20,
                                kv_device="cuda:0")
    # Nothing was registered on the daemon's side.
    probe = await asyncio.to_thread(PrefillSender, socket=d.socket, group="other", layout=LAYOUT, ring_bytes=1 << 20)
    try:
        st = await asyncio.to_thread(probe.status)
        assert [e.group for e in st.engines] == ["other"]
    finally:
        await asyncio.to_thread(probe.close)
