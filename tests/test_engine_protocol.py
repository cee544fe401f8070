"""Engine clients' protocol version, against a real daemon: RegisterEngine carries the client's
PROTOCOL_VERSION; another MAJOR is refused (FAILED_PRECONDITION, naming both versions) and
registers nothing; an empty version (a client older than the field) is accepted with one warning
line naming the engine; a malformed one is INVALID_ARGUMENT."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvxfer_client import Layout, PrefillSender
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from kvxfer_protocol.version import PROTOCOL_VERSION, parse_protocol
from tests.test_e2e import status

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16, dtype="bfloat16")


def test_register_engine_checks_the_client_protocol_major(daemons: Any) -> None:
    d = daemons("proto-eng")
    mine = parse_protocol(PROTOCOL_VERSION)
    assert mine is not None
    other_major = f"{mine[0] + 1}.0"
    newer_minor = f"{mine[0]}.{mine[1] + 7}"

    def register(version: str, name: str) -> engine_pb2.RegisterEngineReply:
        req = engine_pb2.RegisterEngineRequest(
            role=engine_pb2.ROLE_PREFILL, group=f"g-{name}", layout=LAYOUT.to_pb(),
            parallel=common_pb2.Parallelism(tp_size=1, tp_rank=0), ring_bytes=256 << 10, name=name,
            protocol_version=version,
        )
        with grpc.insecure_channel(f"unix:{d.socket}") as ch:
            reply: engine_pb2.RegisterEngineReply = engine_pb2_grpc.EngineStub(ch).RegisterEngine(req, timeout=10)
            return reply

    for version, code in ((other_major, grpc.StatusCode.FAILED_PRECONDITION),
                          ("junk", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as info:
            register(version, f"refused-{version}")
        assert info.value.code() == code, (version, info.value.details())
        assert version in (info.value.details() or "") and PROTOCOL_VERSION in (info.value.details() or "")
    assert [e.name for e in status(d.socket).engines] == []  # a refusal registers nothing

    assert register(newer_minor, "newer-minor").engine_id  # a MINOR only adds what we may ignore
    assert register("", "old-client").engine_id
    warned = [line for line in d.log_text().splitlines() if "sent no protocol version" in line]
    assert len(warned) == 1 and "WARNING" in warned[0] and "'old-client'" in warned[0], warned
    assert not any("newer-minor" in line and "WARNING" in line for line in d.log_text().splitlines())

    # The shipped client sends its version: it registers, and adds no warning.
    with PrefillSender(socket=d.socket, group="g-client", layout=LAYOUT, ring_bytes=256 << 10, name="shipped"):
        names = sorted(e.name for e in status(d.socket).engines)
    assert names == ["newer-minor", "old-client", "shipped"]
    assert sum("sent no protocol version" in line for line in d.log_text().splitlines()) == 1
