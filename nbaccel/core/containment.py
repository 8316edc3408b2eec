"""Find, by pid, what a launch left running after its ranks ended, wherever it re-parented to.

Each rank leads a session of its own and (Linux) is a child subreaper, so while it lives every
process it caused is below it; it stops them itself when its function has ended (see
:mod:`nbaccel.rank.containment`). When a rank dies abruptly (SIGKILL, a segfault, a stop), what
it had started re-parents to the fork server (also a subreaper) or, without one, to pid 1. This
module finds those processes system-wide, not only below the kernel:

- members of a rank's session (``getsid(pid) == rank pid``): subprocesses, multiprocessing
  children of any start method, DataLoader workers, unless they started a session of their own;
- children of the fork server that are not ranks: orphans of dead ranks, including those that
  did start a session of their own.

Example::

    left = sweep(pids, SERVER.server_pids(), SERVER.live)  # [(pid, "sleep 1000"), ...], killed
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

import psutil

from nbaccel.core import process_table
from nbaccel.core.process_table import describe


class LiveRanks:
    """Every rank this process started and has not reaped yet, over all launches and
    ``%ranks`` sessions, each with the fork server it was forked from (``None``: another start
    method). A launch registers its ranks as they start and releases them once reaped; a
    sweep spares them all, so one launch's sweep never takes another's ranks.

    >>> live = LiveRanks()
    >>> live.add(41, server=7); live.add(42, server=None)
    >>> sorted(live.pids()), live.from_server(7), live.server_of(41)
    ([41, 42], {41}, 7)
    >>> live.discard({41}); live.from_server(7)
    set()
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a background launch registers from its own thread
        self._server_of: dict[int, int | None] = {}

    def add(self, pid: int, server: int | None) -> None:
        with self._lock:
            self._server_of[pid] = server

    def discard(self, pids: set[int]) -> None:
        with self._lock:
            for pid in pids:
                self._server_of.pop(pid, None)

    def pids(self) -> set[int]:
        with self._lock:
            return set(self._server_of)

    def server_of(self, pid: int) -> int | None:
        """The fork server the live rank ``pid`` was forked from (``None``: unknown, or
        another start method)."""
        with self._lock:
            return self._server_of.get(pid)

    def from_server(self, server: int) -> set[int]:
        with self._lock:
            return {pid for pid, s in self._server_of.items() if s == server}


def session_members(sids: set[int]) -> list[psutil.Process]:
    """Processes anywhere on the machine in one of the sessions ``sids`` (leaders excluded)."""
    found = []
    me = os.getpid()
    for pid in psutil.pids():
        if pid in sids or pid == me:
            continue
        try:
            if os.getsid(pid) in sids:
                found.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            pass
    return found


def server_strays(servers: set[int], live: set[int]) -> list[psutil.Process]:
    """Children of the fork servers ``servers`` that are no rank in ``live``: a dead rank's
    orphans."""
    return [child for pid in servers for child in _strays_of(pid, live)]


def _strays_of(pid: int, live: set[int]) -> list[psutil.Process]:
    try:
        server_sid = os.getsid(pid)
        pids = process_table.child_pids(pid)
        children = psutil.Process(pid).children() if pids is None else _processes(pids)
    except (OSError, psutil.Error):
        return []
    strays = []
    for child in children:
        if child.pid in live:
            continue
        try:
            # A rank the server forked a moment ago is not registered yet; it is still in the
            # server's session until it starts its own.
            if os.getsid(child.pid) != server_sid and child.status() != psutil.STATUS_ZOMBIE:
                strays.append(child)
        except (OSError, psutil.Error):
            pass
    return strays


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # gone meanwhile: nothing to sweep
            found.append(psutil.Process(pid))
    return found


def sweep(rank_pids: set[int], servers: set[int], live: LiveRanks) -> list[tuple[int, str]]:
    """Kill (SIGKILL) what the ranks ``rank_pids`` left running; return (pid, command) of each.

    Call it once those ranks have exited; ``servers`` are the fork servers ranks were forked
    from, whose children that are no rank in ``live`` are orphans. Looks again until nothing
    new turns up, since a killed process's children re-parent and can be found only
    afterwards.
    """
    killed: dict[int, str] = {}
    for _ in range(10):
        strays = server_strays(servers, live.pids())
        found = [p for p in session_members(rank_pids) + strays if p.pid not in killed]
        found = [p for p in found if process_table.alive(p)]
        if not found:
            break
        killed.update((p.pid, describe(p)) for p in found)
        process_table.signal_all(found, signal.SIGKILL)
        psutil.wait_procs(found, timeout=1.0)
    return sorted(killed.items())


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (a rank and the descendants that stayed
    in its group); nothing if there is no such group (the rank has not started its own yet)."""
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)


def leftover_warning(processes: list[tuple[int, str, int | None]]) -> str:
    """One line naming processes that were still running when a launch ended.

    >>> leftover_warning([(41, "sleep 1000", 0), (42, "sleep 1000", 1)])
    'nbaccel stopped 2 processes the ranks left running: pid 41 (sleep 1000, rank 0), pid 42 (sleep 1000, rank 1)'
    """
    n = len(processes)
    items = ", ".join(
        f"pid {pid} ({cmd}" + (f", rank {rank})" if rank is not None else ")")
        for pid, cmd, rank in processes
    )
    return f"nbaccel stopped {n} process{'es' if n != 1 else ''} the ranks left running: {items}"


class sigint_deferred:  # noqa: N801 - used like a function: ``with sigint_deferred():``
    """Hold Ctrl-C back while the block runs; with ``reraise``, raise it once the block is done.

    Starting a rank must not be cut in half (a rank the fork server forked but whose pid the
    kernel never learned would run unsupervised), nor must stopping one. ``as`` gives a list
    that is non-empty once Ctrl-C was pressed. Outside the main thread there is no SIGINT.
    Inside another one (a teardown step within a launch's teardown), a Ctrl-C is handed to the
    outer block, which decides: it is raised once, after all of it.

    Example::

        with sigint_deferred():
            process.start()        # a Ctrl-C meanwhile is raised here, after the start
    """

    def __init__(self, reraise: bool = True) -> None:
        self.reraise = reraise
        self.received: list[bool] = []
        self._previous: Any = None

    def __enter__(self) -> list[bool]:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._pressed)
        return self.received

    def _pressed(self, *_: object) -> None:
        self.received.append(True)

    def __exit__(self, kind: type | None, *rest: object) -> None:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out
        outer = getattr(self._previous, "__self__", None)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if isinstance(outer, sigint_deferred) and self.received and self.reraise:
            outer.received.extend(self.received)  # the outer block raises it, after its end
        elif self.received and self.reraise and kind is None:
            raise KeyboardInterrupt("launch interrupted") from None


class LeftoverProcessesWarning(UserWarning):
    """Processes a launch's ranks left running were stopped when the launch ended."""
