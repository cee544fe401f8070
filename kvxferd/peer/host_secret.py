"""The per-host peer secret: what the default peer authentication (`host-secret`) proves.

Why a file and not SO_PEERCRED: peers reach each other over TCP (gRPC and the framed stream), where
the kernel tells us nothing about the caller's uid; a Unix-socket peer path would be a second
transport to secure and test. A secret that only this uid can read turns "may connect to the
loopback port" (every local user) into "may read this uid's files" (this uid and root), and reuses
the HMAC handshake the fleet secret already has (kvxferd.peer.auth), challenge included.

Where: `host_secret_file`, default `~/.kvxferd/host-secret` of the daemon's uid (home from the
password database, not $HOME, so a service and a shell of the same uid agree), or
`/tmp/kvxferd-<uid>/host-secret` when that uid has no home directory of its own. Every daemon of
the uid uses the same file, so two daemons of one user pair with no set-up; daemons of different
users read different files and do not pair.

Created at first start if missing, and refused unless it is safe:
- its directory is a real directory (no symlink), owned by the daemon's uid, not writable by group
  or others (a squatter's /tmp/kvxferd-<uid> is refused, never used);
- the file is created 0600 with O_EXCL under a temporary name and linked into place, so a daemon
  starting at the same moment reads either nothing (and creates its own, losing the race to the
  link) or the whole secret, never half of it;
- read with O_NOFOLLOW: a regular file owned by the daemon's uid, mode 0600 or tighter, 32 bytes or
  more. A planted symlink or a file of another owner is an error naming the path, never followed.
Everything goes through a descriptor of the checked directory, so the path cannot be swapped
between the check and the use.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import stat

from kvxferd.config import ConfigError

FILE_NAME = "host-secret"
MIN_BYTES = 32
_MAX_BYTES = 64 << 10


def default_path() -> str:
    """Where daemons of this uid keep their host secret when host_secret_file is not set."""
    uid = os.geteuid()
    try:
        home = pwd.getpwuid(uid).pw_dir
        st = os.stat(home)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and home != "/":
            return os.path.join(home, ".kvxferd", FILE_NAME)
    except (KeyError, OSError):
        pass  # (no passwd entry, or a home that does not exist: a container's nobody)
    return f"/tmp/kvxferd-{uid}/{FILE_NAME}"


def _open_dir(path: str) -> int:
    """A descriptor of the secret's directory (made 0700 if missing), once it is proven safe."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"host_secret_file: cannot create directory {path!r}: {exc.strerror}") from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"host_secret_file: directory {path!r} cannot be opened (a symlink?): "
                          f"{exc.strerror}") from exc
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise ConfigError(f"host_secret_file: directory {path!r} is owned by uid {st.st_uid} with mode "
                          f"{stat.S_IMODE(st.st_mode):04o}; it must be owned by this daemon's uid "
                          f"{os.geteuid()} and not group/other-writable (set host_secret_file elsewhere)")
    return fd


def _read(dir_fd: int, name: str, path: str) -> bytes | None:
    """The secret, None if the file does not exist; ConfigError if it is not safe to trust."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"host_secret_file {path!r} cannot be opened (a symlink?): {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"host_secret_file {path!r} must be a regular file owned by uid {os.geteuid()} "
                              f"with mode 0600 (it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
        secret = fh.read(_MAX_BYTES).strip()
    if len(secret) < MIN_BYTES:
        raise ConfigError(f"host_secret_file {path!r} holds fewer than {MIN_BYTES} bytes")
    return secret


def load(path: str) -> bytes:
    """The host secret at `path`, created first if it does not exist (see the module doc)."""
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = _open_dir(directory)
    try:
        got = _read(dir_fd, name, path)
        if got is not None:
            return got
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(secrets.token_hex(MIN_BYTES).encode() + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            with contextlib.suppress(FileExistsError):  # another daemon of this uid made it first
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.unlink(tmp, dir_fd=dir_fd)
        got = _read(dir_fd, name, path)
        if got is None:
            raise ConfigError(f"host_secret_file {path!r} vanished while it was being created")
        return got
    except OSError as exc:
        raise ConfigError(f"host_secret_file {path!r}: {exc.strerror}") from exc
    finally:
        os.close(dir_fd)
