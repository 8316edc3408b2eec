"""One command on persistent ranks, seen from the kernel: send it, follow the ranks, judge the end.

While a command runs, :func:`run_command` waits on every rank's pipes (read through the session's
:class:`~nbaccel.launch.relay.Relay`, so output lines, progress and the views work as for a
launch), its command socket and its exit sentinel. It returns each rank's
:class:`~nbaccel.persistent.messages.Done`, or raises:

- :class:`CellError` when the code raised on some rank (the ranks live on, with their state);
- ``KeyboardInterrupt`` after the stop button: every rank's cell code got a KeyboardInterrupt;
- :class:`CellTimeoutError` after ``timeout``: each rank's stack, then the cell is interrupted;
- :class:`RanksBrokenError` when a rank died, a collective was left half-done (a rank waits in a
  torch.distributed call while another rank is already done with the cell), or the ranks did not
  stop after an interrupt. The caller then stops the group: nothing hangs.
"""

from __future__ import annotations

import contextlib
import linecache
import pickle
import signal
import time
from collections.abc import Callable
from typing import Any

from nbaccel.core.containment import sigint_deferred
from nbaccel.core.errors import (
    LaunchError,
    LaunchTimeoutError,
    RankFailedError,
    UserInterrupt,
    load_exception,
)
from nbaccel.core.local_traceback import name_cell, with_cell_names
from nbaccel.launch import failures, loop
from nbaccel.launch.failures import describe_exit, describe_raise
from nbaccel.launch.protocols import RankHandle
from nbaccel.launch.relay import Relay
from nbaccel.launch.state import FAILED, FINISHED, RUNNING, STOPPED, LaunchState, Outcome
from nbaccel.persistent.messages import Blocked, Command, Done, cell_filename

COLLECTIVE_GRACE = 1.0  # s a rank may wait in a collective after another rank is done
INTERRUPT_GRACE = 5.0  # s the ranks get to end their cell after SIGINT
DOUBLE_PRESS = 1.0  # s after an interrupt in which another one is the same impatient press
START_AGAIN = (
    "Start fresh ranks with `%ranks restart` (same settings) or `%ranks start` "
    "(Python: `ranks.restart()`)."
)


class RanksBrokenError(LaunchError):
    """The ranks cannot go on (a rank died, a collective was left half-done); they were stopped."""

    def __init__(
        self, reason: str, detail: str = "", failures: dict[int, str] | None = None
    ) -> None:
        """``failures``: rank -> the traceback of the cell that raised there (shown as a local
        error's frames in IPython, as text in the message elsewhere)."""
        self.reason = reason
        self.failures = dict(sorted((failures or {}).items()))
        text = (
            f"the ranks are broken: {reason}. The other ranks were stopped and every rank's "
            f"state is lost. {START_AGAIN}"
        )
        self._short = text + (f"\n\n{detail.rstrip()}" if detail.strip() else "")
        raw = "\n".join(
            f"--- rank {rank} traceback ---\n{tb.rstrip()}\n" for rank, tb in self.failures.items()
        )
        super().__init__(self._short + (f"\n\n{raw.rstrip()}" if raw else ""))

    def _render_traceback_(self) -> list[str]:
        """The first failing rank's frames as a local error's; the other ranks' errors after."""
        from nbaccel.core.local_traceback import render

        if not self.failures:
            return super()._render_traceback_()
        (rank, tb), *others = self.failures.items()
        kind = type(self).__name__
        footer = [f"rank {r} also raised: {t.strip().splitlines()[-1]}" for r, t in others]
        return render(f"{kind}: {self._short}", kind, tb, footer, None, heading=f"in rank {rank}:")


class CellError(RankFailedError):
    """The code raised on some rank; every rank is still alive and keeps its namespace."""

    NOTE = "(The ranks are alive and keep their state.)"

    def _message(self) -> str:
        return f"{super()._message()}\n{self.NOTE}"

    def _render_traceback_(self) -> list[str]:
        return [*super()._render_traceback_(), self.NOTE]


