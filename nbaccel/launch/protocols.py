"""The declared extension points of a launch: what nbaccel asks of a rank, a rank group, a view
and a cluster backend.

A rank group (:class:`RankGroup`) is the ranks of one launch attempt as the lifecycle, the
relay and the event loop follow them; each rank is a :class:`RankHandle`. Every group extends
:class:`RankGroupBase`, where start, poll, signal, stop and reap are written once, and supplies
a few methods of its own: the local one (``launch.group.RankGroup``), XLA's thread-host one
(``launch.xla.ThreadHostGroup``) and a cluster's (``cluster.ray_group.RayRankGroup``). A
cluster backend (``cluster=`` of ``notebook_launcher``, e.g.
:class:`~nbaccel.cluster.ray_cluster.RayCluster`) is any object with :class:`Cluster`'s members;
the plan, the launch and the views ask the object, never its type. A new backend is one module
with a class like that (and its group), passed as ``cluster=``. A view (:class:`View`; ``view=``
of ``notebook_launcher``) is what the launch shows itself in: ``nbaccel.ui``'s text view and
dashboard implement it, above the launch, which never imports them.

What a group's ranks must be is checked when they have started (:func:`check_rank`), so a
backend that gets one wrong fails its first launch with a sentence saying which rank and what,
not with a relay that hangs on a blocking read:

>>> import os
>>> read, write = os.pipe()
>>> class Half:
...     rank, pid, sentinel = 3, os.getpid(), read
...     stdout = stderr = diag = events = os.fdopen(read, closefd=False)
>>> try:
...     check_rank(Half(), "HalfGroup")
... except LaunchError as error:
...     print(error)  # doctest: +ELLIPSIS
HalfGroup's rank 3: its stdout end blocks; ... os.set_blocking(fd, False) ...
>>> os.close(read), os.close(write)
(None, None)
"""

from __future__ import annotations

import abc
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from nbaccel.core.errors import LaunchError
from nbaccel.core.events import RankSpec
from nbaccel.launch.state import LaunchState

STOP_GRACE = 3.0  # seconds a rank gets to exit after SIGTERM before SIGKILL


@runtime_checkable
class RankHandle(Protocol):
    """One started rank, as the relay and the loop follow it. Every requirement is checked at
    the start (:func:`check_rank`):

    - ``stdout``, ``stderr``, ``diag``: objects with ``fileno()``, the reading ends of what
      the rank writes (its fds 1 and 2; crash and stack dumps), **non-blocking** (the relay
      reads what is there and never waits on one rank);
    - ``events``: a :class:`multiprocessing.connection.Connection` (or one that behaves as
      it: ``fileno()``, ``poll(0)``, ``recv_bytes()``, ``close()``), the pickled events;
    - ``sentinel``: a file descriptor that becomes readable when the rank has ended (the
      loop also asks ``exitcode()`` every 0.5 s, for sentinels a rank's child holds open);
    - ``exitcode()``: a **method**, None while it runs, then its status (negative: killed by
      that signal), never blocking; ``reap()`` collects the ended rank; ``close_pipes()``.
    """

    rank: int

    @property
    def pid(self) -> int: ...

    @property
    def sentinel(self) -> int: ...

    stdout: Any
    stderr: Any
    diag: Any
    events: Any

    def exitcode(self) -> int | None: ...

    def reap(self) -> None: ...

    def close_pipes(self) -> None: ...


def check_rank(rank: Any, group: str) -> None:
    """Raise a :class:`LaunchError` naming ``group``'s rank and the requirement of
    :class:`RankHandle` it misses; nothing when it meets them all."""
    where = f"{group}'s rank {getattr(rank, 'rank', '?')}"
    for name in ("stdout", "stderr", "diag"):
        end = getattr(rank, name, None)
        if end is None or not callable(getattr(end, "fileno", None)):
            raise LaunchError(f"{where} has no {name} end with a fileno() (RankHandle.{name}).")
        if os.get_blocking(end.fileno()):
            raise LaunchError(
                f"{where}: its {name} end blocks; the relay would wait on that one rank. Call "
                f"os.set_blocking(fd, False) on it when the rank starts (RankHandle.{name})."
            )
    events = getattr(rank, "events", None)
    missing = [m for m in ("fileno", "poll", "recv_bytes", "close") if not hasattr(events, m)]
    if missing:
        raise LaunchError(
            f"{where}: its events end lacks {', '.join(missing)}; it must behave as a "
            "multiprocessing.connection.Connection (wrap a descriptor with "
            "multiprocessing.connection.Connection(fd))."
        )
    if not isinstance(getattr(rank, "sentinel", None), int):
        raise LaunchError(
            f"{where}: its sentinel must be a file descriptor (an int) that becomes readable "
            "when the rank ends, e.g. a multiprocessing.Process's sentinel."
        )
    if not callable(getattr(rank, "exitcode", None)):
        raise LaunchError(
            f"{where}: exitcode must be a method (None while the rank runs, then its status), "
            "not an attribute."
        )


