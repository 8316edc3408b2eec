"""The kernel's side of a running launch: read every rank's pipes, keep the state, drive a view.

One loop in the launching thread waits on all ranks' pipes and exit sentinels at once. Output is
cut into whole lines per rank and stream before it reaches the view, so lines are never split or
interleaved (a line past 64 KiB is cut short with a note; every byte goes to the rank's log
file, ``launch/output_logs``). The loop notices the first failure and stops the other ranks,
enforces the timeout (collecting each live rank's Python stack first), and on an interrupt stops
every rank before re-raising. Whatever happens, every rank is reaped before :meth:`Relay.run`
returns or raises.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import time
import warnings
from typing import Any

from nbaccel.core import events, mp_internals
from nbaccel.core.errors import LaunchError, LaunchTimeoutError, RankFailedError, load_exception
from nbaccel.core.events import STACK_DUMP_SIGNAL
from nbaccel.core.failures import describe_exit, describe_raise
from nbaccel.core.launch_state import LaunchState, Outcome
from nbaccel.core.launch_state import RankStatus as Status
from nbaccel.launch import root_cause
from nbaccel.launch.containment import LeftoverProcessesWarning, leftover_warning, sigint_deferred
from nbaccel.launch.group import RankGroup, RankProcess
from nbaccel.launch.lines import LineSplitter
from nbaccel.launch.output_logs import LaunchLogs
from nbaccel.ui import View

TICK = 0.05  # seconds between view updates while nothing arrives
STOP_GRACE = 3.0  # seconds a rank gets to exit after SIGTERM before SIGKILL
STACK_WAIT = 2.0  # seconds to wait for stack dumps at a timeout


class Relay:
    """Run one launch to its end: returns the ranks' result payloads or raises the failure."""

    def __init__(self, group: RankGroup, state: LaunchState, view: View, timeout: float | None):
        self.group = group
        self.state = state
        self.view = view
        self.timeout = timeout
        self.payloads: dict[int, bytes | None] = {}
        self._failures: list[tuple[int, RankFailedError]] = []
        self._ended: dict[int, str] = {}  # ranks whose function ended well: "returned", ...
        self._leftovers: list[tuple[int, str, int | None]] = []  # (pid, command, rank)
        self._splitters: dict[tuple[int, str], LineSplitter] = {}
        self._logs = LaunchLogs(state)  # every byte of stdout/stderr, whatever the view shows
        self.selector = selectors.DefaultSelector()

    # -- the loop ---------------------------------------------------------------------------

    def run(self, view_started: bool = False) -> dict[int, bytes | None]:
        """``view_started``: the caller showed the view already (before the ranks started)."""
        if not view_started:
            self.view.start(self.state)
        try:
            self.register()
            self._loop()
        except BaseException:
            self.state.outcome = self.state.outcome or Outcome.INTERRUPTED
            with sigint_deferred(reraise=False):  # a second Ctrl-C must not cut cleanup short
                self.group.stop(grace=STOP_GRACE)
                self._drain_all()
            raise
        finally:
            with sigint_deferred():  # teardown is not cut short; a Ctrl-C is raised after it
                if self.group.alive():
                    self.group.stop(grace=0)
                self.group.reap()
                failure = self._first_failure() if self._failures else None  # before the summary
                self._finish()
                self._warn_leftovers()
        if failure is not None:
            raise failure
        return self.payloads

    # -- the pieces a persistent-rank session drives itself (launch/session*.py) -------------

    def register(self) -> None:
        """Watch every rank's four pipes and exit sentinel."""
        for r in self.group.ranks:
            self.selector.register(r.stdout.fileno(), selectors.EVENT_READ, (r, "stdout"))
            self.selector.register(r.stderr.fileno(), selectors.EVENT_READ, (r, "stderr"))
            self.selector.register(r.diag.fileno(), selectors.EVENT_READ, (r, "diag"))
            self.selector.register(r.events.fileno(), selectors.EVENT_READ, (r, "events"))
            self.selector.register(r.sentinel, selectors.EVENT_READ, (r, "exit"))

    def _loop(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not all(rank.done for rank in self.state.ranks.values()):
            for key, _ in self.selector.select(TICK):
                rank_process, kind = key.data
                if kind == "exit":
                    self._on_exit(rank_process)
                else:
                    self.read(rank_process, kind)
            if self._failures:
                self.group.begin_stop(STOP_GRACE)  # the other ranks; idempotent
            self.group.poll_stop()
            if deadline is not None and time.monotonic() > deadline and not self._failures:
                self._time_out()
            if self.state.wants_stacks():  # stalled: each rank writes its stack to its diag pipe
                self.group.send_signal(self.group.alive(), STACK_DUMP_SIGNAL)
            self.view.update()
        self.state.outcome = Outcome.FAILED if self._failures else Outcome.FINISHED

    # -- reading ----------------------------------------------------------------------------

    def read(self, r: RankProcess, kind: str) -> bool:
        """Read what is there now on one pipe; report whether anything (or EOF) was read."""
        if kind == "events":
            return self._read_event(r)
        conn = getattr(r, kind)
        try:
            data = os.read(conn.fileno(), 1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self.unwatch(conn.fileno())
            if kind != "diag":
                self._emit_lines(r.rank, kind, self._splitter(r.rank, kind).flush())
            return False
        if kind == "diag":
            self.state.ranks[r.rank].diag += data.decode("utf-8", errors="replace")
        else:
            self._emit_lines(r.rank, kind, self._splitter(r.rank, kind).feed(data))
            if hasattr(self.view, "partial"):  # the unfinished line, e.g. a "\r" progress line
                self.view.partial(r.rank, kind, self._splitter(r.rank, kind).pending)
        return True

    def _read_event(self, r: RankProcess) -> bool:
        try:
            if not r.events.poll(0):
                return False
            data = r.events.recv_bytes()
        except (EOFError, OSError):
            self.unwatch(r.events.fileno())
            return False
        self._on_event(pickle.loads(data))
        return True

    def _splitter(self, rank: int, stream: str) -> LineSplitter:
        key = (rank, stream)
        if key not in self._splitters:
            self._splitters[key] = LineSplitter(sink=self._logs.file(rank, stream))
        return self._splitters[key]

    def _emit_lines(self, rank: int, stream: str, lines: list[str]) -> None:
        if lines:
            self.view.output(rank, stream, lines)

    def flush_partial(self, rank: int) -> None:
        """Show ``rank``'s unfinished stdout/stderr lines now (a session's cell has ended)."""
        for stream in ("stdout", "stderr"):
            splitter = self._splitters.get((rank, stream))
            if splitter is not None:
                self._emit_lines(rank, stream, splitter.flush())
                if hasattr(self.view, "partial"):  # shown now: not again as a live line
                    self.view.partial(rank, stream, "")

    def watch(self, fd: int, data: tuple[RankProcess, str]) -> None:
        """Also wake the loop for ``fd`` (e.g. a session's command connection)."""
        self.selector.register(fd, selectors.EVENT_READ, data)

    def unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    def drain(self, r: RankProcess) -> None:
        """Read everything a rank that has exited left in its pipes."""
        for kind in ("events", "stdout", "stderr", "diag"):
            while self.read(r, kind):
                pass
        for stream in ("stdout", "stderr"):
            self._emit_lines(r.rank, stream, self._splitter(r.rank, stream).flush())

    def _drain_all(self) -> None:
        for r in self.group.ranks:
            with contextlib.suppress(OSError, ValueError):
                self.drain(r)
            rank = self.state.ranks[r.rank]
            if not rank.done:
                rank.status, rank.ended_at = Status.STOPPED, time.monotonic()

    # -- events and exits -------------------------------------------------------------------

    def _on_event(self, event: events.Event) -> None:
        rank = self.state.ranks[event.rank]
        if isinstance(event, events.Started):
            rank.pid, rank.status = event.pid, Status.RUNNING
        elif isinstance(event, events.Progress):
            e = event
            rank.on_progress(e.bar_id, e.n, e.total, e.desc, e.elapsed, e.closed, e.unit_scale)
        elif isinstance(event, events.Metrics):
            rank.on_metrics(event.step, event.values)
        elif isinstance(event, events.RankSettings):
            rank.effective = {k: str(v) for k, v in vars(event).items() if k != "rank"}
        elif isinstance(event, events.Result):
            self.payloads[event.rank] = event.payload
            how = "returned" if event.exit_code is None else f"exited (code {event.exit_code})"
            self._ended[event.rank] = how
        elif isinstance(event, events.Leftovers):
            self._leftovers += [(pid, cmd, event.rank) for pid, cmd in event.processes]
        elif isinstance(event, events.Failure):
            summary = describe_raise(event.exc_type, event.message)
            error = RankFailedError(
                event.rank,
                self.state.info.world_size,
                summary,
                event.traceback,
                exc_type=event.exc_type,
                original=load_exception(event.exception),
            )
            self._record_failure(event.rank, error, summary.removeprefix("raised "))

    def _record_failure(self, rank: int, error: RankFailedError, line: str) -> None:
        state = self.state.ranks[rank]
        # One short line for the summary table's cell; the error keeps the full text.
        state.status, state.error_line = Status.FAILED, root_cause.cut(line)
        self._failures.append((rank, error))

    def _on_exit(self, r: RankProcess) -> None:
        self.unwatch(r.sentinel)
        self.drain(r)
        code = self.group.collect_exit(r)
        rank = self.state.ranks[r.rank]
        rank.exitcode, rank.ended_at = code, time.monotonic()
        if rank.status == Status.FAILED:
            error = next(e for k, e in self._failures if k == r.rank)
            error.exitcode = code
        elif code == 0 and r.rank in self.payloads:
            rank.status = Status.FINISHED
        elif self.group.was_stopped(r.rank):
            rank.status = Status.STOPPED
        else:
            what = describe_exit(code) if code != 0 else "exited without reporting a result"
            if code == 255 and self.group.start_method == "forkserver" and _server_gone():
                # multiprocessing's stand-in status: the server that reports it is gone
                what = "ended when its fork server died (its own exit status is unknown)"
            crash = root_cause.without_plumbing(rank.diag.strip())
            error = RankFailedError(r.rank, self.state.info.world_size, what, crash, exitcode=code)
            self._record_failure(r.rank, error, what)

    def _first_failure(self) -> RankFailedError:
        """The failure to raise: the root cause first (a real failure before the connection
        errors it caused in other ranks; a rank that had already left, where only those
        remain), the others named after it."""
        (first_rank, first), *rest = root_cause.order(self._failures)
        first.other_failures = tuple(
            f"rank {k} {root_cause.cut(e.summary)}" for k, e in rest if k != first_rank
        )
        first.cause = root_cause.cause(first_rank, first, self._ended)
        first.args = (first._message(),)
        if first.cause:
            state = self.state.ranks[first_rank]
            state.error_line = root_cause.cut(
                f"{first.cause.split(' while ')[0]}: {state.error_line}"
            )
        return first

    def _warn_leftovers(self) -> None:
        """One warning line naming what the ranks left running (it has been stopped)."""
        seen = {pid for pid, _, _ in self._leftovers}
        found = self._leftovers + [(p, c, None) for p, c in self.group.strays if p not in seen]
        self.group.strays.clear()
        self._leftovers = []
        if found:
            # stacklevel: _warn_leftovers < run < run_plan < notebook_launcher < the user's cell
            warnings.warn(leftover_warning(found), LeftoverProcessesWarning, stacklevel=5)

    # -- timeout ----------------------------------------------------------------------------

    def _time_out(self) -> None:
        alive = self.group.alive()
        running = sorted(r.rank for r in alive)
        before = {r.rank: len(self.state.ranks[r.rank].diag) for r in alive}
        self.group.send_signal(alive, STACK_DUMP_SIGNAL)
        self.collect_stacks(alive)
        stacks = {
            r.rank: root_cause.without_plumbing(self.state.ranks[r.rank].diag[before[r.rank] :])
            for r in alive
        }
        self.state.outcome = Outcome.TIMED_OUT
        raise LaunchTimeoutError(self.timeout or 0.0, running, stacks)

    def collect_stacks(self, alive: list[RankProcess]) -> None:
        """Read the ranks' stack dumps: until each has written one and gone quiet, or 2 s.

        The dump is written by a C signal handler in one burst; a short quiet period after the
        first bytes means it is complete.
        """
        deadline = time.monotonic() + STACK_WAIT
        last_data = {r.rank: None for r in alive}
        while time.monotonic() < deadline:
            now = time.monotonic()
            if all(t is not None and now - t > 0.2 for t in last_data.values()):
                return
            for key, _ in self.selector.select(0.05):
                r, kind = key.data
                if kind == "diag" and r.rank in last_data and self.read(r, "diag"):
                    last_data[r.rank] = time.monotonic()
                elif kind in ("stdout", "stderr", "events"):
                    self.read(r, kind)

    def _finish(self) -> None:
        self.state.ended_at = time.monotonic()
        for r in self.group.ranks:
            with contextlib.suppress(OSError):
                r.close_pipes()
        self.selector.close()
        with contextlib.suppress(Exception):
            self.view.finish()


def load_payload(rank: int, payload: bytes | None) -> Any:
    """Unpickle a rank's return value in the kernel, with an error that says what to do."""
    if payload is None:
        return None
    try:
        return pickle.loads(payload)
    except Exception as exc:
        raise LaunchError(
            f"rank {rank} returned a value the kernel cannot load ({type(exc).__name__}: {exc}). "
            "Return plain data, tensors or a state_dict, or make the value's class importable "
            "in the kernel."
        ) from exc


def _server_gone(wait: float = 1.0) -> bool:
    """Whether the fork server this process started has died (its sockets close before it is
    a zombie, so its rank's end can arrive first: give it ``wait`` seconds)."""
    pid = mp_internals.forkserver_pid()
    deadline = time.monotonic() + wait
    while pid is not None and mp_internals.server_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return pid is not None