class CellTimeoutError(LaunchTimeoutError):
    """The cell ran past its timeout; it was interrupted on every rank, which stay alive."""

    def __init__(self, timeout: float, running: list[int], stacks: dict[int, str]) -> None:
        super().__init__(timeout, running, stacks)
        first = self.args[0].replace("the launch did not finish", "the cell did not finish", 1)
        self.args = (first + "\n\nThe cell was interrupted; the ranks are alive.",)


def run_command(
    relay: Relay,
    connections: dict[int, Any],
    command: Command,
    ranks: list[int],
    timeout: float | None,
    on_reply: Callable[[Done], None] = lambda done: None,
) -> dict[int, Done]:
    """Send ``command`` to ``ranks`` and follow them until each answered; see the module doc."""
    __tracebackhide__ = True
    job = CellJob(relay, connections, command, ranks, timeout, on_reply)
    job.send()
    loop.follow(relay, job)
    return job.verdict()


class CellJob:
    """One command on persistent ranks, for :func:`nbaccel.launch.loop.follow`: its policies
    are a cell's (an interrupt reaches the cell's code, a half-done collective or a dead rank
    breaks the ranks, a timeout interrupts the cell after collecting its stacks)."""

    def __init__(self, relay, connections, command, ranks, timeout, on_reply) -> None:
        self.relay, self.connections, self.command = relay, connections, command
        self.ranks, self.timeout, self.on_reply_done = ranks, timeout, on_reply
        self.processes = {r.rank: r for r in relay.group.ranks}
        self.done: dict[int, Done] = {}
        self.blocked: dict[int, tuple[Blocked, float]] = {}
        self.interrupted_at: float | None = None
        self.stacks: dict[int, str] | None = None

    @property
    def pending(self) -> list[int]:
        return [r for r in self.ranks if r not in self.done]

    def send(self) -> None:
        if self.command.code is not None:  # the rank's traceback then shows the cell's lines
            name = cell_filename(self.command.cell)
            code = self.command.kernel_source or self.command.code
            linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
            if self.command.kernel_cell is not None:  # and names it as IPython does: In[n]
                name_cell(name, self.command.kernel_cell)
        data = pickle.dumps(self.command, protocol=pickle.HIGHEST_PROTOCOL)
        self.relay.debug.resume()  # this cell's prompts are the notebook's (until interrupted)
        # Every rank gets the command or none does: a Ctrl-C between two sends would leave
        # one rank running a cell the kernel no longer follows.
        with sigint_deferred(reraise=False) as pressed:
            for rank in self.ranks:
                try:
                    self.connections[rank].send_bytes(data)
                except OSError:  # it is dying: the loop gets its exit
                    pass
        if pressed:
            self._interrupt()

    # -- what loop.follow asks -------------------------------------------------------------

    def finished(self) -> bool:
        return not self.pending

    def on_reply(self, r: RankHandle) -> None:
        self._on_reply(r.rank)

    def on_exit(self, r: RankHandle, code: int | None) -> None:
        crash = crash_stack(self.relay.state.ranks[r.rank].diag)
        raise RanksBrokenError(
            f"rank {r.rank} {describe_exit(code)}", self._stack_text() + crash, self._failures()
        )

    def check(self) -> None:
        self._check_collectives()
        if (
            self.interrupted_at is not None
            and time.monotonic() > self.interrupted_at + INTERRUPT_GRACE
        ):
            ranks = ", ".join(map(str, self.pending))
            raise RanksBrokenError(
                f"rank {ranks} did not stop within {INTERRUPT_GRACE:g} s of the interrupt "
                "(stuck in C code or a collective)",
                self._stack_text(),
            )

    def on_timeout(self) -> None:
        dumps = self.relay.stacks_now(self.running())
        self.stacks = {rank: cell_stack(dump) for rank, dump in dumps.items()}
        self._interrupt()

    def on_interrupt(self) -> None:
        if self.interrupted_at is None:
            self._interrupt()
        elif time.monotonic() - self.interrupted_at > DOUBLE_PRESS:
            raise RanksBrokenError("a second interrupt stopped them") from None

    def running(self) -> list[RankHandle]:
        """The ranks still running this cell."""
        return [self.processes[r] for r in self.pending if self.processes[r].exitcode() is None]

    def _on_reply(self, rank: int) -> None:
        try:
            message = pickle.loads(self.connections[rank].recv_bytes())
        except (EOFError, OSError):
            with contextlib.suppress(KeyError, ValueError):
                self.relay.unwatch(self.connections[rank].fileno())
            return  # the exit sentinel tells the rest
        if isinstance(message, Blocked):
            if message.cell == self.command.cell and message.op is not None:
                self.blocked[rank] = (message, time.monotonic())
            else:
                self.blocked.pop(rank, None)
        elif isinstance(message, Done) and message.cell == self.command.cell:
            self.blocked.pop(rank, None)
            self.done[rank] = message
            state = self.relay.state.ranks[rank]
            if message.interrupted:
                state.move(STOPPED)
            elif message.failure is not None:
                state.move(FAILED)
                f = message.failure
                state.error_line = describe_raise(f.exc_type, f.message).splitlines()[0][:200]
            else:
                state.move(FINISHED)
            self._drain_output(rank)
            self.on_reply_done(message)

    def _drain_output(self, rank: int) -> None:
        """The rank flushed its output before answering: show all of it in this cell."""
        r = self.processes[rank]
        for kind in ("events", "stdout", "stderr"):
            with contextlib.suppress(OSError, ValueError):
                while self.relay.read(r, kind):
                    pass
        # A cell's unfinished last line (print(..., end=""), an input() prompt) is this cell's.
        self.relay.flush_partial(rank)

    def _check_collectives(self) -> None:
        now = time.monotonic()
        idle = [r for r in self.processes if r not in self.pending]
        if not idle:
            return
        for rank, (message, since) in self.blocked.items():
            if now - since > COLLECTIVE_GRACE:
                raise RanksBrokenError(
                    self._half_done(rank, message, idle), self._stack_text(), self._failures()
                )

    def _half_done(self, rank: int, message: Blocked, idle: list[int]) -> str:
        """Why ``rank``'s collective can never complete: who left it, and how."""
        op = f"torch.distributed.{message.op}" + (f" ({message.where})" if message.where else "")
        stopped = [r for r in idle if r in self.done and self.done[r].interrupted]
        if stopped:
            # The Stop button, not the cell, left it half-done; gloo/NCCL waits are C++ and
            # cannot be interrupted, so the group cannot go on.
            who = ", ".join(map(str, stopped))
            return (
                f"the interrupt stopped rank {who} before it reached the {op} that rank {rank} "
                "is blocked in, and a rank cannot be freed from a collective"
            )
        others = ", ".join(map(str, idle))
        return (
            f"rank {rank} waits in {op} for rank {others}, which "
            f"{'has' if len(idle) == 1 else 'have'} already finished this cell, so the "
            "collective can never complete"
        )

    def _interrupt(self) -> None:
        self.interrupted_at = time.monotonic()
        self.relay.group.send_signal(self.running(), signal.SIGINT)
        # No prompt of this cell is shown any more: a rank's question already sent (another
        # rank's input()) or asked again (pdb catches the interrupt) is answered "interrupt".
        self.relay.debug.interrupt()

    def _stack_text(self) -> str:
        if not self.stacks:
            return ""
        return "\n\n".join(
            f"--- rank {rank} stack at timeout ---\n{stack.strip() or '(no stack received)'}"
            for rank, stack in sorted(self.stacks.items())
        )

    def _failures(self) -> dict[int, str]:
        """Rank -> the traceback of this cell where it raised."""
        return {d.rank: d.failure.traceback for d in self.done.values() if d.failure is not None}

    def verdict(self) -> dict[int, Done]:
        if self.stacks is not None:
            raise CellTimeoutError(self.timeout or 0.0, sorted(self.stacks), self.stacks)
        if self.interrupted_at is not None or any(d.interrupted for d in self.done.values()):
            ranks = ", ".join(str(r) for r in self.ranks)
            raise UserInterrupt(
                f"cell interrupted on rank {ranks}; the ranks are alive and keep their state"
            )
        failed = [d for d in self.done.values() if d.failure is not None]
        if failed:
            raise _cell_error(failed, self.relay.state)
        return self.done


