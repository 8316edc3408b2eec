"""Run tests as on a machine booted a moment ago: ``time.monotonic()`` near zero.

A fresh CI machine's monotonic clock starts near 0, a developer's reads days; a test that
passes hand-picked times (``now=1032.0``) to logic that also reads the clock behind its back
passes on one and fails on the other. The view model's readers take ``now`` instead; this keeps
them honest:

- ``fresh_boot_clock``: a fixture that shifts ``time.monotonic`` so it reads ~1 s now (the
  pure view tests run under it, beside the real clock);
- ``pytest -p tests.fresh_boot -m "not slow"``: the whole fast layer so (rank processes and
  kernels keep their own clocks; only this process's reads move).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

FRESH_BOOT_AT = 1.0  # what the shifted clock reads when the shift starts


def shifted_monotonic(reads_now: float = FRESH_BOOT_AT) -> Callable[[], float]:
    """A monotonic clock that reads ``reads_now`` now and advances as the real one does.

    >>> clock = shifted_monotonic(1.0)
    >>> 1.0 <= clock() < 2.0
    True
    """
    real = time.monotonic
    offset = real() - reads_now
    return lambda: real() - offset


@pytest.fixture(params=["real clock", "fresh boot"])
def fresh_boot_clock(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Run a test twice: at the real clock, and as if the machine had booted a second ago."""
    if request.param == "fresh boot":
        monkeypatch.setattr(time, "monotonic", shifted_monotonic())
    yield


_real_monotonic = time.monotonic


def pytest_configure(config: pytest.Config) -> None:
    """As a plugin (``-p tests.fresh_boot``): the whole run reads a clock started near 0."""
    time.monotonic = shifted_monotonic()  # type: ignore[assignment]


def pytest_unconfigure(config: pytest.Config) -> None:
    time.monotonic = _real_monotonic  # type: ignore[assignment]
