"""What the kernel knows about a launch while it runs: its settings and each rank's state.

The kernel's loop writes it (through the relay and the jobs); views only read it. Kept free of
IPython and widgets so the text view, the dashboard and the final summary all render the same
facts.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import os
import statistics
import string
import time
from typing import TypedDict

RATE_WINDOW = 10.0  # seconds of step samples a rank's rate is measured over
STRAGGLER_SLOWER = 0.2  # a rank this much below the median step rate is marked as a straggler


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

# The moves a rank's status may make (``RankState.move``, the one writer). A persistent rank
# (``%ranks``) starts each cell again from any end; a failed rank stays failed when its process
# exits afterwards.
MOVES: dict[RankStatus, frozenset[RankStatus]] = {
    STARTING: frozenset({RUNNING, FINISHED, FAILED, STOPPED}),
    RUNNING: frozenset({FINISHED, FAILED, STOPPED}),
    FINISHED: frozenset({RUNNING, FAILED, STOPPED}),
    FAILED: frozenset({RUNNING}),
    STOPPED: frozenset({RUNNING, FAILED}),
}


# How ranks' lines are labelled: torch elastic's template form, so ``nbaccel launch`` (torch's
# tee) and notebook launches label alike and ``log_line_prefix_template`` means the same.
DEFAULT_LINE_PREFIX = "[rank${rank}] "


def line_label(template: str, rank: int, local_rank: int) -> str:
    """``template`` with ``${rank}``, ``${local_rank}`` and ``${role_name}`` filled in.

    >>> line_label("${role_name}-${rank}: ", 3, 1)
    'default-3: '
    """
    return string.Template(template).safe_substitute(
        rank=rank, local_rank=local_rank, role_name="default"
    )


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
    line_prefix: str = DEFAULT_LINE_PREFIX  # torch elastic's log_line_prefix_template form
    # Where a cluster placed the ranks, as its Cluster.placement says it ("" on this machine)
    placement: str = ""
    # N-D parallelism the launch asked for ("dp_shard 2 × tp 2"; "" for none)
    parallelism: str = ""

    def label(self, rank: int) -> str:
        """The prefix of ``rank``'s output lines in text views.

        >>> LaunchInfo(2, 2, 0, 0, "cpu", "gloo", "no", "ddp", 1, "h", 1, "fork").label(1)
        '[rank1] '
        """
        return line_label(self.line_prefix, rank, rank - self.first_rank)

    def describe(self) -> str:
        machines = f", node {self.node_rank}" if self.world_size != self.num_processes else ""
        # On a cluster, rank 0's node and port are the placement's
        where = self.placement or f"{self.start_method}, {self.master_addr}:{self.master_port}"
        return (
            f"{self.num_processes} process{'es' if self.num_processes != 1 else ''} "
            f"on {self.device} ({self.backend}{machines}), mixed_precision={self.mixed_precision}, "
            f"strategy={self.strategy}, {self.parallelism + ', ' if self.parallelism else ''}"
            f"{where}"
        )


@dataclasses.dataclass
class BarState:
    n: int = 0
    total: int | None = None
    desc: str | None = None
    elapsed: float = 0.0
    closed: bool = False
    unit_scale: float | None = None
    outer: bool = False  # another bar was opened inside this one (an epoch loop around batches)

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
    steps: int = 0  # steps done over all (inner) bars: continues across epochs
    samples: float = 0.0  # steps times the bars' unit_scale (samples per step), where known
    last_advance: float | None = None  # monotonic time of the last step (or metrics/output)
    rss: int | None = None  # resident memory in bytes, sampled by the kernel
    gpu_memory: int | None = None  # bytes on the GPU, where CUDA
    effective: dict[str, str] = dataclasses.field(default_factory=dict)  # what the rank runs
    compiling_since: float | None = None  # torch.compile is compiling in the rank since then
    # Where the rank waits for a person, e.g. "breakpoint() at Cell In[4], line 9"; None while
    # it does not (set by launch.debugging, shown by the views as "rank 1 paused in ...").
    paused: str | None = None
    _window: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=400), repr=False
    )

    @property
    def done(self) -> bool:
        return self.status in (FINISHED, FAILED, STOPPED)

    @property
    def shown_status(self) -> RankStatus:
        """The status the views show: ``finished`` once the function has returned
        (:meth:`returned`), while the process may still be leaving.

        >>> r = RankState(0); r.move(RUNNING, now=1.0); r.returned(now=2.0)
        >>> r.status, r.shown_status
        (<RankStatus.RUNNING: 'running'>, <RankStatus.FINISHED: 'finished'>)
        """
        return FINISHED if self.status == RUNNING and self.ended_at is not None else self.status

    @property
    def status_text(self) -> str:
        """The status column's word: :attr:`shown_status`, or ``paused`` while a running rank
        waits in ``breakpoint()``/``input()`` for a person (it is not running meanwhile).

        >>> r = RankState(0); r.move(RUNNING); r.paused = "breakpoint() at Cell In[4], line 9"
        >>> r.status_text
        'paused'
        """
        return "paused" if self.paused and self.shown_status == RUNNING else str(self.shown_status)

    def move(self, status: RankStatus, now: float | None = None) -> None:
        """Set the rank's status: the one place it changes. An end (finished, failed, stopped)
        stamps ``ended_at``; a move back to running (a new ``%ranks`` cell) clears it. A move
        ``MOVES`` does not allow is a bug in the kernel's side, raised as such.

        >>> r = RankState(0)
        >>> r.move(RUNNING); r.move(FAILED); r.move(FAILED); r.status
        <RankStatus.FAILED: 'failed'>
        >>> r.move(FINISHED)
        Traceback (most recent call last):
        ...
        ValueError: rank 0 cannot go from failed to finished
        """
        if status == self.status:
            return
        if status not in MOVES[self.status]:
            raise ValueError(f"rank {self.rank} cannot go from {self.status} to {status}")
        now = time.monotonic() if now is None else now
        self.status = status
        if status == RUNNING:
            self.ended_at = None
        elif self.ended_at is None:
            self.ended_at = now

    def returned(self, now: float) -> None:
        """The rank's function has ended and reported (its process may still be leaving, e.g.
        rank 0 until the others have left its store): its clocks, elapsed and rate, stop here.

        >>> r = RankState(0, started_at=10.0)
        >>> r.move(RUNNING, now=10.0); r.returned(now=14.0); r.move(FINISHED, now=20.0)
        >>> r.elapsed(now=30.0)
        4.0
        """
        if self.ended_at is None:
            self.ended_at = now

    def elapsed(self, now: float) -> float:
        """Seconds since the rank started, to ``now`` or to its end."""
        return (now if self.ended_at is None else self.ended_at) - self.started_at

    @property
    def bar(self) -> BarState | None:
        """The bar to show for this rank: the newest open inner one (batches rather than the
        epoch loop around them), else the newest open one, else the last one."""
        if not self.bars:
            return None
        open_bars = [b for b in self.bars.values() if not b.closed]
        inner = [b for b in self.bars.values() if not b.outer]
        open_inner = [b for b in open_bars if not b.outer]
        return (open_inner or inner or open_bars or list(self.bars.values()))[-1]

    # -- written by the relay, one call per event -------------------------------------------

    def on_progress(
        self,
        bar_id: int,
        n: int,
        total: int | None,
        desc: str | None,
        elapsed: float,
        closed: bool = False,
        unit_scale: float | None = None,
        now: float | None = None,
    ) -> None:
        """A bar moved. Steps of inner bars add up across bars, so the rate and the ETA carry on
        over epoch boundaries instead of starting again from nothing."""
        now = time.monotonic() if now is None else now
        bar = self.bars.get(bar_id)
        if bar is None:
            for other in self.bars.values():
                if not other.closed:
                    other.outer = True  # a new bar opened inside it
            if not self.bars:  # a new run of this rank (or a new cell in a persistent session)
                self.steps, self.samples = 0, 0.0
                self._window.clear()
            bar = self.bars[bar_id] = BarState()
            if not self._window:
                self._window.append((now, self.steps))
        delta = max(0, n - bar.n) if not bar.outer else 0
        bar.n, bar.total, bar.desc = n, total, desc
        bar.elapsed, bar.closed, bar.unit_scale = elapsed, closed, unit_scale
        if delta:
            self.steps += delta
            self.samples += delta * (unit_scale or 0)
            self.last_advance = now
            self._window.append((now, self.steps))

    def on_metrics(
        self, step: int | None, values: dict[str, float], now: float | None = None
    ) -> None:
        self.metrics.update(values)
        self.history.append((step if step is not None else len(self.history), dict(values)))
        self.note_activity(now)

    def on_compiling(self, active: bool, now: float | None = None) -> None:
        """``torch.compile`` started or finished compiling: not a stall either way."""
        now = time.monotonic() if now is None else now
        self.compiling_since = now if active else None
        self.note_activity(now)

    def note_activity(self, now: float | None = None) -> None:
        """The rank did something (output, metrics): not stalled, even where it has no bars."""
        self.last_advance = time.monotonic() if now is None else now

    # -- read by the views: each is told the time (``now``, monotonic), never reads a clock ---

    def step_rate(self, now: float) -> float | None:
        """Steps a second over the last ``RATE_WINDOW`` seconds, across bars (so it carries on
        over epoch boundaries); ``None`` before the first step. A quiet spell lowers it
        gradually; after a spell longer than the window it is the whole run's average. A rank
        that has ended is measured at its end."""
        if self.steps == 0 or not self._window:
            return None
        now = now if self.ended_at is None else self.ended_at
        window = [(t, s) for t, s in self._window if now - t <= RATE_WINDOW]
        if len(window) >= 2 and window[-1][1] > window[0][1]:
            (t0, s0), (_, s1) = window[0], window[-1]
            return (s1 - s0) / max(now - t0, 1e-3)
        t_first, s_first = self._window[0]
        return (self.steps - s_first) / max(now - t_first, 1e-3)

    def sample_rate(self, now: float) -> float | None:
        """Samples a second, where bars say how many samples a step is."""
        rate = self.step_rate(now)
        if rate is None or not self.samples or not self.steps:
            return None
        return rate * self.samples / self.steps

    def run_progress(self) -> tuple[int, int | None, str]:
        """(steps done, steps in the whole run or ``None``, what the unit is) for this rank.

        With an outer bar (epochs) around inner bars (batches), the run is outer.total inner
        bars; with one bar, it is that bar; with one bar per epoch and no outer bar, only the
        current epoch's total is known.
        """
        outer = [b for b in self.bars.values() if b.outer]
        inner = [b for b in self.bars.values() if not b.outer]
        if not inner:
            return self.steps, None, "steps"
        current = ([b for b in inner if not b.closed] or inner)[-1]
        epochs_total = outer[-1].total if outer else None
        if epochs_total and current.total:
            total = epochs_total * current.total
            return min(self.steps, total), total, "steps"
        if len(inner) == 1:
            return current.n, current.total, "steps"
        return self.steps, None, "steps"

    def eta(self, now: float) -> float | None:
        """Seconds to the end of the run (or of the current bar, when that is all that is known).

        Measured at the rank's last step, so a long step (``torch.compile`` compiling, an
        evaluation) holds the ETA where it was instead of pushing it up every second; the next
        step measures again.
        """
        if self.done:
            return None
        last_step = self._window[-1][0] if self._window else now
        rate = self.step_rate(min(now, last_step))
        done, total, _ = self.run_progress()
        if rate and total is not None:
            return max(0.0, (total - done) / rate)
        bar = self.bar
        if rate and bar is not None and bar.total is not None and not bar.closed:
            return max(0.0, (bar.total - bar.n) / rate)
        return None


class RunFacts(TypedDict):
    """The run as a whole, what :meth:`LaunchState.run_line` reports and the views render."""

    steps: int
    total: int | None
    epoch: tuple[int, int | None] | None
    steps_per_s: float | None
    samples_per_s: float | None
    eta: float | None
    eta_is_run: bool


@dataclasses.dataclass
class LaunchState:
    info: LaunchInfo
    ranks: dict[int, RankState]
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    ended_at: float | None = None
    outcome: Outcome | None = None
    # Seconds without any rank advancing before the views say the launch looks stalled.
    stall_after: float = dataclasses.field(
        default_factory=lambda: float(os.environ.get("NBACCEL_STALL_AFTER", "30"))
    )
    stacks_requested_at: float | None = None  # when the kernel last asked stalled ranks for stacks
    longest_stall: float = 0.0  # the longest stall seen so far, in seconds (for the summary)
    log_folder: str | None = None  # where every rank's full output is (made at its first byte)
    log_problem: str = ""  # why some output is not in the log files ("" when all of it is)
    # What the launch is waiting for before its ranks run, in words for the views' header
    # (e.g. "fork server: importing torch._dynamo"), and since when (monotonic); None once the
    # ranks are starting. Set by whoever waits, read by the views.
    waiting_for: str | None = None
    waiting_since: float | None = None
    # Which attempt of a launch with restarts this is, from 1, of how many at most
    attempt: int = 1
    attempts: int = 1

    def elapsed(self, now: float) -> float:
        """Seconds since the launch started, to ``now`` or to its end.

        >>> LaunchState(None, {}, started_at=10.0).elapsed(now=12.5)
        2.5
        """
        return (now if self.ended_at is None else self.ended_at) - self.started_at

    def waited(self, now: float) -> float:
        """Seconds the launch has waited for ``waiting_for`` (from the launch's start where
        the waiter gave no time of its own).

        >>> LaunchState(None, {}, started_at=10.0, waiting_since=11.0).waited(now=12.5)
        1.5
        """
        since = self.started_at if self.waiting_since is None else self.waiting_since
        return max(0.0, now - since)

    def attempt_text(self) -> str:
        """Which attempt the views show, for a launch that may restart its ranks.

        >>> LaunchState(None, {}, attempt=2, attempts=3).attempt_text()
        'attempt 2 of 3'
        """
        return f"attempt {self.attempt} of {self.attempts}"

    def log_path(self, rank: int, stream: str) -> str | None:
        """The file with every byte ``rank`` wrote to ``stream`` (None before its folder exists).

        >>> LaunchState(None, {}, log_folder="/logs").log_path(1, "stderr")
        '/logs/rank1.stderr.log'
        """
        if self.log_folder is None:
            return None
        return os.path.join(self.log_folder, f"rank{rank}.{stream}.log")

    def _ordered(self) -> list[RankState]:
        return sorted(self.ranks.values(), key=lambda r: r.rank)

    def stragglers(self, now: float) -> set[int]:
        """Ranks whose step rate is ``STRAGGLER_SLOWER`` or more below the median (a rank that
        has ended is judged by its rate when it ended)."""
        rates = {r.rank: r.step_rate(now) for r in self._ordered()}
        known = {k: v for k, v in rates.items() if v is not None}
        if len(known) < 2:
            return set()
        median = statistics.median(known.values())
        return {k for k, v in known.items() if v <= (1 - STRAGGLER_SLOWER) * median}

    def stalled_for(self, now: float) -> float | None:
        """Seconds since any running rank last advanced, when that is ``stall_after`` or more
        (never while the launch still waits for something before its ranks run)."""
        if self.ended_at is not None or self.outcome is not None or self.waiting_for is not None:
            return None
        running = [r for r in self.ranks.values() if not r.done]
        if not running or any(r.compiling_since is not None for r in running):
            return None  # a rank that compiles holds the others up: no stall to report
        last = max(max(r.started_at, r.last_advance or r.started_at) for r in running)
        quiet = now - last
        if quiet < self.stall_after:
            return None
        self.longest_stall = max(self.longest_stall, quiet)
        return quiet

    def wants_stacks(self, now: float) -> bool:
        """Whether the relay should ask the ranks for their stacks now: once per stall."""
        quiet = self.stalled_for(now)
        if quiet is None:
            return False
        if self.stacks_requested_at is not None and self.stacks_requested_at >= now - quiet:
            return False  # already asked during this stall
        self.stacks_requested_at = now
        return True

    def run_line(self, now: float) -> RunFacts:
        """The run as a whole: steps done/total (the slowest rank), summed rates, overall ETA."""
        ranks = self._ordered()
        progress = [r.run_progress() for r in ranks if r.bars]
        done = min((p[0] for p in progress), default=0)
        totals = [p[1] for p in progress if p[1] is not None]
        total = max(totals) if totals and len(totals) == len(progress) else None
        rates = [r.step_rate(now) for r in ranks if not r.done]
        sample_rates = [x for x in (r.sample_rate(now) for r in ranks if not r.done) if x]
        etas = [e for e in (r.eta(now) for r in ranks) if e is not None]
        # The slowest rank's epoch loop (its outermost open bar around batch bars).
        epochs = sorted(
            (
                [b for b in r.bars.values() if b.outer][-1]
                for r in ranks
                if r.bars and any(b.outer for b in r.bars.values())
            ),
            key=lambda b: -b.n,
        )
        return {
            "steps": done,
            "total": total,
            "epoch": (epochs[-1].n, epochs[-1].total) if epochs else None,
            "steps_per_s": sum(x for x in rates if x) or None,
            "samples_per_s": sum(sample_rates) or None,
            "eta": max(etas) if etas else None,
            "eta_is_run": total is not None,
        }
