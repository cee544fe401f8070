"""[registry] in the TOML file, KVXFERD_REGISTRY_* in the environment, and their validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvxferd.config import ConfigError, load_config
from kvxferd.fleet.registry import DaemonRecord, GroupRecord


def write(tmp: Path, text: str) -> str:
    p = tmp / "k.toml"
    p.write_text(f'socket = "{tmp}/s.sock"\n' + text)
    return str(p)


def test_table_env_and_defaults(short_tmp: Path) -> None:
    cfg = load_config(write(short_tmp, ""), env={})
    assert (cfg.registry_backend, cfg.registry_endpoints, cfg.registry_lease_ttl_s) == ("none", (), 10)
    path = write(short_tmp, '[registry]\nbackend = "etcd"\nendpoints = ["10.0.0.1:2379", "10.0.0.2:2379"]\n'
                            'prefix = "/prod/kvx"\nlease_ttl_s = 5\nrequired = true\n')
    cfg = load_config(path, env={})
    assert cfg.registry_endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert (cfg.registry_prefix, cfg.registry_lease_ttl_s, cfg.registry_required) == ("/prod/kvx", 5, True)
    cfg = load_config(path, env={"KVXFERD_REGISTRY_ENDPOINTS": "e1:1,e2:2", "KVXFERD_REGISTRY_REQUIRED": "0"})
    assert cfg.registry_endpoints == ("e1:1", "e2:2") and cfg.registry_required is False


@pytest.mark.parametrize("text,msg", [
    ('[registry]\nbackend = "zookeeper"\n', "registry.backend must be none|etcd"),
    ('[registry]\nbackend = "etcd"\n', "registry.endpoints must list etcd"),
    ('[registry]\nbackend = "etcd"\nendpoints = ["etcd"]\n', "must be HOST:PORT, got 'etcd'"),
    ('[registry]\nbackend = "etcd"\nendpoints = ["e:1"]\nlease_ttl_s = 0\n', "lease_ttl_s must be 1..3600"),
    ('[registry]\nbackend = "etcd"\nendpoints = ["e:1"]\nlease_ttl_s = 1.5\n', "registry_lease_ttl_s: invalid value"),
    ('[registry]\nprefix = "kvx/"\n', "registry.prefix must look like /kvxferd"),
    ('[registry]\nttl = 3\n', "unknown key 'ttl' in [registry]"),
    ('[registry]\ntls_cert = "/nonexistent.pem"\ntls_key = "/nonexistent.key"\n', "no such file"),
    ('[registry]\ntls_cert = "/etc/hostname"\n', "tls_cert and registry.tls_key must be given together"),
])
def test_bad_values_are_refused(short_tmp: Path, text: str, msg: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(short_tmp, text), env={})
    assert msg in str(err.value)


def test_record_round_trip_and_refusals() -> None:
    rec = DaemonRecord("d", "i", "10.0.0.1:7471", "node", "0.1.0", 1.5, (GroupRecord("g", "prefill", 2, (0, 1), "ab"),))
    assert DaemonRecord.from_json(rec.to_json()) == rec
    for bad in (b"{}", b"not json", b'{"format": 99}', rec.to_json().replace(b'"ranks"', b'"rank"')):
        with pytest.raises(ValueError):
            DaemonRecord.from_json(bad)


def test_peer_caps_fit_a_1000_node_fleet_by_default(short_tmp: Path) -> None:
    # A decode daemon of a 1,000-node prefill/decode mesh may know every other daemon, and ids that
    # left (a pod's new name) linger until peer_forget_s: twice the fleet.
    cfg = load_config(write(short_tmp, ""), env={})
    assert cfg.max_peers >= 2 * 1000
