"""The host pool on a hugetlbfs the platform mounted (`huge_dir`, issue #41): huge pages with no
`unshare` and no capability, as the shipped systemd unit and Kubernetes manifests give them.

A real hugetlbfs is mounted in a temp dir and a few 2 MiB pages are reserved (root only: this box
and CI run as root); real daemons start with the systemd example's pool keys pointed at it; an
engine maps the pool it gets by fd, and a room moves between the two daemons byte-exact. Then the
same daemon with too few free huge pages: ``auto`` falls back with one line, ``huge_dir`` exits 2.
The limits (free less reserved pages, the cgroup's hugetlb.2MB.max) are checked on tmp copies of
the kernel's layout.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer_client import DecodeReceiver, Layout, PrefillSender
from kvxferd.buffers.memlimit import PoolDoesNotFit, check_pool_fits

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_TOML = ROOT / "deploy" / "systemd" / "kvxferd.toml"
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
FREE_2M = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
MIB = 1 << 20
POOL_MIB = 8  # 4 pages a daemon
RESERVE = 12  # pages: two daemons and a margin


@pytest.fixture
def hugetlbfs(short_tmp: Path) -> Iterator[Path]:
    """A hugetlbfs mounted in a temp dir, with RESERVE more 2 MiB pages in the system pool."""
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs and reserving huge pages need root (CI and the dev box run as root)")
    mnt = short_tmp / "huge"
    mnt.mkdir()
    got = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M,mode=0755", "kvx-test", str(mnt)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"this container may not mount hugetlbfs: {got.stderr.strip()}")
    before = int(NR_HUGEPAGES.read_text())
    reserved = False
    try:
        try:
            NR_HUGEPAGES.write_text(f"{before + RESERVE}\n")
            reserved = True
        except OSError as exc:  # a read-only /proc/sys (an unprivileged container)
            pytest.skip(f"this container may not reserve huge pages: {exc}")
        free = int(FREE_2M.read_text())
        assert free >= RESERVE, f"asked the kernel for {RESERVE} more 2 MiB pages, {free} are free"
        (mnt / "kvxferd").mkdir(mode=0o700)  # as the unit's ExecStartPre makes it
        yield mnt / "kvxferd"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        if reserved:
            # Pages still held (a daemon that would not die) become surplus, freed when let go.
            NR_HUGEPAGES.write_text(f"{before}\n")


def _pool_keys() -> dict[str, Any]:
    """The systemd example's pool keys: the shape of the shipped config, not this test's choice."""
    cfg = tomllib.loads(EXAMPLE_TOML.read_text())
    assert cfg["huge_dir"] == "/dev/hugepages/kvxferd" and cfg["pool_backing"] == "auto"
    return {k: cfg[k] for k in ("huge_dir", "pool_backing")}


def _mapping_page_sizes(pid: int | str, path: Path) -> set[int]:
    """KernelPageSize (KiB) of every mapping of the file at `path` in that process. Matched by
    inode: a file made with O_TMPFILE and linked in shows in smaps as '#INODE (deleted)'."""
    ino = str(os.stat(path).st_ino)
    sizes, inside = set(), False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
            inside = len(head) >= 5 and head[4] == ino
        elif inside and line.startswith("KernelPageSize:"):
            sizes.add(int(line.split()[1]))
    return sizes


def test_the_pool_is_on_the_mounted_hugetlbfs_and_a_room_moves_byte_exact(hugetlbfs: Path, daemons: Any) -> None:
    keys = _pool_keys()
    args = ["--set", f"huge_dir={hugetlbfs}", "--set", f"pool_backing={keys['pool_backing']}"]
    free0 = int(FREE_2M.read_text())
    tx_d = daemons("hugetx", *args, pool=f"{POOL_MIB}MiB")
    rx_d = daemons("hugerx", *args, pool=f"{POOL_MIB}MiB")
    pools = sorted(p.name for p in hugetlbfs.iterdir())
    assert len(pools) == 2 and all(re.fullmatch(r"kvxferd-[0-9a-f]+\.pool", p) for p in pools), pools
    # Prefaulted at start: each daemon holds its pages now, not at the first WRITE.
    assert int(FREE_2M.read_text()) <= free0 - 2 * POOL_MIB // 2
    for p in pools:
        assert os.stat(hugetlbfs / p).st_blksize == 2 * MIB
    with PrefillSender(socket=tx_d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=rx_d.socket, group="h", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        st = tx.status()
        assert st.pool_backing == "hugetlbfs"
        assert st.pool_huge_bytes == st.pool_bytes == POOL_MIB * MIB, (st.pool_huge_bytes, st.pool_bytes)
        # Handed by fd: an engine in another pod needs the socket, not the daemon's mount.
        assert tx.reg.pool_path == "" and tx.reg.pool_socket == tx_d.socket + ".pool"
        own = next(hugetlbfs / p for p in pools if _mapping_page_sizes(tx_d.proc.pid, hugetlbfs / p))
        assert _mapping_page_sizes(tx_d.proc.pid, own) == {2048}
        assert _mapping_page_sizes("self", own) == {2048}, "the engine's mapping of the pool"
        slot = tx.acquire(8)
        pattern = np.random.default_rng(41).integers(0, 256, slot.chunk_bytes, dtype=np.uint8).tobytes()
        tx.view(slot.offset, slot.chunk_bytes)[:] = pattern
        rx.expect(7, tx_d.peer_address, "g", 8)
        tx.enqueue(7, 0, 0, 8, slot, last=True)
        got, _ = rx.receive(7, timeout=60)
        assert got[0] == pattern
    for d in (tx_d, rx_d):
        assert d.stop() == 0
        assert "host pool: no " not in d.log_text()
    assert os.listdir(hugetlbfs) == []  # each daemon removed its own file


def test_too_few_huge_pages_fall_back_in_one_line_or_stop_the_start(hugetlbfs: Path, daemons: Any) -> None:
    big = f"{(RESERVE + 4) * 2}MiB"  # more than every page reserved here
    auto = daemons("hugeauto", "--set", f"huge_dir={hugetlbfs}", pool=big)
    with PrefillSender(socket=auto.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        assert tx.status().pool_backing in ("private-huge-tmpfs", "tmpfs")
        tx.view(0, 4)[:] = b"kvx!"  # the fallback pool works as any other
    assert auto.stop() == 0
    lines = [line for line in auto.log_text().splitlines() if "host pool: no " in line]
    assert len(lines) == 1 and f"huge_dir {hugetlbfs}" in lines[0] and "free huge pages" in lines[0], lines
    strict = daemons("hugestrict", "--set", f"huge_dir={hugetlbfs}", "--set", "pool_backing=huge_dir",
                     pool=big, wait=False)
    assert strict.proc.wait(60) == 2
    assert "free huge pages" in strict.log_text() and "Traceback" not in strict.log_text()
    assert os.listdir(hugetlbfs) == []


def test_huge_pages_are_held_to_free_less_reserved_and_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:  999999 kB\nHugePages_Total:     100\nHugePages_Free:      100\n"
                       "HugePages_Rsvd:       60\nHugepagesize:       2048 kB\n")
    none = tmp_path / "nocg"
    none.write_text("")
    check_pool_fits(80 * MIB, on_hugetlbfs=True, meminfo=meminfo, proc_cgroup=none)
    with pytest.raises(PoolDoesNotFit, match=r"free huge pages \(40 of 2048 KiB"):
        check_pool_fits(82 * MIB, on_hugetlbfs=True, meminfo=meminfo, proc_cgroup=none)
    # A pod's hugepages-2Mi limit: hugetlb.2MB.max of its cgroup, less what it holds.
    pod = tmp_path / "cg" / "kubepods" / "pod1"
    pod.mkdir(parents=True)
    (pod / "hugetlb.2MB.max").write_text(f"{32 * MIB}\n")
    (pod / "hugetlb.2MB.current").write_text(f"{8 * MIB}\n")
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("0::/kubepods/pod1\n")
    check_pool_fits(24 * MIB, on_hugetlbfs=True, meminfo=meminfo, proc_cgroup=proc_cgroup, cgroup_root=tmp_path / "cg")
    with pytest.raises(PoolDoesNotFit, match=r"cgroup limit of .*pod1"):
        check_pool_fits(26 * MIB, on_hugetlbfs=True, meminfo=meminfo, proc_cgroup=proc_cgroup,
                        cgroup_root=tmp_path / "cg")
    # A page size other than the default is read from its sysfs pool.
    sysfs = tmp_path / "hp"
    (sysfs / "hugepages-1048576kB").mkdir(parents=True)
    (sysfs / "hugepages-1048576kB" / "free_hugepages").write_text("3\n")
    (sysfs / "hugepages-1048576kB" / "resv_hugepages").write_text("1\n")
    check_pool_fits(2 << 30, on_hugetlbfs=True, meminfo=meminfo, proc_cgroup=none, page_size=1 << 30, sysfs=sysfs)
    with pytest.raises(PoolDoesNotFit):
        check_pool_fits(3 << 30, on_hugetlbfs=True, meminfo=meminfo, proc_cgroup=none, page_size=1 << 30, sysfs=sysfs)
