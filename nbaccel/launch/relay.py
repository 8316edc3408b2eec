"""The kernel's reading of a launch's ranks: their pipes, the launch state, the view.

:class:`Relay` reads what is there on a rank's pipe when the loop (``launch.loop``) says it is
readable. Output is cut into whole lines per rank and stream before it reaches the view, so
lines are never split or interleaved (a line past 64 KiB is cut short with a note; every byte
goes to the rank's log file, ``launch/output_logs``). Events update the launch state and record
results and failures; what to do about them (stop the others, time out) is the job's
(``launch.handle``, ``persistent.cell``), not the relay's.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import pickle
import selectors
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

from nbaccel.core import events, local_traceback
from nbaccel.core.containment import LeftoverProcessesWarning, leftover_warning
from nbaccel.core.errors import LaunchError, RankFailedError, load_exception
from nbaccel.core.events import STACK_DUMP_SIGNAL
from nbaccel.launch import failures, post_mortem
from nbaccel.launch.debugging import Debugging
from nbaccel.launch.failures import describe_raise
from nbaccel.launch.lines import LineSplitter
from nbaccel.launch.output_logs import LaunchLogs
from nbaccel.launch.protocols import RankGroup, RankHandle, View
from nbaccel.launch.state import LaunchState
from nbaccel.launch.state import RankStatus as Status

STACK_WAIT = 2.0  # seconds to wait for stack dumps at a timeout
TICK = 0.05  # s between looks at the pipes while a person types at a rank's prompt


class Relay:
    """Read one group's ranks into ``state`` and ``view``; keeps their payloads and failures."""

    def __init__(self, group: RankGroup, state: LaunchState, view: View):
        self.group = group
        self.state = state
        self.view = view
        self.payloads: dict[int, bytes | None] = {}
        self.failures: list[tuple[int, RankFailedError]] = []
        # Failed ranks whose copy for %debug (``events.FailureCopy``) is still to come: the
        # launch waits for it, or for the rank's exit (it is bounded in time: core.snapshot)
        self.copying: set[int] = set()
        self.ended: dict[int, str] = {}  # ranks whose function ended well: "returned", ...
        self._leftovers: list[tuple[int, str, int | None]] = []  # (pid, command, rank)
        self._splitters: dict[tuple[int, str], LineSplitter] = {}
        self._logs = LaunchLogs(state)  # every byte of stdout/stderr, whatever the view shows
        self.selector = selectors.DefaultSelector()
        self.debug = Debugging(state)  # ranks paused in breakpoint()/input()

    def register(self) -> None:
        """Watch every rank's four pipes and exit sentinel."""
        for r in self.group.ranks:
            self.selector.register(r.stdout.fileno(), selectors.EVENT_READ, (r, "stdout"))
            self.selector.register(r.stderr.fileno(), selectors.EVENT_READ, (r, "stderr"))
            self.selector.register(r.diag.fileno(), selectors.EVENT_READ, (r, "diag"))
            self.selector.register(r.events.fileno(), selectors.EVENT_READ, (r, "events"))
            self.selector.register(r.sentinel, selectors.EVENT_READ, (r, "exit"))

    # -- reading ----------------------------------------------------------------------------

    def read(self, r: RankHandle, kind: str) -> bool:
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

    def _read_event(self, r: RankHandle) -> bool:
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

    def watch(self, fd: int, data: tuple[RankHandle, str]) -> None:
        """Also wake the loop for ``fd`` (e.g. a session's command connection)."""
        self.selector.register(fd, selectors.EVENT_READ, data)

    def unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    def drain(self, r: RankHandle) -> None:
        """Read everything a rank that has exited left in its pipes."""
        for kind in ("events", "stdout", "stderr", "diag"):
            while self.read(r, kind):
                pass
        for stream in ("stdout", "stderr"):
            self._emit_lines(r.rank, stream, self._splitter(r.rank, stream).flush())

    def drain_all(self) -> None:
        """Read what every rank left; a rank that has not ended by now was stopped."""
        for r in self.group.ranks:
            with contextlib.suppress(OSError, ValueError):
                self.drain(r)
            rank = self.state.ranks[r.rank]
            if not rank.done:
                rank.move(Status.STOPPED)

    # -- events and exits -------------------------------------------------------------------

    def _on_event(self, event: events.Event) -> None:
        rank = self.state.ranks[event.rank]
        if isinstance(event, events.Started):
            rank.pid = event.pid
            rank.move(Status.RUNNING)
        elif isinstance(event, events.Progress):
            e = event
            rank.on_progress(e.bar_id, e.n, e.total, e.desc, e.elapsed, e.closed, e.unit_scale)
        elif isinstance(event, events.Metrics):
            rank.on_metrics(event.step, event.values)
        elif isinstance(event, events.Compiling):
            rank.on_compiling(event.active)
        elif isinstance(event, events.RankSettings):
            rank.effective = {k: str(v) for k, v in vars(event).items() if k != "rank"}
        elif isinstance(event, events.Result):
            self.payloads[event.rank] = event.payload
            rank.returned(time.monotonic())
            how = "returned" if event.exit_code is None else f"exited (code {event.exit_code})"
            self.ended[event.rank] = how
        elif isinstance(event, events.Leftovers):
            self._leftovers += [(pid, cmd, event.rank) for pid, cmd in event.processes]
        elif isinstance(event, events.Paused):
            self._on_paused(event)
        elif isinstance(event, events.FailureCopy):  # for %debug, after its failure
            self.copying.discard(event.rank)
            failed = [e for k, e in self.failures if k == event.rank]
            if failed:
                post_mortem.remember(failed[0], event.rank, event.frames, launch=self.failures)
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
            if event.copy_follows:
                self.copying.add(event.rank)
            self.record_failure(event.rank, error, summary.removeprefix("raised "))
            if event.traceback:  # in the rank's log, as a script's stderr has it: named at the end
                self._logs.file(event.rank, "stderr").write(event.traceback.encode())

    def _on_paused(self, event: events.Paused) -> None:
        """A rank waits for a person: what it printed first is shown first, then the kernel
        relays its conversation (``launch.debugging``) on a connection the loop watches."""
        r = next(p for p in self.group.ranks if p.rank == event.rank)
        for stream in ("stdout", "stderr"):
            while self.read(r, stream):
                pass
        if hasattr(self.view, "settle"):  # a %%ranks cell holds each rank's burst of lines
            self.view.settle()
        self.debug.on_paused(event, lambda fd: self.watch(fd, (r, "debug")))

    def answer_debugger(self, r: RankHandle) -> None:
        """The loop saw ``r``'s debugging connection readable (see ``Debugging.answer``)."""
        self.debug.answer(r.rank, self.unwatch, self.reading_meanwhile)

    @contextlib.contextmanager
    def reading_meanwhile(self) -> Iterator[None]:
        """While the loop's thread waits for a person at a rank's prompt, a thread reads the
        ranks' pipes and updates the view, so the other ranks run on (their output never fills
        a pipe) and the views stay live; exits, replies and prompts wait for the loop."""
        done = threading.Event()
        told = len(self.failures)

        def pump() -> None:
            nonlocal told
            while not done.is_set():
                read = False
                for key, _ in self.selector.select(TICK):
                    r, kind = key.data
                    if kind in ("stdout", "stderr", "diag", "events"):
                        read = self.read(r, kind) or read
                for rank, error in self.failures[told:]:  # not only once the prompt is answered
                    print(
                        f"nbaccel: rank {rank} failed while this prompt waits: "
                        f"{str(error).splitlines()[0] if str(error) else type(error).__name__} "
                        "(the launch ends with it once you leave the debugger)",
                        file=sys.stderr,
                        flush=True,
                    )
                told = len(self.failures)
                self.view.update()
                if not read:
                    done.wait(TICK)  # a sentinel or a connection stays ready: not a busy loop

        # In this cell's context, so what the view prints stays in the cell (ipykernel).
        thread = threading.Thread(
            target=contextvars.copy_context().run, args=(pump,), name="nbaccel-read", daemon=True
        )
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def record_failure(self, rank: int, error: RankFailedError, line: str) -> None:
        """``rank`` failed with ``error``; ``line`` is its one line in the summary table."""
        state = self.state.ranks[rank]
        state.move(Status.FAILED)
        state.error_line = failures.cut(line)  # the error keeps the full text
        self.failures.append((rank, error))

    def first_failure(self) -> RankFailedError:
        """The failure to raise: the root cause first (a real failure before the connection
        errors it caused in other ranks; a rank that had already left, where only those
        remain), the others named after it."""
        (first_rank, first), *rest = failures.order(self.failures)
        first.other_failures = tuple(
            f"rank {k} {failures.cut(e.summary)}" for k, e in rest if k != first_rank
        )
        first.cause = failures.cause(first_rank, first, self.ended)
        first.args = (first._message(),)
        if first.cause:
            state = self.state.ranks[first_rank]
            state.error_line = failures.cut(
                f"{first.cause.split(' while ')[0]}: {state.error_line}"
            )
        return first

    def warn_leftovers(self) -> None:
        """One warning line naming what the ranks left running (it has been stopped)."""
        seen = {pid for pid, _, _ in self._leftovers}
        found = self._leftovers + [(p, c, None) for p, c in self.group.strays if p not in seen]
        self.group.strays.clear()
        self._leftovers = []
        if found:
            warnings.warn(
                leftover_warning(found),
                LeftoverProcessesWarning,
                stacklevel=local_traceback.user_stacklevel(),
            )

    def stacks_now(self, alive: list[RankHandle]) -> dict[int, str]:
        """Ask ``alive`` for their Python stacks (``STACK_DUMP_SIGNAL``) and return each rank's
        dump (what its diagnostic pipe got meanwhile): the timeout's report, for a launch and a
        ``%ranks`` cell alike."""
        before = {r.rank: len(self.state.ranks[r.rank].diag) for r in alive}
        self.group.send_signal(alive, STACK_DUMP_SIGNAL)
        self.collect_stacks(alive)
        return {r.rank: self.state.ranks[r.rank].diag[before[r.rank] :] for r in alive}

    def collect_stacks(self, alive: list[RankHandle]) -> None:
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

    def close(self) -> None:
        """Close every rank's pipes and the selector (the ranks have been reaped)."""
        self.state.ended_at = time.monotonic()
        self.debug.close()
        for r in self.group.ranks:
            with contextlib.suppress(OSError):
                r.close_pipes()
        self.selector.close()


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
