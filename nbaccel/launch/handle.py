"""One launch, from its first rank start to its last rank reaped: :class:`Launch` owns it.

Shaped like torch elastic's ``PContext`` (one object starts, polls and stops the workers):
a ``Launch`` holds the plan, its options and the current attempt's
:class:`~nbaccel.launch.lifecycle.RankLifecycle` (``lifecycle``; through it ``group``, the rank
group, which holds the fork server its ranks start from, and ``relay``, which reads them into
the view); its attempts (``launch.attempts``) follow the ranks with the event loop
(``launch.loop``) and a ``RunJob``, whose policies are a launch's: the first failure stops the
other ranks; the timeout collects every live rank's stack and raises; ``.stop()`` stops them
all. Whatever happens, every rank is reaped and what the ranks left running is swept
(``core.containment``) before the attempt returns.

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
import threading
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from nbaccel.core import shared_tensors
from nbaccel.core.errors import UserInterrupt
from nbaccel.launch.attempts import Attempts
from nbaccel.launch.lifecycle import RankLifecycle
from nbaccel.launch.options import LaunchOptions
from nbaccel.launch.plan import DEFAULTS, LaunchPlan
from nbaccel.launch.protocols import RankGroup, View
from nbaccel.launch.relay import Relay, load_payload
from nbaccel.launch.state import LaunchState, Outcome
from nbaccel.launch.state import RankStatus as Status

AWAIT_POLL = 0.1  # s between looks at a background launch that a cell awaits


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
    ``await launch``, and the live ``status``/``ranks``/``metrics()``; by rank (ipyparallel's
    ``AsyncResult`` shape), ``results()`` and each rank's ``output(rank)``.

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
    >>> launch.results(), launch.output(1)  # by rank: what returned, what it printed
    ({0: 'done'}, '')
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
        self.plan, self.options = plan, options
        self._busy = busy
        self._stopping = threading.Event()
        # Launch.stacks() of another thread: answered by the attempt's loop, which reads the pipes
        self._stack_requests: queue.SimpleQueue[concurrent.futures.Future[dict[int, str]]] = (
            queue.SimpleQueue()
        )
        self._attempts = Attempts(plan, options, make_view, self._stopping, self._stack_requests)
        self._thread: threading.Thread | None = None
        self._error_traceback: TracebackType | None = None

    @property
    def lifecycle(self) -> RankLifecycle | None:
        """The current attempt's ranks, from their start to their teardown (None before)."""
        return self._attempts.lifecycle

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
                payloads = self._attempts.run()
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
        first = self._attempts.first = self._attempts.new_lifecycle()
        first.show()  # here, before this cell's next line: see RankLifecycle.show
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
            if self._attempts.first is not None:
                self._attempts.first.never_started()
            return
        try:
            value = self.run()
        except BaseException as exc:  # noqa: BLE001 - every ending is the result's to raise
            self._error_traceback = exc.__traceback__  # as raised, before result() re-raises it
            self.set_exception(exc)
        else:
            self.set_result(value)

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

    def results(self, timeout: float | None = None) -> dict[int, Any]:
        """The ranks' return values by rank once the launch has ended (ipyparallel's results
        by engine): rank 0's, and every rank's with ``return_all=True``; waits and raises as
        :meth:`result` does."""
        __tracebackhide__ = True
        value = self.result(timeout)
        if self.options.return_all:
            return {spec.rank: v for spec, v in zip(self.plan.specs, value, strict=True)}
        return {0: value} if self.plan.info.node_rank == 0 else {}

    def output(self, rank: int, stream: str = "stdout") -> str:
        """Everything ``rank`` wrote to ``stream`` ("stdout" or "stderr") in the current
        attempt so far, from its log file (every byte, however much the view showed); "" before
        it wrote any."""
        if stream not in ("stdout", "stderr"):
            raise ValueError(f'stream must be "stdout" or "stderr", got {stream!r}')
        state = self.state
        path = state.log_path(rank, stream) if state is not None else None
        if path is None:
            return ""
        try:
            with open(path, encoding="utf-8", errors="replace") as file:
                return file.read()
        except FileNotFoundError:
            return ""

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
