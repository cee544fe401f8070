"""Regenerate the protobuf/gRPC stubs in kvxfer_protocol/pb.

Run: python scripts/gen_proto.py [--out DIR]
The stubs are checked in; tests/test_proto_stubs.py fails when they are stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
DEFAULT_OUT = ROOT / "kvxfer_protocol" / "pb"


def generate(out: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # type: ignore[import-untyped]

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with status {rc}")
    written = sorted(p for p in out.rglob("*.py*") if p.suffix in (".py", ".pyi"))
    # protoc emits absolute imports ("from kvxfer.v1 import x_pb2"); the stubs
    # live inside kvxfer_protocol, so make them package-relative.
    for path in written:
        text = path.read_text()
        text = re.sub(r"^from kvxfer\.v1 import ", "from . import ", text, flags=re.M)
        path.write_text(text)
    for pkg in (out, out / "kvxfer", out / "kvxfer" / "v1"):
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
