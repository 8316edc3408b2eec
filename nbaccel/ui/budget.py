"""How much rank output the text view prints: one byte budget for the whole launch.

A rank printing 500k lines would otherwise send all of them through the kernel into the
notebook (megabytes the browser must render and the saved notebook keeps). Within the budget
every line is printed as it comes; past it, lines are counted instead, and printing resumes once
the budget has refilled for a second, after a note of how many were skipped. When the output
calms down (or the launch ends) the skipped lines' last ones are printed, so the end of a flood,
an error say, is always seen. Every line is in the rank's log file regardless.

>>> b = OutputBudget(burst=100, rate=0.0, resume=50)
>>> b.admit((0, "stdout"), ["a" * 30, "b" * 30, "c" * 30])
(0, ['aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'])
>>> [(key, gap.count, list(gap.tail)) for key, gap in b.take_gaps(force=True)]
[((0, 'stdout'), 2, ['bbbbbbbbbbbbbbbbbbbbbbbbbbbbbb', 'cccccccccccccccccccccccccccccc'])]
"""

from __future__ import annotations

import collections
import dataclasses
import time

BURST = 256 * 1024  # characters that may be printed at once
RATE = 64 * 1024  # characters a second, the whole launch
RESUME = 64 * 1024  # after skipping, printing resumes once this much budget is back
LINE_COST = 32  # each line's cost beyond its text: messages and rendering are per line too
TAIL_LINES = 20  # skipped lines printed when a flood ends
TAIL_CHARS = 64 * 1024


@dataclasses.dataclass
class Gap:
    """Lines of one rank's stream not printed: how many, and the last of them."""

    count: int = 0
    tail: collections.deque[str] = dataclasses.field(default_factory=collections.deque)
    tail_chars: int = 0

    def add(self, lines: list[str]) -> None:
        self.count += len(lines)
        for line in lines[-TAIL_LINES:]:
            self.tail.append(line)
            self.tail_chars += len(line)
        while len(self.tail) > TAIL_LINES or (self.tail_chars > TAIL_CHARS and len(self.tail) > 1):
            self.tail_chars -= len(self.tail.popleft())


class OutputBudget:
    """A token bucket over printed characters, with the gaps it made per (rank, stream)."""

    def __init__(self, burst: int = BURST, rate: float = RATE, resume: int = RESUME) -> None:
        self.burst, self.rate, self.resume = burst, rate, resume
        self._tokens = float(burst)
        self._refilled_at = time.monotonic()
        self._skipping = False
        self._gaps: dict[tuple[int, str], Gap] = {}

    def admit(self, key: tuple[int, str], lines: list[str]) -> tuple[int, list[str]]:
        """(lines skipped on ``key`` before these, to note first; the lines to print now)."""
        self._refill()
        shown: list[str] = []
        if not self._skipping:
            for line in lines:
                cost = len(line) + LINE_COST
                if cost > self._tokens:
                    self._skipping = True
                    break
                self._tokens -= cost
                shown.append(line)
        before = self._gaps.pop(key, Gap()).count if shown else 0
        if len(shown) < len(lines):
            self._gaps.setdefault(key, Gap()).add(lines[len(shown) :])
        return before, shown

    def take_gaps(self, force: bool = False) -> list[tuple[tuple[int, str], Gap]]:
        """The gaps to show now with their last lines: once the budget is back (or ``force``,
        at the end); their lines are charged to it."""
        self._refill()
        if not self._gaps or (not force and self._skipping):
            return []
        gaps, self._gaps = sorted(self._gaps.items()), {}
        for _, gap in gaps:
            self._tokens -= gap.tail_chars + LINE_COST * (len(gap.tail) + 1)
        return gaps

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._refilled_at) * self.rate)
        self._refilled_at = now
        if self._skipping and self._tokens >= self.resume:
            self._skipping = False
