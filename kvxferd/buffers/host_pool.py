"""Host pool (shared memory mapped by the daemon and its local engines) and ring allocators.

A ring is a registered byte range (a slice of the host pool or an engine's GPU
staging ring) from which chunk slots are carved. Slots are released out of order:
a stalled room holds its slots without blocking the rooms allocated after it,
which a strict (round, tail) FIFO ring would do.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvxferd.buffers.hugepool import (
    HUGE_PAGE,
    Unavailable,
    huge_bytes_mapped,
    huge_mount_page_size,
    mount_of,
    private_huge_file,
)
from kvxferd.buffers.memlimit import PoolDoesNotFit, check_pool_fits
from kvxferd.errors import InvalidArgument, ResourceExhausted
from kvxferd.ops.owned_files import check_dir, create_locked, remove_unowned

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
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

    def _free_range_holding(self, offset: int, need: int) -> int | None:
        """Index of the free range that [offset, offset + need) lies inside, if one does."""
        i = bisect.bisect_right(self._free_starts, offset) - 1
        if i < 0 or offset + need > self._free_starts[i] + self._free_lens[i]:
            return None
        return i

    def is_free(self, offset: int, length: int) -> bool:
        """[offset, offset + align_up(length)) lies inside one free range."""
        return self._free_range_holding(offset, align_up(length, self.align)) is not None

    def claim(self, offset: int, length: int) -> bool:
        """Holds [offset, offset + align_up(length)) if all of it is free (a slot the engine cut
        out of its ring itself); False, changing nothing, if any of it is held or outside."""
        need = align_up(length, self.align)
        if length <= 0 or offset < 0 or offset % self.align or offset + need > self.size:
            return False
        i = self._free_range_holding(offset, need)
        if i is None:
            return False
        start, flen = self._free_starts[i], self._free_lens[i]
        # Cut the slot out of its free range: what stays is the part before it and the part after.
        before, after = offset - start, start + flen - offset - need
        if before:
            self._free_lens[i] = before
            if after:
                self._free_starts.insert(i + 1, offset + need)
                self._free_lens.insert(i + 1, after)
        elif after:
            self._free_starts[i], self._free_lens[i] = offset + need, after
        else:
            del self._free_starts[i]
            del self._free_lens[i]
        self._held[offset] = need
        self._used += need
        return True

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


POOL_SUFFIX = ".pool"


class HostPool:
    """The daemon's host memory, mapped here and by local engines (their rings are windows of it).

    Backings, by `pool_backing`:
    - ``huge_dir`` (what ``auto`` tries first when `huge_dir` is set): a named, locked file in
      `huge_dir`, a hugetlbfs (or huge= tmpfs) the platform mounted for us (systemd's
      /dev/hugepages, a Kubernetes ``emptyDir: {medium: HugePages-2Mi}``), sized against the huge
      pages free to us; handed to engines as a file descriptor over ``<socket>.pool``, so engine
      pods need no part of that mount. Needs no capability at all, unlike ``private``;
    - ``private``: an unnamed file on a private huge-page tmpfs (kvxferd.buffers.hugepool), handed to
      engines the same way; needs CAP_SYS_ADMIN or unprivileged user namespaces (``unshare``);
    - ``shm_dir``: a named file in `shm_dir`, opened by engines by path. On hugetlbfs or on a
      tmpfs mounted with ``huge=`` it gets huge pages; elsewhere 4 KiB pages, which make every
      NIXL WRITE into it cost about twice the CPU over CMA (see kvxferd.buffers.hugepool).
    ``auto`` keeps `shm_dir` when that is already on huge pages (the operator's choice), and
    falls back to it with one warning naming what was tried when no huge pages can be had.
    The pool is checked against the memory it would come from before it is made
    (kvxferd.buffers.memlimit): PoolDoesNotFit, except that huge pages too few for ``auto`` fall back.
    """

    def __init__(self, shm_dir: str, size: int, tag: str, mode: int = 0o600, backing: str = "auto",
                 huge_dir: str = "") -> None:
        self.tag = tag
        self.path = ""  # what engines open by name; "" = they get the fd over <socket>.pool
        self.file = ""  # our named file, if any (removed at close)
        self.backing = ""
        self.page_size = 0
        _, shm_fs, shm_opts = mount_of(shm_dir)
        shm_huge = huge_mount_page_size(shm_fs, shm_opts)
        fd = -1
        missed: list[str] = []
        if backing == "huge_dir" or (backing == "auto" and huge_dir):
            try:
                fd = self._create_in_huge_dir(huge_dir, size, mode)
            except (Unavailable, PoolDoesNotFit) as exc:
                if backing == "huge_dir":
                    raise
                missed.append(f"huge_dir {huge_dir}: {exc.strerror if isinstance(exc, OSError) else exc}")
        if fd < 0 and (backing == "private" or (backing == "auto" and not shm_huge)):
            check_pool_fits(size)
            try:
                fd = private_huge_file(size)
                self.backing, self.page_size = "private-huge-tmpfs", HUGE_PAGE
            except Unavailable as exc:
                if backing == "private":
                    raise
                missed.append(f"private huge-page tmpfs: {exc.strerror or exc}")
        if fd < 0:
            check_pool_fits(size, on_hugetlbfs=shm_fs == "hugetlbfs", page_size=shm_huge)
            fd = self._create_named(shm_dir, size, mode, shm_fs, shm_huge, "shm_dir")
            self.path = self.file
        if missed:
            # One line for the whole fall-back: what was tried, why each failed, what it costs.
            cost = "" if self.page_size else (
                ", 4 KiB pages: each NIXL WRITE into this daemon costs about twice the CPU. Fix: reserve huge "
                "pages for huge_dir (deploy/README.md) or let the daemon unshare a mount namespace")
            logger.warning("host pool: no %s; using %s%s%s", "; no ".join(missed), self.backing,
                           f" in {shm_dir}" if self.path else "", cost)
        self._fd = fd
        try:
            self.size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._unlink()
            os.close(fd)
            raise
        if self.page_size:
            # A tmpfs mounted huge=advise gives huge pages only to mappings that ask.
            with contextlib.suppress(OSError, AttributeError):
                self._mm.madvise(mmap.MADV_HUGEPAGE)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base_addr = ctypes.addressof(self._anchor)
        self.regions = RingAllocator(self.size, REGION_ALIGN)
        self._closed = False

    def _create_in_huge_dir(self, huge_dir: str, size: int, mode: int) -> int:
        """Our pool file in a huge-page mount made for us; Unavailable (why) when it is no such
        mount, PoolDoesNotFit when its huge pages are too few."""
        if not huge_dir or not os.path.isdir(huge_dir):
            raise Unavailable(errno.ENOENT, f"no directory {huge_dir!r}")
        _, fstype, opts = mount_of(huge_dir)
        page = huge_mount_page_size(fstype, opts)
        if not page:
            raise Unavailable(errno.EINVAL, f"{huge_dir} is on {fstype or 'an unknown file system'}, "
                                            "not on hugetlbfs or a tmpfs mounted with huge=")
        # hugetlbfs pages are reserved apart from MemAvailable: held to the free huge pages instead.
        check_pool_fits(align_up(size, page), on_hugetlbfs=fstype == "hugetlbfs", page_size=page)
        return self._create_named(huge_dir, size, mode, fstype, page, "huge_dir")

    def _create_named(self, shm_dir: str, size: int, mode: int, fstype: str, huge: int, key: str) -> int:
        self.page_size = huge
        self.backing = "hugetlbfs" if fstype == "hugetlbfs" else ("tmpfs-huge" if huge else "tmpfs")
        warning = check_dir(shm_dir, key)
        if warning:
            logger.warning("%s", warning)
        _remove_stale_pools(shm_dir)
        self.file = str(Path(shm_dir) / f"kvxferd-{self.tag}{POOL_SUFFIX}")
        # The open fd holds the pool's lock for the daemon's life: that, not a PID, tells the next
        # daemon started on this directory (in any PID namespace) whether the pool is still in use.
        fd = create_locked(self.file, mode)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, align_up(size, huge or REGION_ALIGN))
        except BaseException:
            self._unlink()
            os.close(fd)
            raise
        return fd

    def prefault(self) -> None:
        """Makes every page of the pool resident now. The first WRITE into a page otherwise pays
        for zeroing it, inside the copy (a fifth of the copy thread's time in the first loopback
        runs); a daemon's pool is its pinned memory and is used whole by the engines' rings."""
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                # Out of memory or the tmpfs is full: an error now, where a touch would be SIGBUS.
                raise
        # Before Linux 5.14 (no MADV_POPULATE_WRITE): touch one byte per page.
        step = self.page_size or mmap.PAGESIZE
        for off in range(0, self.size, step):
            self._mm[off] = self._mm[off]

    @property
    def fd(self) -> int:
        """The pool's open file (handed to engines when the pool has no path)."""
        return self._fd

    def huge_bytes(self) -> int:
        """Bytes of the pool mapped here with huge pages so far (pages are placed on first touch)."""
        return huge_bytes_mapped(self.base_addr, self.size)

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

    def _unlink(self) -> None:
        if self.file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.file)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._anchor
        try:
            self._mm.close()
        except BufferError:
            logger.warning("host pool still has live views at close; leaving the mapping to the OS")
        self._unlink()
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
