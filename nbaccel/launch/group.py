"""Start, watch and stop the rank processes of one launch.

One :class:`RankGroup` owns its ranks from start to reaping: nothing else sends them signals.
Each rank gets four pipes of its own (stdout, stderr, crash/stack reports, events), created just
before it starts so that no rank inherits another's write ends. Stopping reaches a rank's whole
process group, and reaping also kills whatever the ranks left running wherever it re-parented
(:mod:`nbaccel.core.containment`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import psutil

from nbaccel.core import containment, mp_internals, process_table
from nbaccel.core.errors import LaunchError
from nbaccel.core.events import RankSpec
from nbaccel.forkserver import server as forkserver
from nbaccel.rank.entry import run_rank

STOP_GRACE = 3.0  # seconds a rank gets to exit after SIGTERM before SIGKILL
# Seconds a SIGKILLed rank's exit status may take to come from its fork server; a server that
# takes longer has stopped answering (hung, or stopped) and would hold the kernel forever.
KILLED_STATUS_WAIT = 5.0
# s between looks at the ranks' descendants where no fork server adopts a dead rank's orphans
DESCENDANT_LOOK = 0.1


@dataclasses.dataclass
class RankProcess:
    """One started rank and the kernel's (reading) ends of its pipes."""

    rank: int
    process: Any
    stdout: Any
    stderr: Any
    diag: Any
    events: Any
    _final_exitcode: int | None = None
    _reaped: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def exitcode(self) -> int | None:
        return self._final_exitcode if self._reaped else self.process.exitcode

    def reap(self) -> None:
        self.process.join()
        self._final_exitcode = self.process.exitcode
        self.process.close()
        self._reaped = True

    def close_pipes(self) -> None:
        for conn in (self.stdout, self.stderr, self.diag, self.events):
            conn.close()


class StopSequence:
    """The one stop sequence of a group of ranks, local or on a cluster: SIGTERM to every live
    rank and its children, SIGKILL after a grace period. :meth:`begin_stop`/:meth:`poll_stop`
    never block (the loop's ``RunJob`` calls them); :meth:`stop` is the blocking form for
    cleanup paths. A group supplies ``alive()`` (its ranks still running, each with a
    ``sentinel``), ``_signal_trees(sig)`` and ``reap()``, and ``_kill_wait``: how long its
    SIGKILLed ranks get before they are reaped anyway (after ``_statuses_late()``: what to do
    about ranks whose end has still not been reported)."""

    _kill_at: float | None = None  # set by begin_stop
    _kill_wait: float | None = None  # None: as long as it takes

    def alive(self) -> list[Any]:
        raise NotImplementedError

    def _signal_trees(self, sig: int) -> None:
        raise NotImplementedError

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

    def reap(self) -> None:
        raise NotImplementedError

    def _statuses_late(self) -> None:
        """``_kill_wait`` s after SIGKILL some ranks' ends are still unreported."""

    def notice_unreported(self) -> None:
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


