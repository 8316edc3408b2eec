"""A launch's attempts: start the planned ranks, follow them to their end, and again after a
rank fails (``max_restarts``); what a launch does about what happens while they run
(:class:`RunJob`, for the loop). The handle users hold, :class:`~nbaccel.launch.handle.Launch`,
runs this here or in its thread.
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import time
from collections.abc import Callable

from nbaccel.core import mp_internals
from nbaccel.core.containment import sigint_deferred
from nbaccel.core.errors import (
    LaunchStoppedError,
    LaunchTimeoutError,
    RankFailedError,
    UserInterrupt,
)
from nbaccel.core.local_traceback import with_cell_names
from nbaccel.launch import failures, loop
from nbaccel.launch.failures import describe_exit
from nbaccel.launch.lifecycle import RankLifecycle
from nbaccel.launch.options import LaunchOptions
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.protocols import STOP_GRACE, RankHandle, View
from nbaccel.launch.relay import Relay
from nbaccel.launch.state import Outcome
from nbaccel.launch.state import RankStatus as Status


class RunJob:
    """A launch's function on every rank, for :func:`nbaccel.launch.loop.follow`."""

    def __init__(
        self,
        relay: Relay,
        timeout: float | None,
        stopping: threading.Event,
        entry_file: str | None = None,
        stack_requests: queue.SimpleQueue[concurrent.futures.Future[dict[int, str]]] | None = None,
    ) -> None:
        self.relay, self.group, self.state = relay, relay.group, relay.state
        self.timeout = timeout
        self.stopping = stopping  # set by Launch.stop (another thread)
        self.entry_file = entry_file  # where a cluster's rank processes start (launch.failures)
        # Launch.stacks() of another thread: answered here, where the ranks' pipes are read
        self.stack_requests = stack_requests or queue.SimpleQueue()

    def finished(self) -> bool:
        # A failed rank is done, but its copy for %debug follows its failure (until it exits)
        return all(rank.done for rank in self.state.ranks.values()) and not self.relay.copying

    def on_reply(self, r: RankHandle) -> None:  # a launch has no command connections
        pass

    def on_exit(self, r: RankHandle, code: int | None) -> None:
        self.relay.copying.discard(r.rank)  # what it sent is read (drained) by now
        rank = self.state.ranks[r.rank]
        rank.exitcode = code
        if r.rank not in self.relay.payloads or rank.ended_at is None:
            rank.ended_at = time.monotonic()  # (one that reported ended when it returned)
        if rank.status == Status.FAILED:
            error = next(e for k, e in self.relay.failures if k == r.rank)
            error.exitcode = code
        elif r.rank in self.relay.payloads and (code == 0 or code == 255 and self._server_gone(r)):
            # Its result arrived; a dead server (255) cannot say how it exited.
            rank.move(Status.FINISHED)
        elif self.group.was_stopped(r.rank, code):
            rank.move(Status.STOPPED)
        else:
            what = describe_exit(code) if code != 0 else "exited without reporting a result"
            if code == 255 and self._server_gone(r):
                # multiprocessing's stand-in status: the server that reports it is gone
                what = "ended when its fork server died (its own exit status is unknown)"
            crash = failures.without_plumbing(rank.diag.strip(), self.entry_file)
            error = RankFailedError(r.rank, self.state.info.world_size, what, crash, exitcode=code)
            self.relay.record_failure(r.rank, error, what)

    def _server_gone(self, r: RankHandle) -> bool:
        """Whether the fork server ``r`` was forked from (current or retired) has died."""
        if not self.group.uses_fork_server:
            return False
        server = getattr(self.group, "server")  # noqa: B009 - a fork server's group has one
        return mp_internals.server_gone(server.live.server_of(r.pid))

    def check(self) -> None:
        self.group.notice_unreported()  # ranks ended under a fork server that hung
        while not self.stack_requests.empty():
            request = self.stack_requests.get_nowait()
            if request.set_running_or_notify_cancel():
                request.set_result(self.stacks(self.group.alive()))
        if self.relay.failures or self.stopping.is_set():
            self.group.begin_stop(STOP_GRACE)  # the other ranks (or all); idempotent
        self.group.poll_stop()

    def on_timeout(self) -> None:
        if self.relay.failures:  # the failure ends the launch; it is what to report
            return
        alive = self.group.alive()
        stacks = self.stacks(alive)
        self.state.outcome = Outcome.TIMED_OUT
        raise LaunchTimeoutError(self.timeout or 0.0, sorted(r.rank for r in alive), stacks)

    def stacks(self, alive: list[RankHandle]) -> dict[int, str]:
        """Each of ``alive``'s Python stacks now, a cell's frames named as its traceback names
        them (``Cell In[n]``) and nbaccel's own left out."""
        return {
            k: with_cell_names(failures.without_plumbing(v, self.entry_file))
            for k, v in self.relay.stacks_now(alive).items()
        }

    def on_interrupt(self) -> None:
        raise KeyboardInterrupt

    def running(self) -> list[RankHandle]:
        return self.group.alive()


