"""The one event loop of the kernel's side: follow live ranks until a job says it is done.

A *job* is what the ranks are doing for the kernel: a launch's function (``launch.handle``'s
``RunJob``) or one ``%ranks`` cell (``persistent.cell``'s ``CellJob``). :func:`follow` waits on
every rank's pipes, exit sentinels and the job's own connections at once, hands what arrives to
the relay (output, events) or the job (replies, exits), and applies the policies every job
shares, here and nowhere else:

- **timeout**: past ``job.timeout`` seconds the job's ``on_timeout`` runs once (it collects the
  ranks' stacks, then raises or interrupts);
- **stall**: when the state says the ranks stalled, the job's running ranks are asked for their
  Python stacks (``STACK_DUMP_SIGNAL``, on their diagnostic pipes);
- **exit status**: a rank's sentinel can fire a moment before its status is collectable; the
  loop goes on reading the other ranks meanwhile (never a blocking join) and hands the exit to
  the job once the status is there (or after ``EXIT_STATUS_WAIT``);
  and a rank's status can be there while its sentinel never fires: without a fork server the
  sentinel is the end of a pipe the rank holds, and a child it forked (a DataLoader worker, a
  multiprocessing child) holds it too, beyond the rank's death. Every ``STATUS_LOOK`` s the loop
  asks each rank it has not heard end for its status (``exitcode()`` never blocks);
- **Ctrl-C**: a ``KeyboardInterrupt`` inside the loop goes to the job's ``on_interrupt`` (a
  launch re-raises it; a cell interrupts its ranks and goes on);
- **a paused rank** (``breakpoint()``/``input()``, ``launch.debugging``): its conversation is
  relayed when its connection is readable, and while any rank is paused the timeout and the
  stall detection hold still (the time paused does not count; pdb's ``q`` is a Ctrl-C).

The job's own policies (stop the other ranks at the first failure; a collective left half-done)
run in its ``check`` each turn. The view is updated each turn, at its own bounded rate.
"""

from __future__ import annotations

import time
from typing import Protocol

from nbaccel.core.events import STACK_DUMP_SIGNAL
from nbaccel.launch.group import RankProcess
from nbaccel.launch.relay import Relay

TICK = 0.05  # seconds between turns while nothing arrives
EXIT_STATUS_WAIT = 30.0  # s a rank's exit status may lag behind its sentinel
STATUS_LOOK = 0.5  # s between looks at the status of ranks whose sentinel has not fired


class Job(Protocol):
    """What :func:`follow` asks of a job (see the module docstring)."""

    timeout: float | None

    def finished(self) -> bool: ...

    def on_reply(self, r: RankProcess) -> None: ...

    def on_exit(self, r: RankProcess, code: int | None) -> None: ...

    def check(self) -> None: ...

    def on_timeout(self) -> None: ...

    def on_interrupt(self) -> None: ...

    def running(self) -> list[RankProcess]: ...


def follow(relay: Relay, job: Job) -> None:
    """Run the loop until ``job.finished()``; the job's own errors propagate."""
    deadline = None if job.timeout is None else time.monotonic() + job.timeout
    exiting: dict[int, tuple[RankProcess, float]] = {}  # sentinel fired, status not yet there
    ended: set[int] = set()  # ranks whose exit went to the job
    turn_started = next_look = time.monotonic()
    while not job.finished():
        try:
            held = relay.debug.holding()  # a rank paused at the turn's start
            for key, _ in relay.selector.select(TICK):
                r, kind = key.data
                if kind == "exit":
                    relay.unwatch(r.sentinel)
                    exiting[r.rank] = (r, time.monotonic())
                elif kind == "reply":
                    job.on_reply(r)
                elif kind == "debug":
                    relay.answer_debugger(r)
                else:
                    relay.read(r, kind)
            if time.monotonic() >= next_look:  # a status whose sentinel never fires
                next_look = time.monotonic() + STATUS_LOOK
                for r in relay.group.ranks:
                    if r.rank not in exiting and r.rank not in ended and r.exitcode() is not None:
                        relay.unwatch(r.sentinel)
                        exiting[r.rank] = (r, time.monotonic())
            for rank, (r, since) in list(exiting.items()):
                if r.exitcode() is not None or time.monotonic() - since > EXIT_STATUS_WAIT:
                    del exiting[rank]
                    ended.add(rank)
                    relay.drain(r)
                    job.on_exit(r, r.exitcode())
            now = time.monotonic()
            held = held or relay.debug.holding()
            if held:  # time paused for a person is not the launch's: it holds still
                if deadline is not None:
                    deadline += now - turn_started
                for rank_state in relay.state.ranks.values():
                    rank_state.note_activity(now)
            turn_started = now
            job.check()
            if deadline is not None and time.monotonic() > deadline:
                deadline = None  # once
                job.on_timeout()
            if relay.state.wants_stacks(time.monotonic()):
                relay.group.send_signal(job.running(), STACK_DUMP_SIGNAL)
            relay.view.update()
        except KeyboardInterrupt:
            job.on_interrupt()
