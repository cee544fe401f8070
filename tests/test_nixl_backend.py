"""The NIXL backend is a setting (`nixl_backend`, docs/transports.md): a real daemon asked for one the
installed NIXL does not offer stops at start with one line that names the backends it does offer."""

from __future__ import annotations

from typing import Any


def test_unknown_nixl_backend_stops_the_start_naming_the_offered_ones(daemons: Any) -> None:
    d = daemons("nb", "--set", "nixl_backend=NOSUCHPLUGIN", wait=False)
    assert d.proc.wait(60) == 2
    lines = [ln for ln in d.log_text().splitlines() if ln.startswith("kvxferd: error")]
    assert len(lines) == 1, d.log_text()
    # The offered list comes from the agent itself: UCX (what the daemon uses by default) is in it.
    assert "'NOSUCHPLUGIN'" in lines[0] and "it offers: " in lines[0], lines[0]
    offered = lines[0].split("it offers: ", 1)[1].split(", ")
    assert "UCX" in offered and "NOSUCHPLUGIN" not in offered, lines[0]