def _cell_error(failed: list[Done], state: LaunchState) -> CellError:
    first, *rest = sorted(failed, key=lambda d: d.rank)
    f = first.failure
    others = tuple(
        f"rank {d.rank} {describe_raise(d.failure.exc_type, d.failure.message)}" for d in rest
    )
    return CellError(
        first.rank,
        state.info.world_size,
        describe_raise(f.exc_type, f.message),
        f.traceback,
        exc_type=f.exc_type,
        original=load_exception(f.exception),
        other_failures=others,
    )


def reset_state(state: LaunchState, ranks: list[int]) -> None:
    """Mark ``ranks`` as running a new cell (the others keep their last status)."""
    now = time.monotonic()
    state.started_at, state.ended_at, state.outcome = now, None, None
    state.longest_stall, state.stacks_requested_at = 0.0, None  # this cell's stalls only
    for rank in ranks:
        s = state.ranks[rank]
        s.move(RUNNING)
        s.started_at, s.error_line = now, None
        # What the views show is this cell's: bars, metrics, chart, counters, crash report.
        s.bars.clear()
        s.metrics.clear()
        s.history.clear()
        s._window.clear()
        s.steps, s.samples, s.diag, s.last_advance = 0, 0.0, "", None


def finish_state(state: LaunchState, outcome: Outcome) -> None:
    """End the cell in the state the views show: ranks that did not answer were stopped."""
    now = time.monotonic()
    state.outcome, state.ended_at = outcome, now
    for s in state.ranks.values():
        if s.status == RUNNING:
            s.move(STOPPED, now)


