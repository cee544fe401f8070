"""Does the host pool fit in the memory this daemon may use? Asked once at start, before any allocation.

A pool larger than the machine's available memory, or than the cgroup v2 limit of the daemon's
container, used to end in a traceback or, inside a memory-limited pod, in an OOM kill with an empty
log. The answer comes from /proc/meminfo (MemAvailable) and the ``memory.max`` of every cgroup from
the daemon's own up to the root (the tightest one, less what it already holds), so the daemon can
refuse with one line and exit 2 instead. A pool on hugetlbfs is not counted there (its pages are
reserved apart), so it is checked against the huge pages nobody holds or has reserved (free less
reserved: a page reserved by another mapping is not free to us) and against the cgroup's
``hugetlb.<size>.max`` (a pod's ``hugepages-2Mi`` limit), the tightest of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Kept free for the daemon's own growth after start (NIXL's registrations, gRPC buffers, rooms).
RESERVE_BYTES = 128 << 20


class PoolDoesNotFit(RuntimeError):
    """The pool would not fit; the message says what limits it."""


@dataclass(frozen=True)
class Headroom:
    bytes: int
    what: str  # which limit it is, for the message


def _meminfo(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_headroom(proc_cgroup: Path = Path("/proc/self/cgroup"),
                    cgroup_root: Path = Path("/sys/fs/cgroup"), controller: str = "memory") -> Headroom | None:
    """The least `<controller>.max - <controller>.current` over this process's cgroup v2 and its
    ancestors (`memory`, or `hugetlb.2MB` for huge pages); None without cgroup v2 or any limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if rel is None:
        return None
    best: Headroom | None = None
    node = cgroup_root / rel.lstrip("/")
    while True:
        limit = _read_int(node / f"{controller}.max")  # "max" (no limit) reads as None
        if limit is not None:
            used = _read_int(node / f"{controller}.current") or 0
            room = Headroom(max(0, limit - used), f"the cgroup limit of {node} ({limit >> 20} MiB, "
                                                  f"{used >> 20} MiB in use)")
            if best is None or room.bytes < best.bytes:
                best = room
        if node == cgroup_root or cgroup_root not in node.parents:
            return best
        node = node.parent


def _cgroup_size_name(page_size: int) -> str:
    """hugetlb controller files name a page size as 2MB, 1GB, 64KB."""
    for shift, unit in ((30, "GB"), (20, "MB"), (10, "KB")):
        if page_size >= 1 << shift and page_size % (1 << shift) == 0:
            return f"{page_size >> shift}{unit}"
    return f"{page_size}B"


def _free_huge_pages(info: dict[str, int], page_size: int, sysfs: Path) -> tuple[int, int] | None:
    """(pages free and not reserved, page size) of `page_size` (0: the default size)."""
    default = info.get("Hugepagesize", 0)
    size = page_size or default
    if size and size == default and "HugePages_Free" in info:
        return max(0, info["HugePages_Free"] - info.get("HugePages_Rsvd", 0)), size
    pool = sysfs / f"hugepages-{size >> 10}kB"
    free, resv = _read_int(pool / "free_hugepages"), _read_int(pool / "resv_hugepages")
    return None if free is None or not size else (max(0, free - (resv or 0)), size)


def headroom(on_hugetlbfs: bool, meminfo: Path = Path("/proc/meminfo"),
             proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup"),
             page_size: int = 0, sysfs: Path = Path("/sys/kernel/mm/hugepages")) -> Headroom | None:
    """What a new pool may take: the tightest of the limits that apply; None if none can be read.
    On hugetlbfs `page_size` is the mount's (0: the system's default huge page size)."""
    info = _meminfo(meminfo)
    if on_hugetlbfs:
        got = _free_huge_pages(info, page_size, sysfs)
        pages = [] if got is None else [
            Headroom(got[0] * got[1], f"the free huge pages ({got[0]} of {got[1] >> 10} KiB, reserved ones not counted; "
                                      f"reserve more with vm.nr_hugepages)")]
        limited = cgroup_headroom(proc_cgroup, cgroup_root, f"hugetlb.{_cgroup_size_name(got[1] if got else page_size or 2 << 20)}")
        pages += [limited] if limited is not None else []
        return min(pages, key=lambda r: r.bytes) if pages else None
    rooms = [r for r in (
        Headroom(info["MemAvailable"], f"MemAvailable ({info['MemAvailable'] >> 20} MiB)") if "MemAvailable" in info else None,
        cgroup_headroom(proc_cgroup, cgroup_root),
    ) if r is not None]
    return min(rooms, key=lambda r: r.bytes) if rooms else None


def check_pool_fits(nbytes: int, on_hugetlbfs: bool = False, meminfo: Path = Path("/proc/meminfo"),
                    proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup"),
                    page_size: int = 0, sysfs: Path = Path("/sys/kernel/mm/hugepages")) -> None:
    """Raises PoolDoesNotFit when a pool of `nbytes` (plus a reserve) exceeds the headroom."""
    room = headroom(on_hugetlbfs, meminfo, proc_cgroup, cgroup_root, page_size, sysfs)
    if room is None:
        return
    reserve = 0 if on_hugetlbfs else RESERVE_BYTES
    if nbytes + reserve > room.bytes:
        raise PoolDoesNotFit(
            f"host_pool_bytes ({nbytes >> 20} MiB{f' + {reserve >> 20} MiB for the daemon' if reserve else ''}) "
            f"does not fit in {room.what}: lower host_pool_bytes or give the daemon more memory")

