"""One launch, from its first rank start to its last rank reaped: :class:`Launch` owns it.

Shaped like torch elastic's ``PContext`` (one object starts, polls and stops the workers):
a ``Launch`` holds the plan, its options and the current attempt's
:class:`~nbaccel.launch.lifecycle.RankLifecycle` (``lifecycle``; through it ``group``, the rank
group, which holds the fork server its ranks start from, and ``relay``, which reads them into
the view), and follows the ranks with the event loop (``launch.loop``) and a :class:`RunJob`,
whose policies are a launch's: the first failure stops the other ranks; the timeout collects every
live rank's stack and raises; ``.stop()`` stops them all. Whatever happens, every rank is reaped
and what the ranks left running is swept (``core.containment``) before the attempt returns.

Blocking, ``Launch(plan).run()`` is ``notebook_launcher``. In the background
(``notebook_launcher(..., block=False)``) the same run happens in a thread, in the launching
cell's context (so its output and dashboard stay in that cell); the ``Launch`` is the handle:
a :class:`concurrent.futures.Future` of rank 0's value (like ipyparallel's ``AsyncResult``),
awaitable, whose ``result()`` raises a failed launch's error without the library's frames.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from nbaccel.core import mp_internals, shared_tensors
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
from nbaccel.launch.group import STOP_GRACE, RankProcess
from nbaccel.launch.lifecycle import RankLifecycle
from nbaccel.launch.options import LaunchOptions
from nbaccel.launch.plan import DEFAULTS, LaunchPlan
from nbaccel.launch.protocols import RankGroup, View
from nbaccel.launch.relay import Relay, load_payload
from nbaccel.launch.state import LaunchState, Outcome
from nbaccel.launch.state import RankStatus as Status

AWAIT_POLL = 0.1  # s between looks at a background launch that a cell awaits


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

    def on_reply(self, r: RankProcess) -> None:  # a launch has no command connections
        pass

    def on_exit(self, r: RankProcess, code: int | None) -> None:
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

    def _server_gone(self, r: RankProcess) -> bool:
        """Whether the fork server ``r`` was forked from (current or retired) has died."""
        if self.group.start_method != "forkserver":
            return False
        return mp_internals.server_gone(self.group.server.live.server_of(r.pid))

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

    def stacks(self, alive: list[RankProcess]) -> dict[int, str]:
        """Each of ``alive``'s Python stacks now, a cell's frames named as its traceback names
        them (``Cell In[n]``) and nbaccel's own left out."""
        return {
            k: with_cell_names(failures.without_plumbing(v, self.entry_file))
            for k, v in self.relay.stacks_now(alive).items()
        }

    def on_interrupt(self) -> None:
        raise KeyboardInterrupt

    def running(self) -> list[RankProcess]:
        return self.group.alive()


# Background launches that have not ended, oldest first: rerunning the cell that held one
# rebinds its name, and a rank paused there would wait for a handle nobody has (running()).
_running: list[Launch] = []
_running_lock = threading.Lock()


def running() -> list[Launch]:
    """This process's background launches (``block=False``) that have not ended, oldest first:
    how to reach one whose handle was lost (its cell was run again) to ``stop()`` or
    ``debug()`` it.

    >>> import nbaccel, time
    >>> def sleep_then(value):
    ...     time.sleep(30)
    ...     return value
    >>> _ = nbaccel.notebook_launcher(
    ...     sleep_then, args=(1,), num_processes=2, block=False, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    >>> [(launch.done(), len(launch.ranks)) for launch in running()]  # the handle was dropped
    [(False, 2)]
    >>> for launch in running():
    ...     launch.stop()
    >>> running()
    []
    """
    with _running_lock:
        return list(_running)


def _forget(launch: concurrent.futures.Future[Any]) -> None:
    with _running_lock:
        if launch in _running:
            _running.remove(launch)