class RankGroupBase(abc.ABC):
    """A rank group's life written once: :meth:`start` (stops what started on any failure or
    Ctrl-C, then checks each rank), the one stop sequence (SIGTERM to every live rank and its
    children, SIGKILL after a grace period; :meth:`begin_stop`/:meth:`poll_stop` never block,
    the loop's ``RunJob`` calls them; :meth:`stop` is the blocking form), :meth:`wait`.

    A backend supplies :meth:`_start_ranks` (append each started rank, a :class:`RankHandle`,
    to ``ranks``), :meth:`alive`, :meth:`_signal_trees` (a signal to every live rank and what
    it started), :meth:`send_signal` (to the ranks only, e.g. a stack-dump request),
    :meth:`was_stopped` and :meth:`reap`, and says ``start_method`` (the banner's word),
    ``uses_fork_server`` (its ranks come from this kernel's fork server: the lifecycle starts
    it first and a status 255 may mean it died) and ``_kill_wait``: how long its SIGKILLed
    ranks get before they are reaped anyway (after :meth:`_statuses_late`).
    """

    start_method: str = "?"
    uses_fork_server: bool = False
    ranks: list[Any]
    strays: list[tuple[int, str]]
    _kill_at: float | None = None  # set by begin_stop
    _kill_wait: float | None = None  # None: as long as it takes

    def start(self) -> None:
        """Start every rank; on any failure or Ctrl-C, stop those started and re-raise."""
        try:
            self._start_ranks()
            for r in self.ranks:
                check_rank(r, type(self).__name__)
        except KeyboardInterrupt as exc:
            self.stop(grace=0)
            raise KeyboardInterrupt(self._interrupted_message(exc)) from None
        except BaseException:
            self.stop(grace=0)
            raise

    def _interrupted_message(self, exc: KeyboardInterrupt) -> str:
        """What a Ctrl-C during :meth:`start` says, once what started was stopped."""
        started = len(self.ranks)
        why = str(exc).partition("launch interrupted: ")[2]  # e.g. a server that hung
        return (
            f"launch interrupted while starting ranks; the {started} started were stopped"
            if started
            else "launch interrupted before any rank started"
        ) + (f"; {why}" if why else "")

    @abc.abstractmethod
    def _start_ranks(self) -> None:
        """Start every rank, appending each to ``ranks`` as it starts."""

    @abc.abstractmethod
    def alive(self) -> list[Any]:
        """The ranks still running."""

    @abc.abstractmethod
    def _signal_trees(self, sig: int) -> None:
        """Send ``sig`` to every live rank and everything it started."""

    @abc.abstractmethod
    def send_signal(self, ranks: list[Any], sig: int) -> None:
        """Send ``sig`` to these ranks only (not their children)."""

    @abc.abstractmethod
    def was_stopped(self, rank: int, exitcode: int | None = None) -> bool:
        """Whether ``rank`` ended because this group stopped it (not by itself)."""

    @abc.abstractmethod
    def reap(self) -> None:
        """Collect every ended rank and kill what the ranks left running."""

    def wait(self, timeout: float | None) -> bool:
        """Wait until every rank has exited or ``timeout`` passes; report whether all exited."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            alive = self.alive()
            if not alive:
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            multiprocessing.connection.wait([r.sentinel for r in alive], remaining)

    def _statuses_late(self) -> None:  # noqa: B027 - a hook: most groups need nothing
        """``_kill_wait`` s after SIGKILL some ranks' ends are still unreported."""

    def notice_unreported(self) -> None:  # noqa: B027 - a hook: most groups need nothing
        """Each loop turn: ranks that ended by themselves but were never reported."""

    def begin_stop(self, grace: float) -> None:
        """Ask every live rank and its children to stop (SIGTERM) now, once; returns at once."""
        if self._kill_at is not None:
            return
        self._kill_at = time.monotonic() + grace
        self._signal_trees(signal.SIGTERM)

    def poll_stop(self) -> None:
        """SIGKILL whatever is still alive once the grace period of :meth:`begin_stop` is over."""
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            self._signal_trees(signal.SIGKILL)
            wait = self._kill_wait
            if wait is not None and time.monotonic() >= self._kill_at + wait and self.alive():
                self._statuses_late()

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop every rank: SIGTERM, SIGKILL after ``grace`` seconds, then reap them all."""
        self.begin_stop(grace)
        assert self._kill_at is not None
        if not self.wait(max(0.0, self._kill_at - time.monotonic())):
            self._kill_at = time.monotonic()
            self.poll_stop()
            if not self.wait(self._kill_wait):
                self._statuses_late()
        self.reap()


@runtime_checkable
class RankGroup(Protocol):
    """The ranks of one launch attempt: started, followed, signalled, stopped and reaped.

    Each rank (``ranks``, ``alive()``) has ``rank``, ``pid``, ``sentinel`` (readable once it
    has ended), ``exitcode``, its ``stdout``/``stderr``/``diag``/``events`` pipes,
    ``reap()`` and ``close_pipes()`` (a :class:`RankHandle`)."""

    @property
    def start_method(self) -> str:
        """How its ranks start ("forkserver", "spawn", "fork", "ray"...), as the banner says."""
        ...

    @property
    def uses_fork_server(self) -> bool:
        """Whether its ranks come from this kernel's fork server."""
        ...

    @property
    def ranks(self) -> Sequence[Any]:
        """Every rank of the attempt, once started."""
        ...

    @property
    def strays(self) -> list[tuple[int, str]]:
        """(pid, command) of processes the ranks left running that reaping killed."""
        ...

    def start(self) -> None:
        """Start every rank; on an error, nothing of the start is left running."""
        ...

    def alive(self) -> list[Any]:
        """The ranks still running."""
        ...

    def was_stopped(self, rank: int, exitcode: int | None = None) -> bool:
        """Whether ``rank`` ended because the group stopped it (not by itself)."""
        ...

    def send_signal(self, ranks: list[Any], sig: int) -> None:
        """Send ``sig`` to ``ranks`` (and what they started)."""
        ...

    def notice_unreported(self) -> None:
        """Each loop turn: ranks that ended by themselves but were never reported."""
        ...

    def begin_stop(self, grace: float) -> None:
        """Ask every live rank to stop now (SIGTERM), once; returns at once."""
        ...

    def poll_stop(self) -> None:
        """SIGKILL what still runs once the grace of :meth:`begin_stop` is over."""
        ...

    def stop(self, grace: float = ...) -> None:
        """Stop every rank (SIGTERM, SIGKILL after ``grace`` s) and reap them all."""
        ...

    def wait(self, timeout: float | None) -> bool:
        """Wait until every rank has exited or ``timeout`` passes; whether all exited."""
        ...

    def reap(self) -> None:
        """Collect every ended rank and kill what the ranks left running."""
        ...


