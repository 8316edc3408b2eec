"""Start, watch and stop the rank processes of one launch; owns the fork server.

One :class:`RankGroup` owns its ranks from start to reaping: nothing else sends them signals.
Each rank gets four pipes of its own (stdout, stderr, crash/stack reports, events), created just
before it starts so that no rank inherits another's write ends.

The default start method is a fork server that has imported torch (and the modules the first
optimizer step pulls in) once, so ranks fork in milliseconds from a clean process that never saw
the kernel's threads or CUDA context.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import threading
import time
from typing import Any

import psutil

from nbaccel._worker import RankSpec, run_rank

# Imported once by the fork server; every rank then starts with them loaded.
SERVER_PRELOAD = ("nbaccel._preload",)

_server_lock = threading.Lock()
_server_modules: tuple[str, ...] = ()


def available_start_methods() -> list[str]:
    return multiprocessing.get_all_start_methods()


def resolve_start_method(name: str) -> str:
    """Map ``"auto"`` to the best method here and reject methods this platform lacks."""
    methods = available_start_methods()
    if name == "auto":
        return "forkserver" if "forkserver" in methods else "spawn"
    if name not in methods:
        raise ValueError(
            f"start_method={name!r} is not available on this platform; "
            f"choose one of {', '.join(map(repr, ['auto', *methods]))}."
        )
    return name


def ensure_server(extra_modules: tuple[str, ...] = ()) -> None:
    """Start the fork server (or restart it when it lacks ``extra_modules``); returns at once.

    The server imports its modules in the background; the first rank start waits for that.
    """
    global _server_modules
    wanted = tuple(dict.fromkeys(SERVER_PRELOAD + tuple(extra_modules)))
    with _server_lock:
        server = multiprocessing.forkserver._forkserver
        running = server._forkserver_pid is not None
        if running and not set(wanted) <= set(_server_modules):
            server._stop()  # a server started without these modules cannot gain them
            running = False
        if not running:
            _server_modules = wanted
            server.set_forkserver_preload(list(wanted))
        server.ensure_running()


def helper_pids() -> set[int]:
    """Long-lived helpers of this process that are not ranks: the fork server and the
    resource tracker multiprocessing starts beside it."""
    from multiprocessing import resource_tracker

    pids = {
        multiprocessing.forkserver._forkserver._forkserver_pid,
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return {p for p in pids if p is not None}


def describe_exit(exitcode: int | None) -> str:
    """Say in words how a process ended, e.g. "was killed by signal SIGSEGV"."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:
            return f"was killed by signal {-exitcode}"
        text = signal.strsignal(sig) or ""
        return f"was killed by signal {sig.name}" + (f" ({text.lower()})" if text else "")
    return f"exited with code {exitcode}"


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


class RankGroup:
    """The ranks of one launch: start them, signal them, and reap them and their children.

    Example::

        group = RankGroup(specs, start_method="forkserver")
        group.start()
        ...
        group.stop()          # SIGTERM, then SIGKILL after a grace period; always reaps
    """

    def __init__(self, specs: list[RankSpec], start_method: str) -> None:
        self.specs = specs
        self.start_method = start_method
        self.ranks: list[RankProcess] = []
        self._stop_signal_sent: set[int] = set()

    def start(self) -> None:
        ctx = multiprocessing.get_context(self.start_method)
        try:
            for spec in self.specs:
                self.ranks.append(self._start_one(ctx, spec))
        except BaseException:
            self.stop(grace=0)
            raise

    def _start_one(self, ctx: Any, spec: RankSpec) -> RankProcess:
        pipes = [ctx.Pipe(duplex=False) for _ in range(4)]
        readers = [r for r, _ in pipes]
        writers = [w for _, w in pipes]
        process = ctx.Process(
            target=run_rank, args=(spec, *writers), name=f"nbaccel-rank{spec.rank}", daemon=False
        )
        try:
            process.start()
        finally:
            for w in writers:  # the rank holds them now; closing ours lets EOF arrive
                w.close()
        for r in readers[:3]:
            os.set_blocking(r.fileno(), False)
        return RankProcess(spec.rank, process, *readers)

    def alive(self) -> list[RankProcess]:
        return [r for r in self.ranks if r.exitcode() is None]

    def was_stopped(self, rank: int) -> bool:
        """Whether this group sent the rank a stop signal (so its death is not its own failure)."""
        return rank in self._stop_signal_sent

    def send_signal(self, ranks: list[RankProcess], sig: int) -> None:
        for r in ranks:
            try:
                os.kill(r.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """Ask every live rank and its children to stop (SIGTERM); returns at once."""
        alive = self.alive()
        self._stop_signal_sent.update(r.rank for r in alive)
        self._signal_trees(alive, signal.SIGTERM)

    def kill(self) -> None:
        alive = self.alive()
        self._stop_signal_sent.update(r.rank for r in alive)
        self._signal_trees(alive, signal.SIGKILL)

    def _signal_trees(self, ranks: list[RankProcess], sig: int) -> None:
        for r in ranks:
            try:
                children = psutil.Process(r.pid).children(recursive=True)
            except psutil.Error:
                children = []
            self.send_signal([r], sig)
            for child in children:
                try:
                    child.send_signal(sig)
                except psutil.Error:
                    pass

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

    def stop(self, grace: float = 3.0) -> None:
        """Stop every rank: SIGTERM, SIGKILL after ``grace`` seconds, then reap them all."""
        self.terminate()
        if not self.wait(grace):
            self.kill()
            self.wait(None)
        self.reap()

    def reap(self) -> None:
        for r in self.ranks:
            if not r._reaped:
                r.reap()
