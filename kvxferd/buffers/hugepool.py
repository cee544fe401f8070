"""A host-pool file on transparent huge pages that needs no set-up by the operator.

Why: on one host UCX moves bytes between daemons with CMA (process_vm_writev), which pins
every page of the *remote* buffer per WRITE. Measured on the 2-core VM (20 MiB writes): into a
buffer of 4 KiB pages 3.3 GB/s at 0.31 CPU-s/GB, into one of 2 MiB pages 7.4 GB/s at 0.14
CPU-s/GB; the source's page size does not matter. A plain /dev/shm file gets 4 KiB pages on
most distributions (``shmem_enabled`` is ``never``), and hugetlbfs needs pages reserved by root.

A tmpfs mounted with ``huge=always`` gives huge pages to its files whatever ``shmem_enabled``
says. A short-lived helper process mounts one in a mount namespace of its own (with a user
namespace of its own when it is not privileged), creates an unnamed file in it and hands the
open file back over a socket pair; the mount lives as long as the file is open or mapped.
Nothing is named on any file system: nothing is left behind however the daemon dies, and
engines receive the file the same way (see :mod:`kvxferd.engine_api.pool_socket`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20

# Runs in the helper (a fresh interpreter: a process with threads may not unshare a user
# namespace). argv: pool bytes, fd of its end of the socket pair.
_HELPER = r"""
import ctypes, json, os, socket, sys
size, sock = int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2]))
libc = ctypes.CDLL(None, use_errno=True)
def fail(what):
    err = ctypes.get_errno()
    sock.sendall(json.dumps({"error": f"{what}: {os.strerror(err)}"}).encode())
    sys.exit(1)
uid, gid = os.geteuid(), os.getegid()
if libc.unshare(0x00020000) != 0:                      # CLONE_NEWNS: needs CAP_SYS_ADMIN
    if libc.unshare(0x10000000 | 0x00020000) != 0:     # ... else a user namespace of our own
        fail("unshare (no CAP_SYS_ADMIN and no unprivileged user namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)
# MS_REC | MS_PRIVATE on /: the mount below must never propagate to anyone else's view.
if libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:
    fail("making the mount namespace private")
target = next(d for d in ("/tmp", "/mnt", "/var/tmp", "/run", "/") if os.path.isdir(d))
opts = f"huge=always,size={size},nr_inodes=16,mode=0700".encode()
if libc.mount(b"kvxferd-pool", target.encode(), b"tmpfs", 0, opts) != 0:
    fail("mounting a tmpfs with huge=always")
fd = os.open(target, os.O_TMPFILE | os.O_RDWR, 0o600)
os.ftruncate(fd, size)
socket.send_fds(sock, [json.dumps({"ok": True}).encode()], [fd])
"""


class Unavailable(OSError):
    """This host or container cannot make a private huge-page tmpfs (the reason is the message)."""


def private_huge_file(size: int, timeout_s: float = 10.0) -> int:
    """An open, unnamed file of `size` bytes (rounded up to 2 MiB) on a private huge-page tmpfs.

    Raises Unavailable with the kernel's reason when it cannot be made here (no CAP_SYS_ADMIN
    and user namespaces disabled, a seccomp profile that blocks unshare, an old kernel).
    """
    size = (size + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ours.settimeout(timeout_s)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _HELPER, str(size), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            raise Unavailable(exc.errno or 0, f"cannot start the pool helper: {exc}") from exc
        theirs.close()
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ours, 4096, 1)
        except OSError as exc:
            proc.kill()
            raise Unavailable(0, f"the pool helper did not answer: {exc}") from exc
        finally:
            _, err = proc.communicate(timeout=timeout_s)
        try:
            reply = json.loads(msg or b"{}")
        except ValueError:
            reply = {}
        if not fds:
            why = reply.get("error") or (err.decode(errors="replace").strip().splitlines() or ["no reason given"])[-1]
            raise Unavailable(0, why)
        fd = fds[0]
        for extra in fds[1:]:
            os.close(extra)
        if os.fstat(fd).st_size != size:
            os.close(fd)
            raise Unavailable(0, "the pool helper returned a file of the wrong size")
        os.set_inheritable(fd, False)
        return fd
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()


def mount_of(directory: str) -> tuple[str, str, str]:
    """(mount point, file system type, options) of the mount holding `directory`; ("", "", "")
    if /proc/mounts cannot be read."""
    best = ("", "", "")
    try:
        real = os.path.realpath(directory)
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 4:
                    continue
                point = parts[1]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                    best = (point, parts[2], parts[3])
    except OSError:
        pass
    return best


def huge_mount_page_size(fstype: str, opts: str) -> int:
    """The huge page size of a mount (a mount_of() file system type and options): hugetlbfs, or
    a tmpfs mounted with huge=always/within_size/advise; 0 when its files get base pages."""
    options = dict(o.partition("=")[::2] for o in opts.split(","))
    if fstype == "hugetlbfs":
        return parse_page_size(options.get("pagesize", "2M"))
    if fstype == "tmpfs" and options.get("huge") in ("always", "within_size", "advise"):
        return HUGE_PAGE
    return 0


def parse_page_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text.upper().rstrip("B"))
    if not m:
        return HUGE_PAGE
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def huge_bytes_mapped(addr: int, length: int) -> int:
    """Bytes of [addr, addr+length) mapped here with huge pages (from /proc/self/smaps)."""
    total = 0
    inside = False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                if "-" in line.split(" ", 1)[0] and not line.endswith("kB\n"):
                    lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                    inside = lo < addr + length and hi > addr
                # hugetlbfs mappings count apart from THP ones, as Shared_/Private_Hugetlb.
                elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:", "AnonHugePages:",
                                                 "Shared_Hugetlb:", "Private_Hugetlb:")):
                    total += int(line.split()[1]) << 10
    except (OSError, ValueError):
        return 0
    return total

