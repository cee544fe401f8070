"""The host pool is checked against the memory the daemon may use before anything is allocated
(kvxferd.buffers.memlimit): a real daemon asked for more than the machine has exits 2 with one line, and the
limits are read from /proc/meminfo and cgroup v2 files as the kernel lays them out (tmp copies of
that layout here: this machine's own cgroup may have no limit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvxferd.buffers.memlimit import RESERVE_BYTES, PoolDoesNotFit, cgroup_headroom, check_pool_fits, headroom
from tests.conftest import daemon_env

MIB = 1 << 20


def meminfo(tmp: Path, available_mib: int, huge_free: int = 0) -> Path:
    p = tmp / "meminfo"
    p.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_mib * 1024} kB\n"
                 f"HugePages_Total:     512\nHugePages_Free:      {huge_free}\nHugepagesize:       2048 kB\n")
    return p


def cgroups(tmp: Path, limits: dict[str, tuple[str, int]]) -> tuple[Path, Path]:
    """A cgroup v2 tree: {relative path: (memory.max, memory.current)}; the process sits in the deepest."""
    root = tmp / "cg"
    for rel, (limit, used) in limits.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{used}\n")
    own = max(limits, key=len)
    proc = tmp / "cgroup"
    proc.write_text(f"0::/{own}\n")
    return proc, root


def test_the_tightest_cgroup_up_the_tree_counts(tmp_path: Path) -> None:
    proc, root = cgroups(tmp_path, {"kubepods": (str(8192 * MIB), 7000 * MIB),
                                    "kubepods/pod1": (str(4096 * MIB), 1000 * MIB),
                                    "kubepods/pod1/c1": ("max", 900 * MIB)})
    room = cgroup_headroom(proc, root)
    # The pod's own limit leaves 3 GiB, its parent's only 1,192 MiB: the parent's is the one.
    assert room is not None and room.bytes == (8192 - 7000) * MIB, room
    assert room.what.startswith(f"the cgroup limit of {root / 'kubepods'} (8192 MiB"), room
    # No cgroup v2 line, or no limit anywhere: nothing to hold the pool to.
    (tmp_path / "v1").write_text("4:memory:/x\n")
    assert cgroup_headroom(tmp_path / "v1", root) is None
    proc2, root2 = cgroups(tmp_path / "free", {"a": ("max", 0), "a/b": ("max", 0)})
    assert cgroup_headroom(proc2, root2) is None


def test_a_pool_over_the_headroom_is_refused_naming_the_limit(tmp_path: Path) -> None:
    mi = meminfo(tmp_path, available_mib=16384)
    proc, root = cgroups(tmp_path, {"pod": (str(2048 * MIB), 512 * MIB)})
    paths = {"meminfo": mi, "proc_cgroup": proc, "cgroup_root": root}
    fits = (2048 - 512) * MIB - RESERVE_BYTES
    check_pool_fits(fits, **paths)
    with pytest.raises(PoolDoesNotFit, match=r"does not fit in the cgroup limit of .*pod \(2048 MiB, 512 MiB in use\)"):
        check_pool_fits(fits + MIB, **paths)
    # Without a cgroup limit, MemAvailable holds it.
    with pytest.raises(PoolDoesNotFit, match=r"MemAvailable \(16384 MiB\)"):
        check_pool_fits(16384 * MIB, meminfo=mi, proc_cgroup=tmp_path / "none", cgroup_root=root)


def test_a_hugetlbfs_pool_is_held_to_the_free_huge_pages(tmp_path: Path) -> None:
    mi = meminfo(tmp_path, available_mib=64, huge_free=100)  # 200 MiB of huge pages, little else
    room = headroom(True, mi, tmp_path / "none", tmp_path)
    assert room is not None and room.bytes == 200 * MIB
    check_pool_fits(200 * MIB, on_hugetlbfs=True, meminfo=mi)
    with pytest.raises(PoolDoesNotFit, match="free huge pages"):
        check_pool_fits(202 * MIB, on_hugetlbfs=True, meminfo=mi)


def test_a_daemon_asked_for_more_than_the_machine_has_exits_2_with_one_line(short_tmp: Path) -> None:
    total_kib = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemTotal:")))
    proc = subprocess.run(
        [sys.executable, "-m", "kvxferd", "serve", "--socket", str(short_tmp / "d.sock"), "--metrics-port", "-1",
         "--peer-listen", "127.0.0.1:0", "--host-pool-bytes", str(2 * total_kib * 1024)],
        env=daemon_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvxferd: error:")]
    assert len(errors) == 1 and "does not fit in" in errors[0] and "host_pool_bytes" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (short_tmp / "d.sock").exists()
