"""Which link a same-node copy takes and how a cross-GPU copy addresses its destination (issue #38),
without CUDA: the CUDA calls are answered by fakes; tests/gpu/test_gpu_two_gpus.py runs the real ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvxferd.buffers import gpu_rings as gpu
from kvxferd.buffers.gpu_rings import (
    LINK_HOST,
    LINK_HOST_GPU,
    LINK_PEER,
    LINK_SAME_GPU,
    LINK_STAGED,
    PeerViews,
    _PeerAccess,
    copy_link,
)


def test_copy_link_names_every_case() -> None:
    def peers(a: int, b: int) -> bool:
        return {a, b} == {0, 1}  # GPUs 0 and 1 are linked, GPU 2 reaches no one

    assert copy_link("DRAM", 0, "DRAM", 0, peers) == LINK_HOST
    assert copy_link("DRAM", 0, "VRAM", 1, peers) == LINK_HOST_GPU
    assert copy_link("VRAM", 1, "DRAM", 0, peers) == LINK_HOST_GPU
    assert copy_link("VRAM", 2, "VRAM", 2, peers) == LINK_SAME_GPU
    assert copy_link("VRAM", 0, "VRAM", 1, peers) == LINK_PEER
    assert copy_link("VRAM", 1, "VRAM", 0, peers) == LINK_PEER
    assert copy_link("VRAM", 0, "VRAM", 2, peers) == LINK_STAGED
    # One direction only is not enough: a job may go either way.
    assert copy_link("VRAM", 0, "VRAM", 1, lambda a, b: a == 0) == LINK_STAGED


def test_peer_access_asks_cuda_only_for_two_gpus() -> None:
    # No CUDA on this machine: these would raise if they reached it.
    pa = _PeerAccess()
    assert pa.link("VRAM", 3, "VRAM", 3) == LINK_SAME_GPU
    assert pa.link("DRAM", 0, "VRAM", 1) == LINK_HOST_GPU
    assert pa.known() == {}


@dataclass
class FakeView:
    ptr: int
    closed: bool = False

    def close(self) -> None:
        self.closed = True


@dataclass
class Opener:
    opened: list[tuple[str, int, FakeView]] = field(default_factory=list)

    def __call__(self, handle: str, device: int) -> FakeView:
        view = FakeView(0x9000_0000 + 0x100_0000 * len(self.opened))
        self.opened.append((handle, device, view))
        return view


def test_peer_views_map_a_ring_into_the_copying_gpu_once() -> None:
    opener = Opener()
    views = PeerViews(opener)
    views.add(0x10_0000, 0x1_0000, "ring-on-gpu1", 1)
    views.add(0x40_0000, 0x1_0000, "ring-on-gpu0", 0)
    # GPU 0 copies into the GPU 1 ring: through GPU 0's mapping of it, at the same offset.
    assert views.translate(0x10_0800, 0x100, 0) == 0x9000_0800
    assert views.translate(0x10_0000, 0x1_0000, 0) == 0x9000_0000
    assert [(h, d) for h, d, _ in opener.opened] == [("ring-on-gpu1", 0)]  # opened once
    # The ring's own GPU, another GPU's ring on its own GPU, and addresses in no ring: unchanged.
    assert views.translate(0x10_0800, 0x100, 1) == 0x10_0800
    assert views.translate(0x40_0000, 0x100, 0) == 0x40_0000
    assert views.translate(0x5, 0x100, 0) == 0x5
    assert views.translate(0x20_0000, 0x100, 0) == 0x20_0000
    # A range that runs past the ring's end is not translated into a mapping it would overrun.
    assert views.translate(0x10_ff00, 0x200, 0) == 0x10_ff00
    # A third GPU gets its own mapping.
    assert views.translate(0x10_0000, 0x10, 2) == 0x9100_0000
    assert len(opener.opened) == 2

    views.remove(0x10_0000)
    assert all(v.closed for _, _, v in opener.opened)
    assert len(views) == 1
    assert views.translate(0x10_0800, 0x100, 0) == 0x10_0800
    views.remove(0x10_0000)  # twice: nothing to do


def test_status_lines_name_each_pair_and_its_link(monkeypatch: pytest.MonkeyPatch) -> None:
    pa = _PeerAccess()
    pa._links.update({(1, 3): LINK_STAGED, (0, 1): LINK_PEER})
    monkeypatch.setattr(gpu, "peer_access", pa)
    assert gpu.gpu_links() == ["GPU 0 <-> GPU 1: local-p2p", "GPU 1 <-> GPU 3: local-staged"]


def test_a_ring_that_cannot_be_mapped_is_copied_through_its_own_mapping() -> None:
    tries: list[int] = []

    def refuse(handle: str, device: int) -> FakeView:
        tries.append(device)
        raise RuntimeError("cudaIpcOpenMemHandle failed: CUDA error 1 (invalid argument)")

    views = PeerViews(refuse)
    views.add(0x10_0000, 0x1_0000, "ring-on-gpu1", 1)
    assert views.translate(0x10_0800, 0x100, 0) == 0x10_0800
    assert views.translate(0x10_0900, 0x100, 0) == 0x10_0900
    assert tries == [0]  # tried once, not per copy
    views.remove(0x10_0000)  # nothing to unmap
    assert len(views) == 0
