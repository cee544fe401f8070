"""The wire contract's own rules (kvxfer_protocol): protocol versions, and one package version."""

from __future__ import annotations

import kvxfer_client
import kvxferd
from kvxfer_protocol.version import PACKAGE_VERSION, PROTOCOL_VERSION, parse_protocol, protocol_mismatch


def test_protocol_versions_are_compatible_within_a_major() -> None:
    assert parse_protocol("1.0") == (1, 0) and parse_protocol("2.13.7") == (2, 13)
    for bad in ("", "1", "x.1", "1.x", "-1.0", "1." + "9" * 40):
        assert parse_protocol(bad) is None, bad
    assert protocol_mismatch("1.4", ours="1.0") == ""
    assert protocol_mismatch("1.0", ours="1.4") == ""
    why = protocol_mismatch("2.1", ours="1.4")
    assert "2.1" in why and "1.4" in why
    why = protocol_mismatch("0.1.0", ours="1.4")  # what daemons before the check sent: their release
    assert "0.1.0" in why and "1.4" in why
    assert "'junk'" in protocol_mismatch("junk", ours="1.4")
    assert protocol_mismatch(PROTOCOL_VERSION) == ""


def test_one_version_source_for_the_daemon_and_the_client() -> None:
    assert kvxferd.__version__ == kvxfer_client.__version__ == PACKAGE_VERSION
