"""Readiness budgets that scale with the machine's load, and name what they waited for.

A fixed wall-clock guess ("60 s for a daemon, 240 s for an engine") is right on a quiet box and
wrong on a shared 2-core CI box at load 15-20, where the same start-up takes several times longer.
A budget here is ``base seconds x slowness``, slowness being ``max(1, 1-minute loadavg / CPUs)``,
re-read at each check so a load that rises during the wait extends it; it is capped at
``AUTO_CAP`` so a wedged start still fails in bounded time. ``KVX_TEST_SLOWNESS`` (a number > 0)
replaces the measured factor, e.g. on a box whose loadavg says nothing (containers counting the
host's load).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SLOWNESS_ENV = "KVX_TEST_SLOWNESS"
# 4x: a 60 s daemon start may take 4 min, a 240 s engine start 16 min; past that the box is too
# loaded for any bound to mean much and the suite's own limits are near.
AUTO_CAP = 4.0


def _load() -> tuple[float, int]:
    try:
        load = os.getloadavg()[0]
    except OSError:  # no loadavg on this platform: assume a quiet box
        load = 0.0
    return load, os.cpu_count() or 1


def slowness() -> float:
    """How many times slower than a quiet box this one is now (>= 1 unless overridden)."""
    raw = os.environ.get(SLOWNESS_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{SLOWNESS_ENV}={raw!r} must be a positive number (1 = a quiet box)")
        return value
    load, cpus = _load()
    return min(AUTO_CAP, max(1.0, load / cpus))


def budget(base_s: float) -> float:
    """``base_s`` scaled to the machine's current slowness."""
    return base_s * slowness()


@dataclass(frozen=True)
class Budget:
    """A wait for ``what``: ``base_s`` on a quiet box, scaled by the largest slowness seen."""

    what: str
    base_s: float
    started: float = field(default_factory=time.monotonic)
    start_factor: float = field(default_factory=slowness)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def limit(self) -> float:
        return self.base_s * max(self.start_factor, slowness())

    def expired(self) -> bool:
        return self.elapsed() > self.limit()

    def left(self) -> float:
        return max(0.0, self.limit() - self.elapsed())

    def failure(self, detail: str = "") -> str:
        load, cpus = _load()
        limit = self.limit()
        return (f"{self.what}: not ready after {self.elapsed():.1f} s (budget {limit:.1f} s = {self.base_s:g} s "
                f"x slowness {limit / self.base_s:.2f}; load {load:.1f} on {cpus} CPUs; {SLOWNESS_ENV} "
                f"overrides the factor){': ' + detail if detail else ''}")


def wait_for(what: str, ready: Callable[[], bool], base_s: float, *, every: float = 0.02,
             gone: Callable[[], str] | None = None) -> float:
    """Polls ``ready`` until true and returns the seconds it took; fails the test naming ``what``
    when the scaled budget runs out, or at once when ``gone`` says why it never will be."""
    b = Budget(what, base_s)
    while True:
        if ready():
            return b.elapsed()
        why = gone() if gone is not None else ""
        if why:
            raise AssertionError(f"{what}: gave up after {b.elapsed():.1f} s: {why}")
        if b.expired():
            raise AssertionError(b.failure())
        time.sleep(every)
