"""What the kernel knows about a launch while it runs: its settings and each rank's state.

The relay loop writes it; views only read it. Kept free of IPython and widgets so the text view,
the dashboard and the final summary all render the same facts.
"""

from __future__ import annotations

import dataclasses
import enum
import time


class _Text(str, enum.Enum):
    """An enum whose members read as their text (``f"{RankStatus.FAILED}"`` is ``failed``)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class RankStatus(_Text):
    """The life of a rank, in order; a rank ends in exactly one of the last three."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


STARTING, RUNNING, FINISHED, FAILED, STOPPED = RankStatus


class Outcome(_Text):
    """How a launch ended."""

    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed out"


@dataclasses.dataclass
class LaunchInfo:
    world_size: int
    num_processes: int
    node_rank: int
    first_rank: int
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    mixed_precision: str
    strategy: str
    gradient_accumulation_steps: int
    master_addr: str
    master_port: int
    start_method: str

    def describe(self) -> str:
        machines = f", node {self.node_rank}" if self.world_size != self.num_processes else ""
        return (
            f"{self.num_processes} process{'es' if self.num_processes != 1 else ''} "
            f"on {self.device} ({self.backend}{machines}), mixed_precision={self.mixed_precision}, "
            f"strategy={self.strategy}, {self.start_method}, {self.master_addr}:{self.master_port}"
        )


@dataclasses.dataclass
class BarState:
    n: int = 0
    total: int | None = None
    desc: str | None = None
    elapsed: float = 0.0
    closed: bool = False
    unit_scale: float | None = None

    @property
    def rate(self) -> float | None:
        return self.n / self.elapsed if self.elapsed > 0 and self.n else None

    @property
    def eta(self) -> float | None:
        rate = self.rate
        if rate is None or self.total is None:
            return None
        return max(0.0, (self.total - self.n) / rate)


@dataclasses.dataclass
class RankState:
    rank: int
    status: RankStatus = RankStatus.STARTING
    pid: int | None = None
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    ended_at: float | None = None
    exitcode: int | None = None
    error_line: str | None = None  # one line for a failed rank's row
    bars: dict[int, BarState] = dataclasses.field(default_factory=dict)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    history: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
    diag: str = ""

    @property
    def done(self) -> bool:
        return self.status in (FINISHED, FAILED, STOPPED)

    @property
    def elapsed(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started_at

    @property
    def bar(self) -> BarState | None:
        """The bar to show for this rank: the newest open one, else the last one."""
        if not self.bars:
            return None
        open_bars = [b for b in self.bars.values() if not b.closed]
        return (open_bars or list(self.bars.values()))[-1]


@dataclasses.dataclass
class LaunchState:
    info: LaunchInfo
    ranks: dict[int, RankState]
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    ended_at: float | None = None
    outcome: Outcome | None = None

    @property
    def elapsed(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started_at
