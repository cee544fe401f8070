"""Files a daemon owns, and whether a file left behind still has a live owner.

Liveness is an exclusive `flock` the owner holds for its whole life, never a PID: a PID says
nothing across PID namespaces (a daemon in another container sharing /dev/shm looks dead, and a
killed PID-1 daemon's PID always looks alive). The kernel drops the lock when the owner dies, however
it dies, so "the lock can be taken" means "nobody owns this file any more".

Everything is opened with O_NOFOLLOW and checked to be a regular file of ours: a symlink or a
file planted by another user in a shared directory is refused, never followed or reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import socket
import stat

logger = logging.getLogger(__name__)

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class Busy(OSError):
    """The file's lock is held: its owner is alive."""


def check_dir(path: str, what: str) -> str:
    """A directory we create files in must not be someone else's: owned by us or root, else
    PermissionError (e.g. /tmp/kvxferd-$UID made beforehand by another user). If other users may
    write it without the sticky bit they could replace our files: refused when it is our own
    directory (a mistake), accepted with the warning returned when root made it so (a platform's
    shared directory such as a Kubernetes emptyDir, shared by one pod's containers)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{what} {path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise PermissionError(errno.EPERM, f"{what} {path} belongs to uid {st.st_uid}, not to us or root")
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_mode & stat.S_ISVTX:
        return ""
    why = (f"{what} {path} is writable by other users and not sticky (mode {stat.S_IMODE(st.st_mode):o}): "
           "they could replace the files made there")
    if st.st_uid != 0:
        raise PermissionError(errno.EPERM, why)
    return why + "; keep it to one trust domain (e.g. a pod's emptyDir) or set the sticky bit"


def _check_own_file(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(errno.EPERM, f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to us")
    return st


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _still_named(fd: int, path: str) -> bool:
    """The locked inode is still the one at `path` (not unlinked by its last owner meanwhile)."""
    try:
        st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


class OwnerLock:
    """A lock file held for the owner's lifetime (e.g. `<socket>.lock`: whoever holds it owns the
    socket and the files next to it). `release` removes the file, then lets go."""

    def __init__(self, path: str, mode: int = 0o600) -> None:
        self.path = path
        for _ in range(8):  # a previous owner may unlink the file between our open and our lock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, mode)
            try:
                _check_own_file(fd, path)
                if not _lock(fd):
                    raise Busy(errno.EWOULDBLOCK, f"{path} is held by a live owner")
                if _still_named(fd, path):
                    self._fd: int | None = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise Busy(errno.EAGAIN, f"{path} keeps changing under us")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def create_locked(path: str, mode: int) -> int:
    """A new file at `path` (which must not exist), locked before any other process can see it
    unlocked: made unnamed (O_TMPFILE), locked, then linked in. Where the file system has no
    O_TMPFILE it is created and locked at once (a window of microseconds). Returns the fd."""
    directory = os.path.dirname(path) or "."
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)
        _lock(fd)
        return fd
    try:
        _lock(fd)
        _link_fd(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400


def _link_fd(fd: int, path: str) -> None:
    """linkat(/proc/self/fd/FD, path, AT_SYMLINK_FOLLOW): names an O_TMPFILE file. os.link cannot
    (it calls link(2), which links the /proc symlink itself: EXDEV)."""
    libc = ctypes.CDLL(None, use_errno=True)
    src = f"/proc/self/fd/{fd}".encode()
    if libc.linkat(_AT_FDCWD, src, _AT_FDCWD, os.fsencode(path), _AT_SYMLINK_FOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)


def remove_unowned(path: str) -> bool:
    """Removes `path` if it is a regular file of ours whose lock nobody holds; True if removed.
    A file with a live owner (in any PID namespace), a symlink or another user's file is left."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return False  # gone, a symlink (ELOOP), or not ours to read
    try:
        try:
            _check_own_file(fd, path)
        except PermissionError:
            return False
        if not _lock(fd) or not _still_named(fd, path):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def bind_unix_socket(path: str, mode: int, gid: int = -1) -> socket.socket:
    """A listening, non-blocking Unix socket at `path` with `mode` (and group `gid`). It is
    created private (umask) so that no other user can connect in the moment before the chmod.
    The caller has cleared `path` (a dead daemon's socket) under the socket lock."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    try:
        os.chmod(path, mode)
        if gid >= 0:
            os.chown(path, -1, gid)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def ephemeral_port_range() -> tuple[int, int] | None:
    """The kernel's range of source ports for outgoing connections (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split())
    except (ValueError, OSError):
        return None
    return low, high


def listen_failure_hint(address: str) -> str:
    """Why binding a TCP address may have failed, for the start-up error.

    A fixed port inside the kernel's ephemeral range is free only until an outgoing connection
    takes it as its source port, which happens at random while a restarted daemon is down.
    """
    note = ephemeral_port_note(address)
    return f"address in use or not local? {note}" if note else "address in use or not local?"


def ephemeral_port_note(address: str) -> str:
    """Why a fixed port inside the kernel's ephemeral range is fragile, or "" for one outside it."""
    port_text = address.rsplit(":", 1)[-1]
    span = ephemeral_port_range()
    if not port_text.isdigit() or span is None or not span[0] <= int(port_text) <= span[1]:
        return ""
    return (f"port {port_text} is inside the ephemeral range {span[0]}-{span[1]}"
            " (net.ipv4.ip_local_port_range), where outgoing connections may hold it: pick a port"
            " below it or reserve it in net.ipv4.ip_local_reserved_ports")
