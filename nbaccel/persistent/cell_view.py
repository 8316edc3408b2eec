"""A ``%%ranks`` cell, shown the way a local cell shows: what the cell printed, per rank.

Each rank's lines arrive as ``[rankN] …`` stream output (the text view's labels and budget);
the ``[rankN] Out:`` values and errors are the magic's. There is no launch header and no rank
table: a cell that reports progress (``nbaccel.progress``, ``nbaccel.log``) gets the live
dashboard's table and charts (widget frontends) or progress lines (text), for the cell's ranks
only, and a cell ends with one status line only when it ran long or stalled on the way.

``nbaccel.Ranks`` gives each cell one (``persistent/session.py``), e.g. for ``%%ranks --rank 1`` in
JupyterLab:

>>> view = CellView(ranks=[1], widgets=True)   # [rank1] lines; a table only with progress
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from nbaccel.launch.state import RUNNING, LaunchState
from nbaccel.rank.reporting import STEP_BAR_DESC
from nbaccel.ui.formats import format_bytes, format_seconds
from nbaccel.ui.text import TextView

LONG_CELL = 10.0  # s: a cell that ran this long ends with a status line
# A rank's lines are held until its burst is over (this long without a new line from it, or
# BURST_HOLD after its first held line), so two ranks' multi-line prints do not mix line by line.
BURST_QUIET = 0.1  # s
BURST_HOLD = 0.5  # s


def _ranks(numbers: list[int]) -> str:
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(map(str, numbers))


def cell_status(state: LaunchState, now: float) -> str:
    """The cell's ranks in one line: what each did, how long the cell took, their memory.

    ``ranks 0, 1 finished in 12.3 s · RSS 410 MiB, 415 MiB``, or
    ``rank 0 finished, rank 1 failed (raised ValueError: x) in 0.2 s``.
    """
    by_status: dict[str, list[int]] = {}
    for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
        by_status.setdefault(str(rank.status), []).append(rank.rank)
    parts = []
    for status, numbers in by_status.items():
        errors = {state.ranks[n].error_line for n in numbers} - {None}
        why = f" ({next(iter(errors))})" if len(errors) == 1 else ""
        parts.append(f"{_ranks(numbers)} {status}{why}")
    text = ", ".join(parts) + f" in {format_seconds(state.elapsed(now))}"
    memory = [r.rss for r in sorted(state.ranks.values(), key=lambda r: r.rank)]
    if any(m is not None for m in memory):
        text += " · RSS " + ", ".join(format_bytes(m) for m in memory)
    if state.longest_stall:
        text += f" · stalled for up to {format_seconds(state.longest_stall)}"
    return text


def reports_progress(state: LaunchState, now: float) -> bool:
    """Whether a cell's ranks report progress: bars or metrics of their own, or optimizer steps
    (counted without being asked) for ``LONG_CELL`` seconds. A short cell that stepped an
    optimizer once is no training run, and showed a table "optimizer steps: 0" and a summary.

    >>> from nbaccel.launch.state import RankState
    >>> state = LaunchState(info=None, ranks={0: RankState(0)}, started_at=100.0)
    >>> state.ranks[0].on_progress(1, 1, None, STEP_BAR_DESC, 0.0, now=100.0)
    >>> reports_progress(state, now=101.0), reports_progress(state, now=100.0 + LONG_CELL)
    (False, True)
    """
    ranks = state.ranks.values()
    if any(r.metrics or any(b.desc != STEP_BAR_DESC for b in r.bars.values()) for r in ranks):
        return True
    return any(r.bars for r in ranks) and state.elapsed(now) >= LONG_CELL


class CellView(TextView):
    """The view of one ``%%ranks`` cell (see the module docstring).

    ``ranks``: the ranks that run the cell (default: those running when it starts);
    ``widgets``: show progress in the dashboard's table and charts instead of text lines.
    """

    def __init__(
        self, ranks: Sequence[int] | None = None, widgets: bool = False, show_progress: bool = True
    ) -> None:
        super().__init__(show_progress=show_progress and not widgets)
        self._cell_ranks = list(ranks) if ranks is not None else None
        self._widgets = widgets and show_progress
        self._dashboard: Any = None
        self._session_state: LaunchState | None = None
        self._held: dict[tuple[int, str], tuple[list[str], float, float]] = {}  # lines, first, last

    def start(self, state: LaunchState) -> None:
        self._session_state = state
        chosen = self._cell_ranks
        if chosen is None:
            chosen = [r for r, s in state.ranks.items() if s.status == RUNNING]
        # The session's state holds every rank; the others keep their last cell's status.
        ranks = {r: state.ranks[r] for r in chosen if r in state.ranks}
        self._state = dataclasses.replace(state, ranks=ranks)
        self._last_progress = time.monotonic()

    def _write(self, rank: int, stream: str, lines: list[str]) -> None:
        """Hold ``lines`` with the rest of the rank's burst (released by :meth:`_release`)."""
        now = time.monotonic()
        held, first, _ = self._held.get((rank, stream), ([], now, now))
        self._held[(rank, stream)] = (held + lines, first, now)

    def _release(self, now: float | None) -> None:
        """Print the bursts that are over (every one when ``now`` is None), in rank order."""
        for key in sorted(self._held):
            lines, first, last = self._held[key]
            if now is None or now - last >= BURST_QUIET or now - first >= BURST_HOLD:
                del self._held[key]
                super()._write(*key, lines)

    def update(self) -> None:
        self._sync()
        self._release(time.monotonic())
        super().update()
        state = self._state
        if state is None or not self._widgets:
            return
        if self._dashboard is None and reports_progress(state, time.monotonic()):
            try:
                from nbaccel.ui.dashboard import Dashboard

                dashboard = Dashboard(panes=False, title=cell_status)
                dashboard.start(state)
            except ImportError:  # no ipywidgets: progress lines, as in a terminal
                self._widgets, self.show_progress = False, True
                return
            self._dashboard = dashboard
        if self._dashboard is not None:
            self._dashboard.update()

    def settle(self) -> None:
        """A rank paused: its lines, and the others', read before the pdb that follows."""
        self._release(None)
        self._flush()

    def finish(self) -> None:
        self._sync()
        self._release(None)
        self._print_skipped(force=True)
        self._release(None)
        state, now = self._state, time.monotonic()
        if self._dashboard is not None:
            self._dashboard.finish()  # its summary's first line is the status
        elif state is not None and (state.elapsed(now) >= LONG_CELL or state.longest_stall):
            print(f"nbaccel: {cell_status(state, now)}")
        self._flush()

    def _sync(self) -> None:
        """The cell's view of the state follows the session's (outcome, times, stalls, logs)."""
        full, mine = self._session_state, self._state
        if full is None or mine is None:
            return
        for field in dataclasses.fields(full):
            if field.name != "ranks":
                setattr(mine, field.name, getattr(full, field.name))
