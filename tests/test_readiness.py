"""The tests' readiness budgets (tests/readiness.py): scaled by load or KVX_TEST_SLOWNESS, and a
failure says what was waited for and how the budget was reached."""

from __future__ import annotations

import os

import pytest

from tests.readiness import AUTO_CAP, SLOWNESS_ENV, Budget, budget, slowness, wait_for


def test_budget_scales_with_the_override_and_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOWNESS_ENV, "2.5")
    assert slowness() == 2.5 and budget(10.0) == 25.0
    for bad in ("0", "-1", "fast", "inf", "nan"):
        monkeypatch.setenv(SLOWNESS_ENV, bad)
        with pytest.raises(ValueError, match=SLOWNESS_ENV):
            slowness()
    monkeypatch.delenv(SLOWNESS_ENV)
    cpus = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cpus, 0.0, 0.0))
    assert slowness() == 3.0
    monkeypatch.setattr(os, "getloadavg", lambda: (100.0 * cpus, 0.0, 0.0))
    assert slowness() == AUTO_CAP  # a wedged start still fails in bounded time
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    assert slowness() == 1.0  # never shorter than the quiet-box base


def test_a_wait_names_what_it_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOWNESS_ENV, "2")
    calls: list[int] = []

    def never() -> bool:
        calls.append(1)
        return False

    with pytest.raises(AssertionError) as info:
        wait_for("the widget's socket", never, 0.05, every=0.01)
    msg = str(info.value)
    assert "the widget's socket" in msg and "budget 0.1 s = 0.05 s x slowness 2.00" in msg, msg
    assert len(calls) >= 5  # polled through the scaled 0.1 s, not the 0.05 s base
    with pytest.raises(AssertionError, match=r"the engine: gave up after .* exited with 3"):
        wait_for("the engine", lambda: False, 60.0, gone=lambda: "exited with 3")
    ticks = iter([False, False, True])
    assert wait_for("ready on the third poll", lambda: next(ticks), 60.0, every=0.0) >= 0.0


def test_a_load_rise_during_the_wait_extends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOWNESS_ENV, "1")
    b = Budget("daemon x", 10.0)
    monkeypatch.setenv(SLOWNESS_ENV, "3")
    assert b.limit() == 30.0 and "daemon x" in b.failure("log tail")
