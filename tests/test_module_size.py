"""The daemon stays in modules a reader can hold in their head (the house rule: about 500 lines).

A module that grows past the limit is split along its seams before it takes the next feature;
this test is where CI notices that it has not been.
"""

from __future__ import annotations

from tests.conftest import ROOT

# "About 500": a few lines of slack so a docstring fix does not force a split.
MAX_LINES = 520


def test_no_daemon_module_is_over_the_limit() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "kvxferd").rglob("*.py")}
    assert len(sizes) > 40, sorted(sizes)  # the walk found the package
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"