class RankGroup(StopSequence):
    """The ranks of one launch: start them, signal them, and reap them and their children.

    Example::

        group = RankGroup(specs, start_method="forkserver")
        group.start()
        ...
        group.stop()          # SIGTERM, then SIGKILL after a grace period; always reaps
    """

    def __init__(
        self,
        specs: list[RankSpec],
        start_method: str,
        server: forkserver.ForkServer = forkserver.SERVER,
    ) -> None:
        self.specs = specs
        self.start_method = start_method
        self.server = server  # starts at its mirror one launch at a time; registers the ranks
        self.ranks: list[RankProcess] = []
        self._kill_wait = KILLED_STATUS_WAIT
        self._dead_since: dict[int, float] = {}  # pid -> when seen dead, its end unreported
        self._next_look = 0.0
        self._stop_signals: dict[int, set[int]] = {}  # rank -> stop signals sent while it ran
        self._kill_at: float | None = None  # set by begin_stop
        # (pid, command) of processes the ranks left running that reaping killed
        self.strays: list[tuple[int, str]] = []
        # pid -> start time: descendants in sessions of their own, seen while the ranks lived
        # (spawn, fork: see note_descendants)
        self._daemons: dict[int, float] = {}
        self._next_descendant_look = 0.0
        # Hears what the start waits for before the forks (the fork server's imports), in
        # words, about every 0.2 s, and None once the ranks are starting (a launch's view).
        self.waiting: Callable[[str | None], None] = lambda what: None

    def start(self) -> None:
        """Start every rank; on any failure or Ctrl-C, stop those started and re-raise.

        With the fork server still importing (the first launch after ``import nbaccel``, or
        the kernel's modules the function uses), this first waits for it, interruptibly. Each rank start then runs with Ctrl-C held back, so
        an interrupt never leaves a rank whose pid the kernel does not know.
        """
        ctx = multiprocessing.get_context(self.start_method)
        try:
            with (
                self.server.starts,
                self.server.ranks_starting(self.specs, self.start_method, self.waiting),
            ):
                for spec in self.specs:
                    self._start_answered(ctx, spec)
        except KeyboardInterrupt as exc:
            self.stop(grace=0)
            started = len(self.ranks)
            why = str(exc).partition("launch interrupted: ")[2]  # e.g. a server that hung
            raise KeyboardInterrupt(
                (
                    f"launch interrupted while starting ranks; the {started} started were stopped"
                    if started
                    else "launch interrupted before any rank started"
                )
                + (f"; {why}" if why else "")
            ) from None
        except BaseException:
            self.stop(grace=0)
            raise

    def _start_answered(self, ctx: Any, spec: RankSpec) -> None:
        """Start one rank with Ctrl-C held back; a fork server that does not answer is set
        aside (``ForkServer.start_answered``), not left to trap the kernel."""
        with containment.sigint_deferred() as interrupted:
            if self.start_method != "forkserver":
                self.ranks.append(self._start_one(ctx, spec))
                return
            start = functools.partial(self._start_one, ctx, spec)
            server = mp_internals.forkserver_pid()
            try:
                self.ranks.append(self.server.start_answered(start, interrupted, self._stop_late))
            except (EOFError, ConnectionError) as exc:  # multiprocessing's words for it
                if not mp_internals.server_gone(server):
                    raise
                raise LaunchError(
                    f"the fork server (pid {server}) died while starting rank {spec.rank} "
                    f"({type(exc).__name__}: {exc}); the ranks started were stopped. Run the "
                    "launch again: it starts a fresh server. If this repeats, the machine may "
                    "be out of memory (see `dmesg` for the OOM killer)."
                ) from None

    def _stop_late(self, r: RankProcess) -> None:
        """A rank the fork server forked after its start was given up: it never ran for this
        group. Kill it and what it started, reap it, and release it."""
        pid = r.pid
        containment.signal_group(pid, signal.SIGKILL)
        self.send_signal([r], signal.SIGKILL)
        r.reap()
        r.close_pipes()
        self.server.reaped({pid})

    def _start_one(self, ctx: Any, spec: RankSpec) -> RankProcess:
        pipes = [ctx.Pipe(duplex=False) for _ in range(4)]
        readers = [r for r, _ in pipes]
        writers = [w for _, w in pipes]
        process = ctx.Process(
            target=run_rank,
            args=(spec, *writers),
            name=f"{process_table.RANK_PROCESS_PREFIX}{spec.rank}",
            daemon=False,
        )
        try:
            process.start()
            self.server.started(process.pid, self.start_method)
        finally:
            for w in writers:  # the rank holds them now; closing ours lets EOF arrive
                w.close()
        for r in readers[:3]:
            os.set_blocking(r.fileno(), False)
        return RankProcess(spec.rank, process, *readers)

    def alive(self) -> list[RankProcess]:
        return [r for r in self.ranks if r.exitcode() is None]

    def was_stopped(self, rank: int, exitcode: int | None = None) -> bool:
        """Whether this group's stop ended the rank (so its death is not its own failure): it
        was sent a stop signal while it ran, and did not die of a signal it was not sent (a
        rank SIGKILLed by someone else while only SIGTERM had gone out failed first)."""
        sent = self._stop_signals.get(rank)
        if not sent:
            return False
        return exitcode is None or exitcode >= 0 or -exitcode in sent

    def send_signal(self, ranks: list[RankProcess], sig: int) -> None:
        """Send ``sig`` to these ranks only (not their children): e.g. a stack-dump request."""
        for r in ranks:
            try:
                os.kill(r.pid, sig)
            except ProcessLookupError:
                pass

    # -- the stop sequence is StopSequence's; what a signal reaches is the group's

    def _signal_trees(self, sig: int) -> None:
        alive = self.alive()
        for r in alive:
            try:
                children = psutil.Process(r.pid).children(recursive=True)
            except psutil.Error:
                children = []
            # A rank already dead, whose exit the server has not reported yet, was not ended by
            # this stop (rank 0 SIGKILLed while rank 1's "Connection reset" arrives first).
            if not _dead(r.pid):
                self._stop_signals.setdefault(r.rank, set()).add(sig)
            containment.signal_group(r.pid, sig)
            self.send_signal([r], sig)
            process_table.signal_all(children, sig)

    def _statuses_late(self) -> None:
        """Ranks that have died (zombies of their fork server) but whose server never said so:
        it has stopped answering, and reaping them would wait forever. Kill that server (what
        it adopted from dead ranks first), so their statuses arrive: "lost its server"."""
        for r in self.alive():
            server = self.server.live.server_of(r.pid)
            if _dead(r.pid) and server is not None:
                containment.sweep(set(), {server}, self.server.live)
                self.server.retire_unanswering(server, even_serving=True)

    def notice_unreported(self) -> None:
        """A rank that ended by itself under a server that stopped answering is never
        reported, and the launch would wait for it forever: once a second, note ranks that
        are dead but unreported; after ``_kill_wait`` s, see :meth:`_statuses_late`. (Each
        loop turn; also :meth:`note_descendants`.)"""
        now = time.monotonic()
        self.note_descendants(now)
        if self._kill_wait is None or now < self._next_look:
            return
        self._next_look = now + 1.0
        unreported = {r.pid for r in self.alive() if _dead(r.pid)}
        self._dead_since = {p: self._dead_since.get(p, now) for p in unreported}
        if any(now - since >= self._kill_wait for since in self._dead_since.values()):
            self._statuses_late()

    def note_descendants(self, now: float) -> None:
        """Without a fork server (``spawn``, ``fork``) the orphans of a rank that dies abruptly
        (SIGKILL, a crash: it cannot stop them itself) re-parent to pid 1, where the sweep finds
        the members of its session but not a daemon, which started a session of its own. While
        the ranks live every process they caused is below them (each is a subreaper), so every
        ``DESCENDANT_LOOK`` s note those daemons by pid and start time; :meth:`reap` kills the
        ones still running. One started and orphaned between two looks can still escape."""
        if self.start_method == "forkserver" or now < self._next_descendant_look:
            return
        self._next_descendant_look = now + DESCENDANT_LOOK
        for r in self.alive():
            below = process_table.child_pids(r.pid) or []
            while below:
                pid = below.pop()
                if pid in self._daemons:
                    continue
                with contextlib.suppress(OSError, psutil.Error):
                    if os.getsid(pid) != r.pid:
                        self._daemons[pid] = psutil.Process(pid).create_time()
                below += process_table.child_pids(pid) or []

    def _sweep_daemons(self) -> list[tuple[int, str]]:
        """Kill the daemons :meth:`note_descendants` saw that still run (same pid and start
        time), and the members of their sessions."""
        found = []
        for pid, created in self._daemons.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01 and process_table.alive(p):
                    found.append(p)
        self._daemons.clear()
        if not found:
            return []
        killed = [(p.pid, process_table.describe(p)) for p in found]
        process_table.signal_all(found, signal.SIGKILL)
        psutil.wait_procs(found, timeout=1.0)
        return killed + containment.sweep({p.pid for p in found}, set(), self.server.live)

    def reap(self) -> None:
        """Reap every rank (they must have exited), then kill what they left running."""
        pids = {r.pid for r in self.ranks if not r._reaped}
        for r in self.ranks:
            if not r._reaped:
                r.reap()
        if pids:
            self.strays += self.server.reaped(pids)
            self.strays += self._sweep_daemons()


def _dead(pid: int) -> bool:
    """Whether the rank ``pid`` has ended (a zombie its server has not reaped, or gone)."""
    try:
        return not process_table.alive(psutil.Process(pid))
    except psutil.Error:
        return True
