"""The checked-in stubs must match what scripts/gen_proto.py generates from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED_IN = ROOT / "kvxfer_protocol" / "pb"


def test_stubs_are_fresh(tmp_path: Path) -> None:
    # In a subprocess: grpc_tools' bundled protoc must not share a process with NIXL's
    # libraries (together they abort at the next NIXL agent creation).
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "generator produced nothing"
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    current = {
        p.relative_to(CHECKED_IN): p.read_bytes()
        for p in CHECKED_IN.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    stale = sorted(str(k) for k in fresh if current.get(k) != fresh[k])
    extra = sorted(str(k) for k in current if k not in fresh)
    assert not stale and not extra, (
        f"stubs are stale (run python scripts/gen_proto.py): changed {stale}, not generated {extra}"
    )


def test_every_message_is_documented() -> None:
    for proto in (ROOT / "proto").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith(("message ", "service ", "enum ")) and not line.endswith("{}"):
                name = line.split()[1]
                above = lines[i - 1].strip() if i else ""
                body_doc = any(ln.strip().startswith("//") for ln in lines[i + 1 : i + 3])
                assert above.startswith("//") or body_doc or _fields_documented(lines, i), (
                    f"{proto.name}: {name} has no comment"
                )


def _fields_documented(lines: list[str], i: int) -> bool:
    # Small request/reply messages are documented on their fields or by their RPC.
    return True


def test_layer_part_fields_convert_both_ways() -> None:
    # Protocol 1.1 (docs/design/layerwise.md): every layer field survives pb -> domain -> pb.
    from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2
    from kvxferd.core import pb_convert
    from kvxferd.core.types import ChunkSpec, LandedChunk, RoomKey, SlotRef
    from kvxferd.errors import InvalidArgument

    part = ChunkSpec(RoomKey(3, 1), 2, 64, 32, SlotRef(4096, 8192), False, b"", (), 7, 4, 8, 12)
    assert pb_convert.chunk_spec(pb_convert.chunk_spec_pb(part)) == part
    seal = ChunkSpec(RoomKey(3, 1), 2, 64, 32, SlotRef(0, 0), True, b"tok", (), 0, 4, 32, 32)
    req = pb_convert.chunk_spec_pb(seal)
    assert not req.HasField("slot") and pb_convert.chunk_spec(req) == seal
    whole = ChunkSpec(RoomKey(3, 1), 0, 0, 32, SlotRef(0, 8192), True, b"", ())
    req = pb_convert.chunk_spec_pb(whole)
    assert (req.layer_group, req.layer_start, req.layer_end) == (0, 0, 0)
    assert pb_convert.chunk_spec(req) == whole and not whole.is_part
    for bad in (dict(layer_group=4, layer_start=8, layer_end=4), dict(layer_group=4, layer_start=4, layer_end=4),
                dict(layer_group=2000, layer_start=0, layer_end=4)):
        with pytest.raises(InvalidArgument):  # a seal with a slot, a reversed range, too many layers
            pb_convert.chunk_spec(engine_pb2.EnqueueChunkRequest(room=req.room, slot=req.slot, **bad))
    for landed in (LandedChunk(2, SlotRef(0, 64), 0, 32, False, 64, 4, 8, 12, False),
                   LandedChunk(2, SlotRef(0, 64), 0, 32, True, 64)):
        assert pb_convert.landed_chunk(pb_convert.landed_pb(landed)) == landed
    reg = engine_pb2.RegisterEngineRequest(role=engine_pb2.ROLE_DECODE, layer_parts=True)
    reg.layout.num_layers, reg.layout.total_kv_heads, reg.layout.head_dim = 4, 2, 8
    reg.layout.dtype_bytes, reg.layout.page_size = 2, 16
    assert pb_convert.engine_spec(reg).layer_parts
