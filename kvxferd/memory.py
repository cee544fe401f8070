"""Host pool (shared memory mapped by the daemon and its local engines) and ring allocators.

A ring is a registered byte range (a slice of the host pool or an engine's GPU
staging ring) from which chunk slots are carved. Slots are released out of order:
a stalled room holds its slots without blocking the rooms allocated after it,
which a strict (round, tail) FIFO ring would do.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvxferd.errors import InvalidArgument, ResourceExhausted
from kvxferd.owned import check_dir, create_locked, remove_unowned

logger = logging.getLogger(__name__)

SLOT_ALIGN = 256
REGION_ALIGN = 1 << 12


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Watermark:
    sequence: int
    free_bytes: int
    largest_free: int


class RingAllocator:
    """First-fit allocator over [0, size) with coalescing of freed ranges."""

    def __init__(self, size: int, align: int = SLOT_ALIGN) -> None:
        if size <= 0:
            raise ValueError("ring size must be positive")
        self.size = size
        self.align = align
        self._free_starts: list[int] = [0]
        self._free_lens: list[int] = [size]
        self._held: dict[int, int] = {}
        self._used = 0
        self._sequence = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def slots_held(self) -> int:
        return len(self._held)

    def watermark(self) -> Watermark:
        return Watermark(self._sequence, self.size - self.used_bytes, max(self._free_lens, default=0))

    def fits_ever(self, length: int) -> bool:
        return 0 < align_up(length, self.align) <= self.size

    def alloc(self, length: int) -> int | None:
        """Offset of a new slot of at least `length` bytes, or None while full."""
        if length <= 0:
            raise InvalidArgument(f"slot length must be positive, got {length}")
        need = align_up(length, self.align)
        for i, flen in enumerate(self._free_lens):
            if flen >= need:
                start = self._free_starts[i]
                if flen == need:
                    del self._free_starts[i]
                    del self._free_lens[i]
                else:
                    self._free_starts[i] = start + need
                    self._free_lens[i] = flen - need
                self._held[start] = need
                self._used += need
                return start
        return None

    def holds(self, offset: int, length: int) -> bool:
        """True if [offset, offset+length) lies inside one held slot starting at offset."""
        held = self._held.get(offset)
        return held is not None and 0 < length <= held

    def slot_length(self, offset: int) -> int | None:
        return self._held.get(offset)

    def free(self, offset: int) -> None:
        length = self._held.pop(offset, None)
        if length is None:
            raise InvalidArgument(f"no slot held at offset {offset}")
        self._used -= length
        self._sequence += 1
        i = bisect.bisect_left(self._free_starts, offset)
        # Merge with the next free range, then with the previous one.
        if i < len(self._free_starts) and offset + length == self._free_starts[i]:
            length += self._free_lens[i]
            del self._free_starts[i]
            del self._free_lens[i]
        if i > 0 and self._free_starts[i - 1] + self._free_lens[i - 1] == offset:
            self._free_lens[i - 1] += length
        else:
            self._free_starts.insert(i, offset)
            self._free_lens.insert(i, length)

    def held_offsets(self) -> list[int]:
        return list(self._held)


_POOL_RE = re.compile(r"^kvxferd-[0-9a-f]{6,32}\.pool$")
_LEGACY_POOL_RE = re.compile(r"^kvxferd-(\d+)-[0-9a-f]+\.pool$")


def huge_page_size(directory: str) -> int:
    """The page size of the hugetlbfs mount holding `directory`, or 0 if it is not on one.

    A pool on huge pages is what makes NIXL's copies cheap on one host: UCX's CMA transport pins
    every page of both buffers per WRITE, and with 4 KiB tmpfs pages (shmem THP is off by default)
    measured copies ran at about 0.4x of the same copy between buffers on transparent huge pages.
    """
    try:
        real = os.path.realpath(directory)
        best, size = "", 0
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 4 or not (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")):
                    continue
                if len(parts[1]) < len(best):
                    continue
                best = parts[1]
                size = 0
                if parts[2] == "hugetlbfs":
                    size = 2 << 20
                    for opt in parts[3].split(","):
                        if opt.startswith("pagesize="):
                            size = parse_page_size(opt.split("=", 1)[1])
        return size
    except OSError:
        return 0


def parse_page_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text.upper().rstrip("B"))
    if not m:
        return 2 << 20
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


class HostPool:
    """One shared-memory file per daemon, mapped here and by local engines. On a hugetlbfs mount
    (`shm_dir = "/dev/hugepages"`) the pool is backed by huge pages; see huge_page_size."""

    def __init__(self, shm_dir: str, size: int, tag: str, mode: int = 0o600) -> None:
        self.page_size = huge_page_size(shm_dir)
        self.size = align_up(size, self.page_size or REGION_ALIGN)
        self.tag = tag
        warning = check_dir(shm_dir, "shm_dir")
        if warning:
            logger.warning("%s", warning)
        _remove_stale_pools(shm_dir)
        self.path = str(Path(shm_dir) / f"kvxferd-{tag}.pool")
        # The open fd holds the pool's lock for the daemon's life: that, not a PID, tells the next
        # daemon started on this shm_dir (in any PID namespace) whether the pool is still in use.
        self._fd = create_locked(self.path, mode)
        try:
            os.fchmod(self._fd, mode)
            os.ftruncate(self._fd, self.size)
            self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(self.path)
            os.close(self._fd)
            raise
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base_addr = ctypes.addressof(self._anchor)
        self.regions = RingAllocator(self.size, REGION_ALIGN)
        self._closed = False

    def allocate_region(self, length: int) -> int:
        offset = self.regions.alloc(length)
        if offset is None:
            wm = self.regions.watermark()
            raise ResourceExhausted(
                f"host pool has no {length} contiguous bytes free (largest free {wm.largest_free}, "
                f"pool {self.size}); raise host_pool_bytes or ask for a smaller ring"
            )
        return offset

    def free_region(self, offset: int) -> None:
        self.regions.free(offset)

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidArgument(f"range [{offset}, {offset + length}) is outside the pool")
        return memoryview(self._mm)[offset : offset + length]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._anchor
        try:
            self._mm.close()
        except BufferError:
            logger.warning("host pool still has live views at close; leaving the mapping to the OS")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # the lock goes last: nobody may take the name for stale before it is gone


def _remove_stale_pools(shm_dir: str) -> None:
    """Pools of daemons that died (kill -9, OOM) would otherwise pin RAM forever: a pool whose lock
    nobody holds is removed. Pools named the pre-lock way (`kvxferd-PID-TAG.pool`) carry no lock and
    a PID proves nothing across PID namespaces: they are left alone, with a warning."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(shm_dir, name)
        if _POOL_RE.match(name):
            if remove_unowned(path):
                logger.info("removed host pool %s: its daemon is gone (nobody holds its lock)", name)
        elif _LEGACY_POOL_RE.match(name):
            logger.warning("host pool %s is of an older kvxferd (no lock to judge it by): left alone; "
                           "remove it by hand once no older daemon runs on %s", name, shm_dir)