class View(Protocol):
    def start(self, state: LaunchState) -> None: ...

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        """Complete lines a rank wrote to ``stream`` ("stdout" or "stderr")."""

    def partial(self, rank: int, stream: str, text: str) -> None:
        """The rank's unfinished last line now ("" when there is none); optional for a view.
        So is ``settle()``: show now every line held back (a rank paused, and what it printed
        before must read above its pdb; a ``%%ranks`` cell's view holds bursts of lines)."""

    def update(self) -> None:
        """The state changed (progress, metrics, status); redraw if it is time to."""

    def finish(self) -> None:
        """The launch is over (any outcome): show the final summary."""


@runtime_checkable
class Cluster(Protocol):
    """Machines other than this one that a launch's ranks run on."""

    @property
    def start_method(self) -> str:
        """How the launch banner names the ranks' start (in place of a start method): "ray"."""
        ...

    @property
    def placement(self) -> str:
        """Where the launch banner says the ranks run, e.g. "on a Ray cluster"."""
        ...

    @property
    def rank_entry_file(self) -> str:
        """The end of the path of the file a rank's process starts in on the cluster: its frame
        and older ones are left out of a rank's crash report (``launch.failures``)."""
        ...

    @property
    def uses_gpus(self) -> bool:
        """Whether each rank gets a GPU (else the ranks run on CPU, gloo)."""
        ...

    @property
    def same_machine(self) -> bool:
        """Whether the ranks run on this machine: then its capacity is checked and arguments
        may travel in shared memory (elsewhere they are refused, results come pickled)."""
        ...

    def check_available(self) -> None:
        """Raise an error saying what to install or start when the backend cannot run here;
        called while the launch is planned, before anything starts."""
        ...

    def make_group(self, specs: list[RankSpec]) -> Any:
        """The rank group (a :class:`RankGroup`, best a :class:`RankGroupBase`) of one launch
        attempt: it starts ``specs``'s ranks on the cluster and is followed like a local
        group. Only the launch's ``RankLifecycle`` calls it (a test of the package rules
        checks)."""
        ...
