from __future__ import annotations

from pathlib import Path

import pytest

from kvxferd.config import ConfigError, load_config, parse_size


def test_defaults_validate(short_tmp: Path) -> None:
    cfg = load_config(None, env={}, overrides={"socket": str(short_tmp / "d.sock")})
    assert cfg.peer_listen == "127.0.0.1:7471"
    assert cfg.metrics_host == "127.0.0.1"
    assert cfg.socket_mode == 0o600
    assert cfg.transport == "nixl"


def test_precedence_file_env_flags(short_tmp: Path) -> None:
    f = short_tmp / "k.toml"
    f.write_text(f'socket = "{short_tmp}/a.sock"\nworkers = 3\nhost_pool_bytes = "128MiB"\nmetrics_port = 9000\n')
    cfg = load_config(f, env={"KVXFERD_WORKERS": "5"}, overrides={"metrics_port": 9100})
    assert cfg.workers == 5
    assert cfg.metrics_port == 9100
    assert cfg.host_pool_bytes == 128 << 20


@pytest.mark.parametrize(
    "content,needle",
    [
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("workers = 0\n", "workers must be 1..256"),
        ('peer_listen = "nohost"\n', "peer_listen must be HOST:PORT"),
        ('log_format = "xml"\n', "log_format"),
        ("workers = 'many'\n", "workers: invalid value"),
        ('tls_cert = "/nonexistent.pem"\ntls_key = "/nonexistent.key"\n', "no such file"),
        ('socket = "/proc/kvx/d.sock"\n', "cannot be created"),
        ("host_pool_bytes = 10\n", "at least 1 MiB"),
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
