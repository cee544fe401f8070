from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvxferd.config import ConfigError, load_config, parse_size, usable_cpus
from kvxferd.ops.owned_files import check_dir
from tests.test_security import as_user


def test_defaults_validate(short_tmp: Path) -> None:
    cfg = load_config(None, env={}, overrides={"socket": str(short_tmp / "d.sock")})
    assert cfg.peer_listen == "127.0.0.1:7471"
    assert cfg.metrics_host == "127.0.0.1"
    assert cfg.socket_mode == 0o600
    assert cfg.transport == "nixl" and cfg.nixl_backend == "UCX"


def test_precedence_file_env_flags(short_tmp: Path) -> None:
    f = short_tmp / "k.toml"
    f.write_text(f'socket = "{short_tmp}/a.sock"\nworkers = 3\nhost_pool_bytes = "128MiB"\nmetrics_port = 9000\n')
    cfg = load_config(f, env={"KVXFERD_WORKERS": "5"}, overrides={"metrics_port": 9100})
    assert cfg.workers == 5 and cfg.transfer_workers == 5
    assert cfg.metrics_port == 9100
    assert cfg.host_pool_bytes == 128 << 20


@pytest.mark.parametrize(
    "content,needle",
    [
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("workers = -1\n", "workers must be 0 (auto) or 1..256"),
        ('peer_listen = "nohost"\n', "peer_listen must be HOST:PORT"),
        ('log_format = "xml"\n', "log_format"),
        ("workers = 'many'\n", "workers: invalid value"),
        ('tls_cert = "/nonexistent.pem"\ntls_key = "/nonexistent.key"\n', "no such file"),
        ('socket = "/proc/kvx/d.sock"\n', "cannot be created"),
        ("host_pool_bytes = 10\n", "at least 1 MiB"),
        ('merge_max_bytes = "2GiB"\n', "merge_max_bytes must be 1 MiB..1 GiB"),
        ("max_rooms_per_engine = 0\n", "max_rooms_per_engine must be 1.."),
        ("max_engines = 1000000\n", "max_engines must be 1..65536"),
        ("max_watch_backlog = 1\n", "max_watch_backlog must be 16.."),
        ("room_deadline_s = 100000\n", "room_deadline_s must be > 0 and <= 86400"),
        ("heartbeat_misses = 1000\n", "heartbeat_misses must be 1..100"),
        ('max_message_bytes = "64GiB"\n', "max_message_bytes must be 65536..2147483647"),
        ("slow_peer_limit_s = -1\n", "slow_peer_limit_s must be 0..3600"),
        ('nixl_backend = "UCX;rm"\n', "nixl_backend must be a NIXL plugin name like UCX"),
        ('nixl_backend = ""\n', "nixl_backend must be a NIXL plugin name"),
    ],
)
def test_bad_values_have_clear_messages(short_tmp: Path, content: str, needle: str) -> None:
    f = short_tmp / "bad.toml"
    body = content if "socket" in content else f'socket = "{short_tmp}/a.sock"\n' + content
    f.write_text(body)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(f, env={})


def test_unknown_env_var_rejected(short_tmp: Path) -> None:
    with pytest.raises(ConfigError, match="KVXFERD_NOPE"):
        load_config(None, env={"KVXFERD_NOPE": "1"}, overrides={"socket": str(short_tmp / "a.sock")})


def test_parse_size() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("64M") == 64 << 20
    assert parse_size(4096) == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_cap_defaults_are_set_and_overridable(short_tmp: Path) -> None:
    cfg = load_config(None, env={"KVXFERD_MAX_ROOMS_PER_PEER": "12"}, overrides={"socket": str(short_tmp / "a.sock")})
    assert (cfg.max_engines, cfg.max_rooms_per_engine, cfg.max_rooms_per_peer) == (256, 8192, 12)
    assert (cfg.max_open_streams, cfg.max_watchers_per_engine, cfg.max_streams_per_engine) == (1024, 16, 16)
    assert (cfg.max_watch_backlog, cfg.max_tombstones) == (65536, 65536)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_socket_directory_of_another_user_or_open_to_all_is_refused(short_tmp: Path) -> None:
    theirs = short_tmp / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # e.g. /tmp/kvxferd-$UID made beforehand by someone else
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        load_config(None, env={}, overrides={"socket": str(theirs / "d.sock")})
    # Our own directory open to everyone (not sticky) is refused; checked as that directory's user.
    os.chmod(short_tmp, 0o755)
    open_dir = short_tmp / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    os.chown(open_dir, 65534, 65534)

    def refused_as_owner() -> int:
        try:
            check_dir(str(open_dir), "socket directory")
        except PermissionError as exc:
            return 0 if "writable by other users and not sticky" in str(exc) else 2
        return 1

    assert as_user(65534, 65534, refused_as_owner) == 0
    # Root made it so (a Kubernetes emptyDir is 0777, shared by one pod's containers): a warning.
    os.chown(open_dir, 0, 0)
    assert "not sticky" in check_dir(str(open_dir), "socket directory")
    load_config(None, env={}, overrides={"socket": str(open_dir / "d.sock")})


def test_workers_auto_follows_the_cpus_this_process_may_use(short_tmp: Path) -> None:
    cfg = load_config(None, env={}, overrides={"socket": str(short_tmp / "a.sock")})
    assert cfg.workers == 0
    assert cfg.transfer_workers == min(8, max(2, usable_cpus() // 2))
    assert 2 <= cfg.transfer_workers <= 8


def test_usable_cpus_honours_a_cgroup_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path)) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: rounds up
    assert usable_cpus(str(tmp_path)) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text("1000 100000\n")
    assert usable_cpus(str(tmp_path)) == 1
    assert usable_cpus(str(tmp_path / "nowhere")) == affinity