def cell_stack(dump: str) -> str:
    """The part of a rank's faulthandler dump that matters: the main thread's frames in the
    cell's code and the libraries it called, without nbaccel's command loop below them.

    >>> cell_stack('Thread 0x1 (most recent call first):\\n  File "w.py", line 3 in watch\\n\\n'
    ...            'Current thread 0x2 (most recent call first):\\n'
    ...            '  File "<rank cell 3>", line 2 in <module>\\n'
    ...            '  File "/x/nbaccel/persistent/serve.py", line 149 in run_code')
    'Current thread 0x2 (most recent call first):\\n  File "<rank cell 3>", line 2 in <module>'
    """
    blocks = dump.strip().split("\n\n")
    main = next((b for b in blocks if b.startswith("Current thread")), dump.strip())
    plumbing = ("nbaccel/persistent/serve.py", "nbaccel/rank/entry.py")
    lines = failures.without_plumbing(main).splitlines()
    kept = "\n".join(ln for ln in lines if not any(p in ln for p in plumbing))
    return with_cell_names(kept)  # "Cell In[12], line 2, in <module>", as the traceback says


def crash_stack(diag: str) -> str:
    """A rank's fatal crash (segfault, abort) as the user needs it: faulthandler's first line
    and the crashed thread's frames in the cell's code, without nbaccel's command loop, the
    fork server and multiprocessing frames below it, or the list of extension modules.
    "" when the rank's diagnostics hold no crash (e.g. it was killed, or called os._exit).

    >>> crash_stack('Fatal Python error: Segmentation fault\\n\\n'
    ...             'Current thread 0x2 (most recent call first):\\n'
    ...             '  File "<rank cell 3>", line 2 in <module>\\n'
    ...             '  File "/py/multiprocessing/process.py", line 108 in run\\n\\n'
    ...             'Extension modules: numpy, torch (total: 2)')
    'Fatal Python error: Segmentation fault\\n\\nCurrent thread 0x2 (most recent call first):\\n  File "<rank cell 3>", line 2 in <module>'
    """
    start = diag.rfind("Fatal Python error")
    if start < 0:
        return ""
    crash = diag[start:].strip()
    head = crash.split("\n\n", 1)[0]
    return f"{head}\n\n{cell_stack(crash)}"
