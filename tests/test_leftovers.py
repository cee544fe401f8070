"""Nothing left behind, and liveness by lock, not PID (issue #14): after SIGTERM no socket, pool,
fault file or lock file remains; after kill -9 a restart on the same config removes what the dead
instance left and engines of the old instance get a clear error; a pool whose owner holds its lock
(a live daemon, whatever PID namespace it is in) is never removed, one whose lock is free is,
whatever PID it names; symlinks and files of other users are refused, not followed.

`unshare -p` is not available to the tests, so "a daemon in another PID namespace" is a process
holding the pool's lock that the new daemon cannot see as a PID of its own namespace: the test
process itself, or another daemon.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvxfer_client import KvxferError, Layout, PrefillSender
from kvxferd.ops.owned_files import (
    Busy,
    OwnerLock,
    check_dir,
    ephemeral_port_range,
    listen_failure_hint,
    remove_unowned,
)
from tests.conftest import DaemonProc

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A private directory on the shared-memory file system, as /dev/shm is for real daemons."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="kvxshm-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def pools(shm: Path) -> list[str]:
    return sorted(n for n in os.listdir(shm) if n.endswith(".pool"))


def leftovers(d: DaemonProc) -> list[str]:
    return [p for p in (d.socket, d.socket + ".lock", d.socket + ".faults") if os.path.lexists(p)]


def start(daemons: Any, name: str, shm: Path, *extra: str, wait: bool = True) -> DaemonProc:
    # These tests are about a pool named in shm_dir (pool_backing=shm_dir); an fd-passed pool is
    # named nowhere and is checked in tests/test_lane.py.
    d: DaemonProc = daemons(name, "--set", f"shm_dir={shm}", "--set", "pool_backing=shm_dir", *extra, pool="8MiB",
                            wait=wait)
    return d


def test_sigterm_leaves_nothing_behind(daemons: Any, shm: Path) -> None:
    d = start(daemons, "clean", shm)
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        assert pools(shm) == [os.path.basename(tx.reg.pool_path)]
        Path(d.socket + ".faults").write_text("1\n")  # a fault file, although fault injection is off
        assert sorted(leftovers(d)) == sorted([d.socket, d.socket + ".lock", d.socket + ".faults"])
    assert d.stop() == 0
    assert leftovers(d) == [] and pools(shm) == [], (leftovers(d), pools(shm))


def test_kill9_then_restart_reclaims_everything_and_old_engines_get_a_clear_error(daemons: Any, shm: Path) -> None:
    d = start(daemons, "k9", shm)
    tx = PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20)
    old_pool = tx.reg.pool_path
    d.kill()
    assert os.path.exists(old_pool) and os.path.exists(d.socket) and os.path.exists(d.socket + ".lock")
    d2 = start(daemons, "k9", shm)  # same socket, same shm_dir
    assert not os.path.exists(old_pool), "the dead instance's pool was not removed"
    assert len(pools(shm)) == 1
    # The engine still maps the old pool: every call naming its registration says what happened.
    with pytest.raises(KvxferError) as ei:
        tx.enqueue(1, 0, 0, 16, tx.acquire(16, timeout=2), last=True)  # the slot is cut in the client
    assert ei.value.code.name == "NOT_FOUND" and "earlier instance of this daemon" in ei.value.message
    tx.close(unregister=False)
    with PrefillSender(socket=d2.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as again:
        slot = again.acquire(16)
        again.release_slot(slot)
    assert d2.stop() == 0
    assert leftovers(d2) == [] and pools(shm) == []


def test_a_pool_is_judged_by_its_lock_never_by_a_pid(daemons: Any, shm: Path) -> None:
    # Another live daemon's pool in the same shm_dir (its lock held by that daemon).
    first = start(daemons, "first", shm)
    (mine,) = pools(shm)
    # A pool whose owner is alive somewhere we cannot see (held here, as a daemon in another PID
    # namespace would hold it), and one of a killed PID-1 daemon: unlocked. Neither names a PID we
    # could check, and PID 1 is alive in every namespace.
    held = shm / "kvxferd-00000000aaaa.pool"
    dead = shm / "kvxferd-000000000001.pool"
    legacy = shm / "kvxferd-1-00000000bbbb.pool"  # the pre-lock naming, PID 1: left alone
    for p in (held, dead, legacy):
        p.write_bytes(b"\0" * 4096)
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        start(daemons, "second", shm)
        names = pools(shm)
        assert mine in names, "a live daemon's pool was removed"
        assert held.name in names, "a pool whose lock is held was removed"
        assert dead.name not in names, "an unlocked pool was kept"
        assert legacy.name in names
        assert len(names) == 4  # first, second, held, legacy
        with PrefillSender(socket=first.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
            assert os.path.basename(tx.reg.pool_path) == mine
    finally:
        os.close(fd)
    assert remove_unowned(str(held)), "the lock is free now"
    legacy.unlink()


def test_a_second_daemon_on_a_live_socket_does_not_start_and_touches_nothing(daemons: Any, shm: Path) -> None:
    d = start(daemons, "owner", shm)
    before = pools(shm)
    twin = start(daemons, "owner", shm, wait=False)
    assert twin.proc.wait(60) == 2
    assert "already serving" in twin.log_text()
    assert pools(shm) == before and os.path.exists(d.socket)
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20):
        pass


def test_planted_files_are_refused_not_followed(daemons: Any, shm: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    # A symlink where the socket goes: refused, the target untouched.
    sock = daemons.workdir / "planted.sock"
    os.symlink(victim, sock)
    bad = start(daemons, "planted", shm, wait=False)
    assert bad.proc.wait(60) == 2 and "not a socket" in bad.log_text()
    assert victim.read_bytes() == b"keep me"
    os.unlink(sock)
    # A symlink where the lock file goes: refused (O_NOFOLLOW), the target untouched.
    os.symlink(victim, str(sock) + ".lock")
    bad2 = start(daemons, "planted", shm, wait=False)
    assert bad2.proc.wait(60) == 2 and "cannot claim the socket" in bad2.log_text()
    assert victim.read_bytes() == b"keep me"
    os.unlink(str(sock) + ".lock")
    # A symlink named like a stale pool: not followed, not removed.
    link = shm / "kvxferd-00000000cccc.pool"
    os.symlink(victim, link)
    assert not remove_unowned(str(link)) and victim.read_bytes() == b"keep me"
    with pytest.raises(OSError):
        OwnerLock(str(link))
    link.unlink()
    # A directory of another user is not trusted; one root opened to all without the sticky bit is
    # used with a warning (tests/test_config.py checks that our own such directory is refused).
    if os.geteuid() == 0:  # making a directory of another user needs root (CI runs as root)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PermissionError, match="belongs to uid 65534"):
            check_dir(str(theirs), "shm_dir")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    assert "not sticky" in check_dir(str(open_dir), "shm_dir")
    open_dir.chmod(0o1777)
    assert check_dir(str(open_dir), "shm_dir") == ""


def test_owner_lock_is_exclusive_and_released_without_trace(tmp_path: Path) -> None:
    path = str(tmp_path / "x.lock")
    lock = OwnerLock(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(Busy):
        OwnerLock(path)
    assert not remove_unowned(path)
    lock.release()
    assert not os.path.exists(path)
    again = OwnerLock(path)
    again.release()


def test_listen_failure_hint_names_the_ephemeral_range_only_inside_it() -> None:
    span = ephemeral_port_range()
    assert span is not None
    low, high = span
    inside = listen_failure_hint(f"127.0.0.1:{low}")
    assert f"inside the ephemeral range {low}-{high}" in inside
    assert listen_failure_hint(f"127.0.0.1:{low - 1}") == "address in use or not local?"
    assert listen_failure_hint("[::1]:notaport") == "address in use or not local?"