class Launch(concurrent.futures.Future[Any]):
    """One launch of ``plan``: run it here (:meth:`run`) or in the background (:meth:`start`).

    In the background the launch is its handle, a :class:`concurrent.futures.Future` of rank
    0's value: ``done()``, ``wait()``, ``result()`` (rank 0's value, or the error a blocking
    launch raises), ``add_done_callback()``, ``concurrent.futures.wait([...])``, ``stop()``,
    ``await launch``, and the live ``status``/``ranks``/``metrics()``.

    >>> import nbaccel
    >>> def train(steps):
    ...     for step in range(steps):
    ...         nbaccel.log({"step": step})
    ...     return "done"
    >>> launch = nbaccel.notebook_launcher(
    ...     train, args=(10,), num_processes=2, block=False, progress=False
    ... )  # doctest: +ELLIPSIS
    nbaccel: launching 2 processes...
    >>> launch.result(timeout=120)  # waits: rank 0's return value
    'done'
    >>> launch.done(), launch.status
    (True, 'finished')
    >>> launch.metrics()[-1]["step"]  # rank 0's last nbaccel.log(...) values, as floats
    9.0
    """

    def __init__(
        self,
        plan: LaunchPlan,
        options: LaunchOptions = DEFAULTS,
        *,
        make_view: Callable[[], View] | None = None,
        busy: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        """``make_view`` makes each attempt's view when ``options.view`` is None; ``busy``
        wraps a blocking run (the kernel shown busy): the launcher gives both, from ``ui``."""
        super().__init__()
        if options.view is None and make_view is None:
            raise ValueError("a Launch needs a view: options.view or make_view")
        self.plan, self.options = plan, options
        self._make_view, self._busy = make_view, busy
        # The current attempt's ranks, from their start to their teardown (None before)
        self.lifecycle: RankLifecycle | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: RankLifecycle | None = None  # a background launch's, shown by start()
        self._stack_requests: queue.SimpleQueue[concurrent.futures.Future[dict[int, str]]] = (
            queue.SimpleQueue()
        )
        self._error_traceback: TracebackType | None = None

    @property
    def state(self) -> LaunchState | None:
        """What the current attempt's views show: each rank's status, output, metrics."""
        return self.lifecycle.state if self.lifecycle is not None else None

    @property
    def group(self) -> RankGroup | None:
        """The current attempt's rank group (its ranks' processes; the fork server they
        start from), once the launch has begun."""
        return self.lifecycle.group if self.lifecycle is not None else None

    @property
    def relay(self) -> Relay | None:
        """What reads the current attempt's ranks into its view, once they have started."""
        return self.lifecycle.relay if self.lifecycle is not None else None

    # -- running ----------------------------------------------------------------------------

    def run(self) -> Any:
        """Run the launch to its end here; rank 0's value (every rank's with ``return_all``)."""
        __tracebackhide__ = True
        try:
            with self._busy():  # in a kernel's main thread: the cell is busy to the end
                payloads = self._attempts()
            if self.options.return_all:
                return [load_payload(s.rank, payloads.get(s.rank)) for s in self.plan.specs]
            return load_payload(0, payloads.get(0)) if self.plan.info.node_rank == 0 else None
        finally:  # shared memory of arguments and of results that were never loaded
            shared_tensors.release(self.plan.specs[0].transfer if self.plan.specs else None)

    def start(self) -> Launch:
        """Run the launch in a background thread and return at once (``block=False``).

        The thread runs in this cell's context, so the launch's view and lines stay in this
        cell whichever cell runs meanwhile; the kernel's Stop button, which interrupts the
        main thread, does not reach it (``stop()`` does). A kernel that dies takes the ranks
        with it (the fork server stops everything below it when the kernel is gone).
        """
        if self._thread is not None:
            raise RuntimeError("this launch was started already; make a new one to run again")
        self._first = self._lifecycle()
        self._first.show()  # here, before this cell's next line: see RankLifecycle.show
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._background,), name="nbaccel-launch", daemon=True
        )
        with _running_lock:
            _running.append(self)
        self.add_done_callback(_forget)  # however it ends, cancelled before it started too
        self._thread.start()
        return self

    def _background(self) -> None:
        if not self.set_running_or_notify_cancel():  # cancel() came first
            if self._first is not None:
                self._first.never_started()
            return
        try:
            value = self.run()
        except BaseException as exc:  # noqa: BLE001 - every ending is the result's to raise
            self._error_traceback = exc.__traceback__  # as raised, before result() re-raises it
            self.set_exception(exc)
        else:
            self.set_result(value)

    def _attempts(self) -> dict[int, bytes | None]:
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
        life, self._first = self._first or self._lifecycle(restart), None
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

    def _lifecycle(self, restart: int = 0) -> RankLifecycle:
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

    # -- the handle of a background launch --------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the launch has ended or ``timeout`` seconds passed; whether it ended."""
        concurrent.futures.wait([self], timeout)
        return self.done()

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value once the launch has ended, or the error a blocking launch
        would have raised (``RankFailedError``, ``LaunchTimeoutError``, ...); a
        ``TimeoutError`` if it is still running after ``timeout`` seconds.

        Raised here, not through ``Future.result``, whose two frames would stand between the
        cell and the launch's own traceback."""
        __tracebackhide__ = True
        if not self.wait(timeout):
            raise TimeoutError(
                f"the launch is still running after {timeout:g} s (status: {self.status}); "
                "call result() again, or stop() it"
            )
        if self.cancelled():
            raise concurrent.futures.CancelledError("the launch was cancelled before it started")
        error = self.exception(timeout=0)
        if error is not None:  # its traceback as raised, not grown by an earlier result()
            raise error.with_traceback(self._error_traceback)
        return super().result(timeout=0)

    def stop(self, timeout: float | None = None) -> None:
        """Stop every rank (SIGTERM, SIGKILL after a grace) and wait until all are reaped and
        nothing they started runs; ``result()`` then raises ``LaunchStoppedError``."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def stacks(self, timeout: float = 10.0) -> dict[int, str]:
        """Each running rank's Python stack now, every thread (as a timeout reports them):
        where a background launch is, without stopping it. ``{rank: text}``; ``{}`` once the
        launch has ended.

        Example::

            launch = nbaccel.notebook_launcher(train, num_processes=2, block=False)
            print(launch.stacks()[1])   # where rank 1 is now: its threads, innermost call last
        """
        request: concurrent.futures.Future[dict[int, str]] = concurrent.futures.Future()
        self._stack_requests.put(request)  # answered by the launch's loop, which reads the pipes
        deadline = time.monotonic() + timeout
        while not request.done():
            if self.done() or time.monotonic() > deadline:
                request.cancel()
                if not request.done() or request.cancelled():
                    return {}
            concurrent.futures.wait([request], AWAIT_POLL)
        return request.result()

    def debug(self) -> None:
        """Open pdb, in the cell that calls this, on each rank of this background launch that
        waits in ``breakpoint()`` or ``input()`` (one after the other; the dashboard says
        "rank 1 paused in ..."). ``q`` or Ctrl-C at the prompt stops the launch, as ``stop()``
        does. Says so where no rank was paused. Returns nothing: a cell ending in
        ``launch.debug()`` shows no ``Out:`` under the conversation.
        """
        __tracebackhide__ = True
        relay = self.relay
        try:
            # stop(), not only its request: the rank's connection stays open until it is
            # stopped, so nothing of its code runs after q or Stop (see serve_here).
            served = relay.debug.serve_here(on_quit=self.stop) if relay else 0
        except KeyboardInterrupt:
            # The relay's frames, down to the kernel's input box, would only be noise here.
            raise UserInterrupt(
                "launch.debug() interrupted; the launch is stopped (launch.result() raises "
                "LaunchStoppedError)"
            ) from None
        if not served:
            print(f"launch.debug(): no rank is paused (the launch is {self.status})")

    def __await__(self) -> Generator[Any, None, Any]:
        return self._ended().__await__()

    async def _ended(self) -> Any:
        import asyncio

        # Polled rather than awaited through asyncio.wrap_future: ipykernel's Stop cancels an
        # awaiting cell only once its event loop wakes up, which a wrapped future did only
        # when the launch ended (Stop then did nothing for the whole run).
        __tracebackhide__ = True
        while not self.done():
            await asyncio.sleep(AWAIT_POLL)
        return self.result()

    @property
    def status(self) -> str:
        """'starting', 'running', 'paused' (a rank waits in ``breakpoint()``/``input()``: see
        ``debug()``), or how it ended: 'finished', 'failed', 'interrupted' (also after
        ``stop()``), 'timed out'."""
        state = self.state
        if self.done():
            return str(state.outcome if state is not None and state.outcome else Outcome.FAILED)
        if state is not None and any(r.status_text == "paused" for r in state.ranks.values()):
            return "paused"
        if state is not None and any(r.status != Status.STARTING for r in state.ranks.values()):
            return "running"
        return "starting"

    @property
    def ranks(self) -> dict[int, str]:
        """Each rank's status now ('starting', 'running', 'paused', 'finished', 'failed',
        'stopped'), as the dashboard's status column says it."""
        state = self.state
        if state is None:
            return {s.rank: str(Status.STARTING) for s in self.plan.specs}
        return {rank: s.status_text for rank, s in sorted(state.ranks.items())}

    def metrics(self, rank: int = 0) -> list[dict[str, float]]:
        """What ``rank`` logged so far with ``nbaccel.log``/``Accelerator.log``, as samples:
        the latest value of each name, at most one sample every 0.1 s per step logged (a rank
        that logs every step sends the step it is at when a sample is due, not every call),
        each with its ``step``: ready for ``pandas.DataFrame(...)`` or a plot."""
        state = self.state
        if state is None or rank not in state.ranks:
            return []
        return [{"step": step, **values} for step, values in list(state.ranks[rank].history)]

    def __repr__(self) -> str:
        ranks = ", ".join(f"rank {r} {s}" for r, s in self.ranks.items())
        elapsed = (
            f", {self.state.elapsed(time.monotonic()):.1f} s" if self.state is not None else ""
        )
        state = self.state
        attempt = f" ({state.attempt_text()})" if state is not None and state.attempts > 1 else ""
        return f"<nbaccel.Launch {self.status}{attempt}: {ranks}{elapsed}>"
