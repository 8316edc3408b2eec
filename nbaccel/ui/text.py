"""The plain-text view: labelled rank output as it arrives, compact progress lines at a bounded
rate, and the final summary as text. Works in every frontend and in plain scripts."""

from __future__ import annotations

import sys
import time

from nbaccel.core.launch_state import LaunchState
from nbaccel.ui.summary import format_metrics, format_progress, summary_text


class TextView:
    """Print each rank's lines as ``[rankN] text`` on the kernel's stdout/stderr.

    ``progress_interval`` bounds how often progress lines are printed (seconds), whatever the
    ranks' step rate.
    """

    def __init__(self, show_progress: bool = True, progress_interval: float = 2.0) -> None:
        self.show_progress = show_progress
        self.progress_interval = progress_interval
        self._state: LaunchState | None = None
        self._last_progress = 0.0
        self._last_flush = 0.0
        self._printed_progress: dict[int, str] = {}

    def start(self, state: LaunchState) -> None:
        self._state = state
        self._last_progress = time.monotonic()
        print(f"nbaccel: launching {state.info.describe()}", file=sys.stdout)

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        target = sys.stderr if stream == "stderr" else sys.stdout
        label = f"[rank{rank}] "
        target.write("".join(f"{label}{line}\n" for line in lines))

    def update(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= 0.1:
            self._flush()
            self._last_flush = now
        if not self.show_progress or self._state is None:
            return
        if now - self._last_progress < self.progress_interval:
            return
        self._last_progress = now
        for rank in sorted(self._state.ranks.values(), key=lambda r: r.rank):
            if rank.bar is None and not rank.metrics:
                continue
            text = f"{format_progress(rank)} {format_metrics(rank.metrics)}".strip()
            if self._printed_progress.get(rank.rank) != text:
                self._printed_progress[rank.rank] = text
                print(f"[rank{rank.rank}] progress: {text}", file=sys.stdout)

    def finish(self) -> None:
        if self._state is not None and self.show_progress:
            print(summary_text(self._state), file=sys.stdout)
        self._flush()

    @staticmethod
    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
