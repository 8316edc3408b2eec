"""How a plan's ranks start and how they are torn down, in one place: for each attempt of a
launch (``launch.handle``) and for a ``%ranks`` session (``persistent.session``) alike.

The start: the view first (a cell must not stay blank while the fork server still imports
torch; :meth:`RankLifecycle.show`), the fork server (refusing a restart that would stop other
launches' ranks), the group's ranks, their clocks (a wait for the server is no stall), and the
relay watching their pipes.
The teardown: what still runs is stopped (after a wait for the ranks to leave by themselves, if
asked: SIGTERM, SIGKILL after a grace), every rank is reaped and what the ranks left running is
swept (``core.containment``), their last output read and their pipes closed, with Ctrl-C held
back until it is done. What the ranks do in between is a job's (``launch.loop``).

Example::

    life = RankLifecycle(plan, view)
    relay = life.start()          # every rank started, or nothing left of the start
    loop.follow(relay, job)
    life.end()                    # stopped, reaped, swept, pipes closed
"""

from __future__ import annotations

import time

from nbaccel.core.containment import sigint_deferred
from nbaccel.core.errors import LaunchError
from nbaccel.forkserver import server as forkserver
from nbaccel.launch import xla
from nbaccel.launch.group import RankGroup
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.protocols import View
from nbaccel.launch.relay import Relay
from nbaccel.launch.state import LaunchState, Outcome, RankState


class RankLifecycle:
    """The ranks of ``plan`` from their start (:meth:`start`) to their teardown (:meth:`end`),
    with their ``state`` (what the views show), ``group`` and, once started, ``relay``.

    ``xla_threads`` overrides the plan's choice of XLA device threads in one host process
    (a ``%ranks`` session runs one process per rank, each serving its own command socket).
    """

    def __init__(self, plan: LaunchPlan, view: View, *, xla_threads: bool | None = None) -> None:
        self.plan, self.view = plan, view
        self.state = LaunchState(plan.info, {s.rank: RankState(s.rank) for s in plan.specs})
        threads = plan.xla_threads if xla_threads is None else xla_threads
        self.group = (
            xla.make_group(plan.specs, plan.info.start_method, threads)
            if plan.cluster is None
            else plan.cluster.make_group(plan.specs)  # ranks on a cluster (nbaccel.cluster)
        )
        if isinstance(self.group, RankGroup):
            self.group.waiting = self._waiting
        self.relay: Relay | None = None
        self._shown = self._ended = False

    def _waiting(self, what: str | None) -> None:
        """The start waits for ``what`` (None: no more): the view's header says so, and its
        clock ticks meanwhile."""
        state = self.state
        if what is None:
            state.waiting_since = None
        elif state.waiting_for is None:
            state.waiting_since = time.monotonic()
        if what is None and state.waiting_for is None:
            return
        state.waiting_for = what
        if self._shown:  # (before the view's first frame, that frame says it)
            self.view.update()

    def show(self) -> None:
        """The view's first lines: the banner, and what the start will wait for first (a fork
        server still importing). :meth:`start` shows them if this was not called; a background
        launch calls it in the launching thread, so they come before that cell's next line
        (printed from the launch's thread, they split a ``print`` of the cell mid-line)."""
        if self._shown:
            return
        if self.plan.info.start_method == "forkserver":
            warming = forkserver.SERVER.warming()
            if warming is not None:  # known before the first frame: it says "waiting", and
                self._waiting(warming)  # for what, not "running" while no rank runs yet
        self._shown = True
        self.view.start(self.state)
        if self.state.waiting_for is not None:
            self.view.update()  # the text view prints what it waits for at once

    def never_started(self) -> None:
        """End the view :meth:`show` began for a start that will not run (its background
        launch was cancelled before its thread ran)."""
        if self._shown and self.state.ended_at is None:
            self.state.outcome = Outcome.INTERRUPTED
            self.state.ended_at = time.monotonic()
            self.view.finish()

    def start(self) -> Relay:
        """Start every rank and return the relay reading them. On any failure, Ctrl-C
        included, nothing of the start is left (:meth:`end`), the view ends with the outcome,
        and the error is raised."""
        __tracebackhide__ = True
        state, view = self.state, self.view
        self.show()
        try:
            if self.plan.info.start_method == "forkserver":
                refuse_restart_under(self.plan.preload)
                forkserver.SERVER.ensure(self.plan.preload)
            self.group.start()  # stops what it started on any failure
            # The ranks' clocks start with the ranks: a wait for the fork server (its imports)
            # is no stall, and a stack request then would kill ranks without a handler yet.
            started = time.monotonic()
            for rank_state in state.ranks.values():
                rank_state.started_at = started
            self.relay = Relay(self.group, state, view)
            self.relay.register()
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            state.outcome = Outcome.INTERRUPTED if interrupted else Outcome.FAILED
            self.end()
            state.ended_at = time.monotonic()
            view.finish()
            raise
        return self.relay

    def end(self, wait: float = 0.0, grace: float = 0.0) -> None:
        """Tear the ranks down: give them ``wait`` seconds to exit by themselves, then stop
        what still runs (SIGTERM, SIGKILL after ``grace`` s); reap them all and sweep what
        they left running; read what their pipes still hold (a rank that had not ended was
        stopped) and close them. Idempotent; a Ctrl-C meanwhile is raised once it is done
        (or handed to an enclosing ``sigint_deferred``)."""
        if self._ended:
            return
        with sigint_deferred():
            if not self.group.wait(wait):
                self.group.stop(grace)
            self.group.reap()
            if self.relay is not None:
                self.relay.drain_all()
                self.relay.close()
            self._ended = True


def refuse_restart_under(preload: tuple[str, ...]) -> None:
    """A fork server restarted for ``preload`` would stop every rank forked from it: refuse
    while another launch (in the background) or a ``%ranks`` session has ranks running."""
    live = forkserver.SERVER.live.pids()
    if live and forkserver.SERVER.lacks(preload):
        pids = ", ".join(map(str, sorted(live)))
        raise LaunchError(
            f"preload={list(preload)!r} needs a fresh fork server, which would stop the ranks "
            f"already running from this one (pids {pids}: a background launch or a %ranks "
            "session). Wait for them (launch.result()) or stop them (launch.stop(), `%ranks "
            "stop`) first, or launch without preload=."
        )
