"""Does the host pool fit in the memory this daemon may use? Asked once at start, before any allocation.

A pool larger than the machine's available memory, or than the cgroup v2 limit of the daemon's
container, used to end in a traceback or, inside a memory-limited pod, in an OOM kill with an empty
log. The answer comes from /proc/meminfo (MemAvailable) and the ``memory.max`` of every cgroup from
the daemon's own up to the root (the tightest one, less what it already holds), so the daemon can
refuse with one line and exit 2 instead. A pool on hugetlbfs is not counted there (its pages are
reserved apart), so it is checked against the free huge pages instead.
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
                    cgroup_root: Path = Path("/sys/fs/cgroup")) -> Headroom | None:
    """The least `memory.max - memory.current` over this process's cgroup v2 and its ancestors;
    None without cgroup v2 or without any limit."""
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
        limit = _read_int(node / "memory.max")  # "max" (no limit) reads as None
        if limit is not None:
            used = _read_int(node / "memory.current") or 0
            room = Headroom(max(0, limit - used), f"the cgroup limit of {node} ({limit >> 20} MiB, "
                                                  f"{used >> 20} MiB in use)")
            if best is None or room.bytes < best.bytes:
                best = room
        if node == cgroup_root or cgroup_root not in node.parents:
            return best
        node = node.parent


def headroom(on_hugetlbfs: bool, meminfo: Path = Path("/proc/meminfo"),
             proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> Headroom | None:
    """What a new pool may take: the tightest of the limits that apply; None if none can be read."""
    info = _meminfo(meminfo)
    if on_hugetlbfs:
        free, size = info.get("HugePages_Free"), info.get("Hugepagesize")
        if free is None or not size:
            return None
        return Headroom(free * size, f"the free huge pages ({free} of {size >> 10} KiB)")
    rooms = [r for r in (
        Headroom(info["MemAvailable"], f"MemAvailable ({info['MemAvailable'] >> 20} MiB)") if "MemAvailable" in info else None,
        cgroup_headroom(proc_cgroup, cgroup_root),
    ) if r is not None]
    return min(rooms, key=lambda r: r.bytes) if rooms else None


def check_pool_fits(nbytes: int, on_hugetlbfs: bool = False, meminfo: Path = Path("/proc/meminfo"),
                    proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> None:
    """Raises PoolDoesNotFit when a pool of `nbytes` (plus a reserve) exceeds the headroom."""
    room = headroom(on_hugetlbfs, meminfo, proc_cgroup, cgroup_root)
    if room is None:
        return
    reserve = 0 if on_hugetlbfs else RESERVE_BYTES
    if nbytes + reserve > room.bytes:
        raise PoolDoesNotFit(
            f"host_pool_bytes ({nbytes >> 20} MiB{f' + {reserve >> 20} MiB for the daemon' if reserve else ''}) "
            f"does not fit in {room.what}: lower host_pool_bytes or give the daemon more memory")

