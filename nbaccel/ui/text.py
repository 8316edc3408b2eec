"""The plain-text view: labelled rank output as it arrives (within a budget, so a flood prints a
bounded amount: :mod:`nbaccel.ui.budget`), a run line and per-rank progress lines at a bounded
rate, a stall notice, and the final summary as text. Works in every frontend and in plain
scripts."""

from __future__ import annotations

import math
import sys
import time

from nbaccel.launch.state import DEFAULT_LINE_PREFIX, LaunchState, line_label
from nbaccel.ui.budget import OutputBudget
from nbaccel.ui.resources import MemorySampler
from nbaccel.ui.summary import (
    STRAGGLER_MARK,
    banner,
    format_memory,
    format_metrics,
    format_progress,
    run_line,
    settings_changed,
    stall_text,
    summary_text,
    waiting_text,
)

PARTIAL_QUIET = 1.0  # seconds an unfinished line (``\r`` progress) waits before it is printed


class TextView:
    """Print each rank's lines as ``[rankN] text`` on the kernel's stdout/stderr.

    ``progress_interval`` bounds how often progress lines are printed (seconds), whatever the
    ranks' step rate. An unfinished line (``print("\\rstep 5", end="")``) is printed once it has
    not changed for a second. Past the output budget, lines are skipped with a note of how many
    and where all of them are (the rank's log file), and the last ones are printed after.

    Example::

        nbaccel.notebook_launcher(train, num_processes=2, view=TextView(progress_interval=5))
    """

    def __init__(self, show_progress: bool = True, progress_interval: float = 2.0) -> None:
        self.show_progress = show_progress
        self.progress_interval = progress_interval
        self._state: LaunchState | None = None
        self._last_progress = 0.0
        self._last_flush = 0.0
        self._printed_progress: dict[int, str] = {}
        self._partial: dict[tuple[int, str], tuple[str, float]] = {}
        self._printed_partial: dict[tuple[int, str], str] = {}
        self._stall_shown, self._stall_reprint_at = "", 0.0
        self._printed_run = ""
        self._wait_shown, self._wait_shown_at, self._wait_reprint_at = "", 0.0, 0.0
        self._settings_shown = False
        self._memory = MemorySampler()
        self._budget = OutputBudget()

    def start(self, state: LaunchState) -> None:
        self._state = state
        self._last_progress = time.monotonic()
        _say(f"nbaccel: launching {banner(state)}")

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        if self._state is not None and rank in self._state.ranks:
            self._state.ranks[rank].note_activity()
        key = (rank, stream)
        # The unfinished line has ended: a line the splitter emits at EOF is not reported
        # through partial(""), so forget it here or it is printed again after a quiet second.
        self._partial.pop(key, None)
        shown = self._printed_partial.pop(key, None)
        if shown is not None and lines:
            rest = _rest(shown, lines[0])
            lines = lines[1:] if rest is None else [rest, *lines[1:]]
        skipped, lines = self._budget.admit(key, lines)
        notes = [self._skip_note(rank, stream, skipped)] if skipped else []
        self._write(rank, stream, notes + lines)

    def _write(self, rank: int, stream: str, lines: list[str]) -> None:
        target = sys.stderr if stream == "stderr" else sys.stdout
        label = self._label(rank)
        target.write("".join(f"{label}{line}\n" for line in lines))

    def _skip_note(self, rank: int, stream: str, count: int) -> str:
        path = self._state.log_path(rank, stream) if self._state is not None else None
        where = f"; every line is in {path}" if path else ""
        return f"… {count:,} lines not shown here (too much output){where}"

    def _print_skipped(self, force: bool = False) -> None:
        """Skipped lines' note and last lines, once the budget is back (or at the end)."""
        for (rank, stream), gap in self._budget.take_gaps(force):
            note = self._skip_note(rank, stream, gap.count)
            if len(gap.tail) < gap.count:
                note += f"; the last {len(gap.tail)}:"
            self._write(rank, stream, [note, *gap.tail])

    def _label(self, rank: int) -> str:
        if self._state is None:  # output before start(): the default labels
            return line_label(DEFAULT_LINE_PREFIX, rank, rank)
        return self._state.info.label(rank)

    def partial(self, rank: int, stream: str, text: str) -> None:
        """The rank's unfinished line now ("" when there is none)."""
        key = (rank, stream)
        if not text:
            self._partial.pop(key, None)
        elif self._partial.get(key, ("",))[0] != text:
            self._partial[key] = (text, time.monotonic())

    def update(self) -> None:
        now = time.monotonic()
        self._print_skipped()
        self._print_quiet_partials(now)
        self._print_settings()
        self._print_waiting(now)
        if now - self._last_flush >= 0.1:
            self._flush()
            self._last_flush = now
        if not self.show_progress or self._state is None:
            return
        self._memory.sample(self._state)  # also between progress lines: the summary shows it
        if now - self._last_progress < self.progress_interval:
            return
        self._last_progress = now
        state = self._state
        line = run_line(state, now) if any(r.bars for r in state.ranks.values()) else ""
        if line and line != self._printed_run:  # a slow step does not print it again and again
            self._printed_run = line
            _say(f"nbaccel {line}")
        slow = state.stragglers(now)
        for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
            compiling = rank.compiling_since is not None and not rank.done
            if rank.bar is None and not rank.metrics and not compiling:
                continue
            parts = [format_progress(rank, now) if rank.bar else "", format_metrics(rank.metrics)]
            parts.append("compiling (torch.compile)" if compiling else "")
            parts.append("" if rank.rss is None else format_memory(rank))
            parts.append(f"<- {STRAGGLER_MARK}" if rank.rank in slow else "")
            text = " ".join(p for p in parts if p).strip()
            if self._printed_progress.get(rank.rank) != text:
                self._printed_progress[rank.rank] = text
                _say(f"{self._label(rank.rank)}progress: {text}")
        self._print_stall(state, now)

    def _print_stall(self, state: LaunchState, now: float) -> None:
        """The stall notice when a stall starts, when where the ranks wait changes, and each
        time the stall has doubled in length; not every interval (a log would fill up)."""
        stall = stall_text(state, now)
        if not stall:
            self._stall_shown, self._stall_reprint_at = "", 0.0
            return
        quiet = state.stalled_for(now)
        where = stall.split("\n", 1)[-1]
        if where != self._stall_shown or (quiet is not None and quiet >= self._stall_reprint_at):
            # A paused rank (no stall: the launch holds still) is said once, while it stays.
            self._stall_shown = where
            self._stall_reprint_at = math.inf if quiet is None else 2 * quiet
            _say(f"nbaccel: {stall}")

    def _print_waiting(self, now: float) -> None:
        """What the launch waits for before its ranks run, with its seconds: when that changes
        (at most every ``progress_interval``), and each time the same wait has doubled."""
        state = self._state
        if state is None or state.waiting_for is None or not self.show_progress:
            self._wait_shown = ""  # progress=False: the headline and the ranks' lines only
            return
        waited = state.waited(now)
        changed = state.waiting_for != self._wait_shown
        if changed and (
            not self._wait_shown or now - self._wait_shown_at >= self.progress_interval
        ):
            self._wait_reprint_at = max(2 * waited, waited + self.progress_interval)
        elif not changed and waited >= self._wait_reprint_at:
            self._wait_reprint_at = 2 * waited
        else:
            return
        self._wait_shown, self._wait_shown_at = state.waiting_for, now
        _say(f"nbaccel: waiting for {waiting_text(state, now)}")

    def _print_quiet_partials(self, now: float) -> None:
        for key, (text, since) in list(self._partial.items()):
            shown = self._printed_partial.get(key)
            if now - since >= PARTIAL_QUIET and shown != text:
                self._printed_partial[key] = text
                rank, stream = key
                target = sys.stderr if stream == "stderr" else sys.stdout
                line = text if shown is None else _rest(shown, text)
                if line is not None:
                    target.write(f"{self._label(rank)}{line}\n")

    def _print_settings(self) -> None:
        """Once: what the function's Accelerator set that differs from the opening line."""
        if self._settings_shown or self._state is None:
            return
        changed = settings_changed(self._state)
        if changed:
            self._settings_shown = True
            _say(f"nbaccel: the ranks run {changed} (set in code)")

    def finish(self) -> None:
        self._print_skipped(force=True)
        self._print_settings()
        if self._state is not None and self.show_progress:
            self._memory.sample(self._state, force=True)
            _say(summary_text(self._state, time.monotonic()))
        self._flush()

    @staticmethod
    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def _rest(shown: str, text: str) -> str | None:
    """What to print of ``text`` when ``shown`` (its start, maybe) is on screen already.

    None when nothing is new; ``"… done"`` when ``text`` continues ``shown`` (a log reads the
    two as one line); the whole ``text`` when it replaced ``shown`` (a ``\r`` progress line).

    Example::

        >>> _rest("loading...", "loading... done")
        '… done'
    """
    if text == shown:
        return None
    if shown and text.startswith(shown):
        return "…" + text[len(shown) :]
    return text


def _say(text: str) -> None:
    """Print ``text`` as one line in one write: a background launch's view prints while the
    notebook's own cells print, and ``print``'s separate newline let their words meet
    mid-line."""
    sys.stdout.write(text + "\n")