class Attempts:
    """A launch's attempts, each a fresh :class:`RankLifecycle` with a fresh view: the first,
    and one more after each rank failure, up to ``plan.max_restarts``; the last failure is
    raised. ``stopping`` is the launch's ``stop()``."""

    def __init__(
        self,
        plan: LaunchPlan,
        options: LaunchOptions,
        make_view: Callable[[], View] | None,
        stopping: threading.Event,
        stack_requests: queue.SimpleQueue[concurrent.futures.Future[dict[int, str]]],
    ) -> None:
        if options.view is None and make_view is None:
            raise ValueError("a Launch needs a view: options.view or make_view")
        self.plan, self.options, self._make_view, self._stopping = (
            plan,
            options,
            make_view,
            stopping,
        )
        self._stack_requests = stack_requests  # Launch.stacks(), answered by each attempt's RunJob
        # The current attempt's ranks, from their start to their teardown (None before)
        self.lifecycle: RankLifecycle | None = None
        self.first: RankLifecycle | None = None  # a background launch's, shown by start()

    def run(self) -> dict[int, bytes | None]:
        """An attempt, and again (all ranks, each attempt a fresh view) after a rank fails, up
        to ``plan.max_restarts`` times; the last failure is raised."""
        __tracebackhide__ = True
        for restart in range(1, self.plan.max_restarts + 1):
            try:
                return self._attempt(restart - 1)
            except RankFailedError as exc:
                if self._stopping.is_set():
                    raise
                what = exc.exc_type.rsplit(".", 1)[-1] if exc.exc_type else "it exited"
                print(
                    f"nbaccel: rank {exc.rank} failed ({what}); restarting all "
                    f"{len(self.plan.specs)} ranks (restart {restart} of {self.plan.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
        return self._attempt(self.plan.max_restarts)

    def _attempt(self, restart: int) -> dict[int, bytes | None]:
        """Start the planned ranks (after ``restart`` restarts) and follow them to the end;
        return their payloads."""
        __tracebackhide__ = True
        life, self.first = self.first or self.new_lifecycle(restart), None
        self.lifecycle = life
        try:
            relay = life.start()
        except KeyboardInterrupt as exc:  # its message says what was stopped
            raise exc.with_traceback(None)  # noqa: B904 - nbaccel's frames are noise here
        try:
            return self._follow(life, relay)
        except KeyboardInterrupt:
            # Every rank is stopped and reaped by now; the loop's frames would only be noise.
            n = len(self.plan.specs)
            raise UserInterrupt(f"launch interrupted; all {n} ranks were stopped") from None

    def new_lifecycle(self, restart: int = 0) -> RankLifecycle:
        """The ranks of the attempt after ``restart`` restarts, with a fresh view."""
        view = self.options.view
        if view is None:
            assert self._make_view is not None  # checked in __init__
            view = self._make_view()
        life = RankLifecycle(self.plan.attempt(restart), view)
        life.state.attempt, life.state.attempts = restart + 1, self.plan.max_restarts + 1
        return life

    def _follow(self, life: RankLifecycle, relay: Relay) -> dict[int, bytes | None]:
        """The loop with a :class:`RunJob`; then the teardown, whatever happened."""
        state, failing = relay.state, False
        try:
            cluster = self.plan.cluster
            entry_file = cluster.rank_entry_file if cluster is not None else None
            job = RunJob(relay, self.plan.timeout, self._stopping, entry_file, self._stack_requests)
            loop.follow(relay, job)
            state.outcome = Outcome.FAILED if relay.failures else Outcome.FINISHED
        except BaseException:
            state.outcome, failing = state.outcome or Outcome.INTERRUPTED, True
            raise
        finally:
            # Teardown is not cut short by Ctrl-C; one then is raised after it, unless the
            # launch is already raising (that error is the one to report).
            with sigint_deferred(reraise=not failing):
                life.end(grace=STOP_GRACE if failing else 0.0)
                failure = relay.first_failure() if relay.failures else None  # before the summary
                if failure is None and self._stopping.is_set():
                    state.outcome = Outcome.INTERRUPTED
                relay.warn_leftovers()
                relay.view.finish()  # after the cleanup: a view's error is a bug to see
        if failure is not None and not self._stopping.is_set():
            raise failure
        if self._stopping.is_set():
            raise LaunchStoppedError(len(self.plan.specs), state.elapsed(time.monotonic()))
        return relay.payloads
