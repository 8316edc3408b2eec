"""A toy view: one module, passed as ``view=`` (tests/test_extension_points.py)."""

from __future__ import annotations

from nbaccel.launch.state import LaunchState


class ToyView:
    """Keeps what a launch shows it: its state, each rank's lines, whether it finished."""

    def __init__(self) -> None:
        self.state: LaunchState | None = None
        self.lines: dict[int, list[str]] = {}
        self.finished = False

    def start(self, state: LaunchState) -> None:
        self.state = state

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        self.lines.setdefault(rank, []).extend(lines)

    def partial(self, rank: int, stream: str, text: str) -> None:
        pass

    def update(self) -> None:
        pass

    def finish(self) -> None:
        self.finished = True
