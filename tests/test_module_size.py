"""The daemon stays in modules a reader can hold in their head (the house rule: about 500 lines).

A module that grows past the limit is split along its seams before it takes the next feature;
this test is where CI notices that it has not been.
"""

from __future__ import annotations

from tests.conftest import ROOT

# "About 500": a few lines of slack so a docstring fix does not force a split.
MAX_LINES = 520


# The daemon, the engines' client and the wire contract they share (its generated stubs aside).
PACKAGES = ("kvxferd", "clients/python/kvxfer_client", "kvxfer_protocol")


def test_no_module_is_over_the_limit() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
             for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "pb" not in p.relative_to(ROOT).parts}
    for pkg in PACKAGES:
        assert sum(name.startswith(pkg + "/") for name in sizes) >= 5, (pkg, sorted(sizes))  # the walk found it
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"
