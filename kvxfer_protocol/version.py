"""Versions: the package's release (one source: pyproject reads it from here) and the wire protocol's.

The protocol version is "MAJOR.MINOR". Daemons exchange it in the peer handshake (the `version`
field of HandshakeRequest/HandshakeReply) and refuse a peer whose MAJOR differs: a MINOR only adds
what an older peer may ignore (new optional fields, new messages it is never sent unasked).
"""

from __future__ import annotations

PACKAGE_VERSION = "0.1.0"
# 1.1: layer parts (EnqueueChunkRequest.layer_*, RegisterEngineRequest/Bootstrap.layer_parts,
# LandedChunk.layer_*, "kvx4" notifications), all opt-in: a 1.0 peer or engine never sees them.
PROTOCOL_VERSION = "1.1"


def parse_protocol(version: str) -> tuple[int, int] | None:
    """(major, minor) of "MAJOR.MINOR" (a third part, as in a release number, is ignored), or None."""
    parts = version.strip().split(".")
    if len(parts) < 2 or not all(p.isdigit() and len(p) <= 6 for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def protocol_mismatch(theirs: str, ours: str = PROTOCOL_VERSION, who: str = "peer") -> str:
    """Empty when a `who` (peer daemon, engine client) speaking `theirs` can work with us, else
    why not, naming both versions."""
    mine, other = parse_protocol(ours), parse_protocol(theirs)
    assert mine is not None, ours
    shown = repr(theirs[:40]) if other is None else theirs
    if other is None:
        return f"{who} protocol version {shown} is not MAJOR.MINOR; this daemon speaks {ours}"
    if other[0] != mine[0]:
        return (f"incompatible {who} protocol version {theirs} (this daemon speaks {ours}; "
                f"the major versions {other[0]} and {mine[0]} differ)")
    return ""
