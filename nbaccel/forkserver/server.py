"""The fork server ranks start from: a fresh interpreter (CPython's fork server) that has
imported torch once, without the kernel's threads or CUDA context, from which ranks fork in
milliseconds.

In a notebook kernel it starts at ``import nbaccel``, so it is warm by the first launch, and it
mirrors what the kernel imports (``forkserver.mirror``): before the ranks of a launch fork, the
kernel's modules the launched function refers to; after, the rest. From the next launch on every
rank finds the kernel's packages loaded, without ever sharing the kernel's process state.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import glob
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from nbaccel.core import containment, mp_internals
from nbaccel.core.errors import LaunchError
from nbaccel.core.events import RankSpec
from nbaccel.core.kernel import in_kernel
from nbaccel.forkserver import mirror
from nbaccel.forkserver.protocol import ENV_SERVER_LOG

# Imported once by the fork server; every rank then starts with them loaded. The guard comes
# first (the server's own group, subreaper, kill its tree at exit), then its log (its output
# goes to a file, never into a cell), then the rule that ranks do
# not run the launching script again (forkserver.launching_script), then torch, then the
# launch's own preloads, the mirror (its thread imports what the kernel has) and the ready
# signal last.
SERVER_PRELOAD = (
    "nbaccel.forkserver.guard",
    "nbaccel.forkserver.log",
    "nbaccel.forkserver.launching_script",
    "nbaccel.forkserver.preload",
)
SERVER_LAST = ("nbaccel.forkserver.importer", "nbaccel.forkserver.ready")
ENV_READY_FILE = "NBACCEL_SERVER_READY_FILE"
T = TypeVar("T")  # what a rank start returns
# How often a launch replaces a server that broke while mirroring before it does without.
MIRROR_ATTEMPTS = 3


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


class ForkServer:
    """This process's fork server, and everything the kernel keeps about it: the modules it
    preloads, its ready marker, its mirror, the lock of rank starts at the mirror, the ranks
    started from it (:class:`~nbaccel.core.containment.LiveRanks`), and servers retired
    while ranks still ran from them. There is one, :data:`SERVER`, because CPython's fork
    server is process-wide; a launch and a ``%ranks`` session reach it through their
    :class:`~nbaccel.launch.group.RankGroup`.

    Example::

        SERVER.ensure()                              # warm, returns at once
        with SERVER.starts, SERVER.ranks_starting(specs, "forkserver"):
            ...                                      # fork the ranks; SERVER.started(pid)
        strays = SERVER.reaped(pids)                 # after reaping: sweep, release
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The kernel's side of the mirror is one conversation on one socket: one launch's rank
        # starts (HOLD, forks, GO) at a time, and no cell's offer meanwhile. A background
        # launch can start while another launch or a %ranks start does; two HOLDs at once lost
        # each other's answers and a launch waited until the mirror's silence deadline.
        # RankGroup.start holds it.
        self.starts = threading.Lock()
        self.modules: tuple[str, ...] = ()
        self._ready_marker: str | None = None  # exists while the server is still importing
        self.mirror: mirror.Mirror | None = None  # the current server's
        # In a kernel the server mirrors everything the kernel imports, while the person reads
        # and writes cells. A script or a terminal IPython has no such idle time: there the
        # server imports only the packages a launched function refers to, before its ranks
        # fork, once for every later launch (each rank imported them itself, on every launch).
        self.mirrors_everything = False
        self.live = containment.LiveRanks()
        # Servers replaced while ranks of theirs ran: each keeps serving them, and is stopped
        # once the last has been reaped (pid -> what mp_internals.end_detached needs).
        self._retired: dict[int, tuple[int, int, Any]] = {}
        # In a kernel, the servers' own output goes here (forkserver.log), never into a cell;
        # how much of it a launch has pointed to already.
        self.log_path: str | None = None
        self._log_told = 0

    def ensure(self, extra_modules: tuple[str, ...] = (), restart: bool = False) -> None:
        """Start the fork server (or restart it when it lacks ``extra_modules``, or
        ``restart``); returns at once.

        The server imports its modules in the background; the first rank start waits for
        that.
        """
        wanted = tuple(dict.fromkeys((*SERVER_PRELOAD, *extra_modules, *SERVER_LAST)))
        # Ctrl-C waits until the server is started (or stopped and restarted): cut in half, the
        # next launch would find multiprocessing's record of it inconsistent.
        with self._lock, containment.sigint_deferred():
            restart = restart or not set(wanted) <= set(self.modules)
            alive = mp_internals.server_alive(mp_internals.forkserver_pid())
            if not restart and alive:
                return
            if self.mirror is not None:
                self.mirror.abandon(died=not alive)
                self.mirror = None
            self.modules = wanted
            fd, marker = tempfile.mkstemp(prefix="nbaccel-server-warming-")
            os.close(fd)
            everything = in_kernel()
            new_mirror = mirror.Mirror(mirror.candidates() if everything else [])
            env = {ENV_READY_FILE: marker, **new_mirror.env()}
            if everything:  # a script's server prints where the script does
                env[ENV_SERVER_LOG] = self._log()
            if mp_internals.start_forkserver(list(wanted), restart=restart, env=env):
                _discard(self._ready_marker)
                self._ready_marker = marker
                self.mirror, self.mirrors_everything = new_mirror, everything
            else:
                _discard(marker)
                new_mirror.close()

    def lacks(self, extra_modules: tuple[str, ...]) -> bool:
        """Whether :meth:`ensure` would restart the server (stopping every rank forked from
        it) to preload ``extra_modules``."""
        wanted = (*SERVER_PRELOAD, *extra_modules, *SERVER_LAST)
        alive = mp_internals.server_alive(mp_internals.forkserver_pid())
        return alive and not set(wanted) <= set(self.modules)

    @contextlib.contextmanager
    def ranks_starting(
        self,
        specs: Sequence[RankSpec],
        start_method: str,
        waiting: Callable[[str | None], None] = lambda what: None,
    ) -> Iterator[None]:
        """Around the forks of a launch's ranks: wait until the server is ready and has
        imported the kernel's modules the function refers to; afterwards let it mirror the
        rest (in a kernel; elsewhere the server imports only what launched functions need).
        ``waiting`` hears, about every :data:`~nbaccel.forkserver.mirror.TICK` s, what is
        waited for in words, and ``None`` once the ranks are starting.

        A server that broke while mirroring (an import loaded CUDA, took too long, or killed
        it) is replaced by a fresh one first, which no longer imports that module; one that
        still serves other ranks (a background launch, a ``%ranks`` session) is retired
        instead of stopped, and serves them until they end. The wait is interruptible: no
        rank is started yet. Other start methods have no server: nothing to do.
        """
        held = None
        names: list[str] = []  # the kernel's candidates, listed once for the whole start
        try:
            for attempt in range(MIRROR_ATTEMPTS + 1 if start_method == "forkserver" else 0):
                self.wait_until_ready(waiting=waiting)
                current = self.mirror
                if current is not None and current.broken is None and current.connected():
                    if attempt == MIRROR_ATTEMPTS:
                        break
                    names = names or mirror.candidates()
                    first = mirror.needed(specs, names)
                    if not (self.mirrors_everything or current.lacks(first)):
                        break  # a script's server has them and imports nothing else
                    held = current
                    words = functools.partial(current.hold_words, first)
                    current.hold(first, tick=functools.partial(_tell, waiting, words))
                    if held.broken is None:
                        break
                elif current is None or current.broken is None or attempt == MIRROR_ATTEMPTS:
                    break
                broken = (held or current).broken if (held or current) else None
                print(
                    f"nbaccel: replacing the fork server ({broken}); that module is not "
                    "imported there any more",
                    file=sys.stderr,
                    flush=True,
                )
                held, names = None, []  # (listed again: without what broke it)
                self._retire_serving()
                self.ensure(self._launch_preloads(), restart=True)
            waiting(None)
            self._point_to_log()
            yield
        finally:  # also after Ctrl-C while waiting: a server left holding would mirror no more
            if held is not None and held.broken is None:
                held.go(names if self.mirrors_everything else [])

    def _log(self) -> str:
        if self.log_path is None:
            self.log_path = os.path.join(tempfile.gettempdir(), f"{_LOG_PREFIX}{os.getpid()}.log")
            atexit.register(_discard, self.log_path)
            _sweep_logs()
        return self.log_path

    def _point_to_log(self) -> None:
        """One line when the server wrote something (a package that prints or warns as it is
        imported) since the last launch: where to read it."""
        if self.log_path is None:
            return
        try:
            size = os.path.getsize(self.log_path)
        except OSError:
            return
        if size > self._log_told:
            print(
                f"nbaccel: the fork server wrote {size - self._log_told:,} bytes while importing "
                f"your packages (a package's prints or warnings); see {self.log_path}",
                file=sys.stderr,
                flush=True,
            )
            self._log_told = size

    def _retire_serving(self) -> None:
        """Set the current server aside, still running, when ranks forked from it live: the
        restart that follows then starts a new one instead of stopping it (and them)."""
        pid = mp_internals.forkserver_pid()
        if pid is None or not mp_internals.server_alive(pid) or not self.live.from_server(pid):
            return
        self._retire(pid)

    def retire_unanswering(self, pid: int, even_serving: bool = False) -> int:
        """The server ``pid`` did not answer a rank start: set it aside (the next start gets
        a fresh one) and stop it now, unless ranks forked from it live: it serves them until
        the last is reaped. Returns how many there are. ``even_serving``: it did not report
        its ranks' ends either (``RankGroup._statuses_late``), so it is stopped anyway."""
        self._retire(pid)
        serving = len(self.live.from_server(pid))
        if even_serving or not serving:
            with self._lock:
                if pid in self._retired:  # a hung server does not exit by itself: SIGKILL
                    mp_internals.end_detached(self._retired.pop(pid), wait=0.0)
        return serving

    def _retire(self, pid: int) -> None:
        with self._lock:
            if mp_internals.forkserver_pid() != pid:
                return  # already set aside (or replaced)
            detached = mp_internals.detach_forkserver()
            if detached is not None:
                self._retired[detached[0]] = detached
            if self.mirror is not None:  # the retired server mirrors no more
                self.mirror.abandon(died=False)
                self.mirror = None

    def start_answered(
        self, start: Callable[[], T], interrupted: list[bool], late: Callable[[T], None]
    ) -> T:
        """Run ``start`` (one rank start through the fork server) in a thread of its own and
        return what it returns, so that the kernel is never stuck in a read from a server that
        does not answer.

        A start unanswered for :data:`ANSWER_DEADLINE` s (or 2 s after Ctrl-C, once
        ``interrupted`` holds something) is given up: the server process is retired
        (:meth:`retire_unanswering`: the next launch gets a fresh one, and the ranks of other
        launches or a ``%ranks`` session keep theirs), and ``LaunchError``
        (``KeyboardInterrupt`` after Ctrl-C) says so. Should the server answer after all,
        ``late`` gets what the start made, to stop it: nothing else of what runs is touched.

        Example::

            with sigint_deferred() as interrupted:
                rank = SERVER.start_answered(lambda: start_one(spec), interrupted, stop_late)
        """
        lock, done = threading.Lock(), threading.Event()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = start()
            except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                outcome["error"] = exc
            with lock:
                done.set()
                given_up = "given up" in outcome
            if given_up and "value" in outcome:
                late(outcome["value"])

        context = contextvars.copy_context()  # its output, if any, is the launching cell's
        thread = threading.Thread(target=context.run, args=(run,), name="nbaccel-rank-start")
        thread.daemon = True
        thread.start()
        began, interrupted_at = time.monotonic(), None
        while not done.wait(0.05):
            now = time.monotonic()
            if interrupted and interrupted_at is None:
                interrupted_at = now
            if (
                interrupted_at is not None
                and now - interrupted_at > ANSWER_DEADLINE_AFTER_INTERRUPT
            ):
                waited = f"{ANSWER_DEADLINE_AFTER_INTERRUPT:g} s after Ctrl-C"
            elif now - began > ANSWER_DEADLINE:
                waited = f"{ANSWER_DEADLINE:g} s"
            else:
                continue
            with lock:
                if done.is_set():  # it answered just now
                    break
                outcome["given up"] = True
            pid = mp_internals.forkserver_pid()
            serving = self.retire_unanswering(pid) if pid is not None else 0
            reason = (
                f"the fork server (pid {pid}) did not answer a rank start within {waited}, so "
                + (
                    f"it was set aside: it goes on serving the {serving} ranks already running "
                    "from it (a background launch's or a %ranks session's) until they end"
                    if serving
                    else "it was stopped"
                )
                + "; the next launch starts a fresh one"
            )
            if interrupted:
                raise KeyboardInterrupt(f"launch interrupted: {reason}")
            raise LaunchError(f"the launch could not start its ranks: {reason}.")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _launch_preloads(self) -> tuple[str, ...]:
        return tuple(m for m in self.modules if m not in SERVER_PRELOAD + SERVER_LAST)

    def started(self, pid: int, start_method: str) -> None:
        """Register a rank just started (under ``forkserver``: forked by the current server)."""
        self.live.add(pid, mp_internals.forkserver_pid() if start_method == "forkserver" else None)

    def reaped(self, pids: set[int]) -> list[tuple[int, str]]:
        """After the ranks ``pids`` were reaped: kill what they left running (the sweep spares
        every other live rank), release them, and stop a retired server none of whose ranks
        is left. Returns (pid, command) of each process killed."""
        strays = containment.sweep(pids, self.server_pids(), self.live)
        self.live.discard(pids)
        with self._lock:
            for pid in [p for p in self._retired if not self.live.from_server(p)]:
                mp_internals.end_detached(self._retired.pop(pid))
        return strays

    def server_pids(self) -> set[int]:
        """The current fork server's pid and those of retired servers still serving ranks."""
        pid = mp_internals.forkserver_pid()
        with self._lock:  # a background launch's reaping may stop a retired one meanwhile
            retired = set(self._retired)
        return retired | ({pid} if pid is not None else set())

    def helper_pids(self) -> set[int]:
        """Long-lived helpers of this process that are not ranks: the fork servers and the
        resource tracker multiprocessing starts beside them."""
        tracker = mp_internals.resource_tracker_pid()
        return self.server_pids() | ({tracker} if tracker is not None else set())

    def follow_kernel(self, shell: Any) -> None:
        """After each cell of IPython ``shell``, offer the fork server what the cell imported;
        when the kernel shuts down, let multiprocessing's resource tracker go with it."""
        if self._after_cell not in shell.events.callbacks.get("post_run_cell", []):
            shell.events.register("post_run_cell", self._after_cell)
            if hasattr(shell, "observe"):  # a traitlets shell: ipykernel sets exit_now first
                shell.observe(_kernel_exiting, names="exit_now")

    def _after_cell(self, *_: Any) -> None:
        if not self.starts.acquire(blocking=False):
            return  # a launch is starting ranks: its GO offers everything the kernel has
        try:
            if self.mirror is not None:
                self.mirror.offer(mirror.candidates())
        except Exception:  # noqa: BLE001 - warming is an optimisation; a cell must never fail
            pass
        finally:
            self.starts.release()

    def warming(self) -> str | None:
        """What a server that nbaccel started is still importing, as the views say it
        ("fork server: importing torch"); None once it is ready (or when none was started)."""
        marker = self._ready_marker
        if marker is None or not os.path.exists(marker):
            return None
        return f"fork server: importing {_importing(marker)}"

    def wait_until_ready(
        self, poll: float = 0.02, waiting: Callable[[str | None], None] = lambda what: None
    ) -> None:
        """Wait until the fork server started by :meth:`ensure` has finished importing;
        ``waiting`` hears what it imports ("fork server: importing torch._dynamo") about every
        :data:`~nbaccel.forkserver.mirror.TICK` s meanwhile.

        Returns at once for a server that is ready (or that nbaccel did not start). The wait
        is interruptible: a ``KeyboardInterrupt`` here leaves no rank half-started, because
        none was asked for yet.
        """
        marker = self._ready_marker
        told = 0.0
        while marker is not None and os.path.exists(marker):
            pid = mp_internals.forkserver_pid()
            if pid is None or not mp_internals.server_alive(pid):
                break  # it died importing; starting a rank will start (and wait for) a new one
            if time.monotonic() - told >= mirror.TICK:
                told = time.monotonic()
                waiting(self.warming())
            time.sleep(poll)
        _discard(marker)
        if self._ready_marker == marker:
            self._ready_marker = None


_LOG_PREFIX = "nbaccel-fork-server-"


def _sweep_logs() -> None:
    """Remove the fork-server logs of kernels that are gone (a killed kernel runs no atexit)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_LOG_PREFIX}*.log")):
        try:
            pid = int(os.path.basename(path)[len(_LOG_PREFIX) : -len(".log")])
            if os.stat(path).st_uid == os.getuid():
                os.kill(pid, 0)
        except ProcessLookupError:
            _discard(path)
        except (ValueError, OSError, AttributeError):
            continue


def _kernel_exiting(change: Any) -> None:
    """ipykernel's shutdown stops the kernel's children with SIGTERM, retried until they are
    gone; the resource tracker our fork servers started ignores SIGTERM and waits for its pipe
    to close, which the kernel holds: the shutdown took 2.6 s instead of 0.2 s, until
    jupyter_client killed the kernel. Closing the kernel's end lets it go with the others."""
    if change.get("new"):
        mp_internals.let_resource_tracker_go()


def _tell(waiting: Callable[[str | None], None], words: Callable[[], str]) -> None:
    waiting(words())


def _importing(marker: str) -> str:
    """What the warming server says it imports (``forkserver.preload`` writes it into the marker)."""
    try:
        with open(marker, encoding="utf-8") as f:
            return f.read().strip() or "torch"
    except OSError:
        return "torch"


# The process's one fork server (CPython's is process-wide).
SERVER = ForkServer()


def _discard(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


# A rank start is a few milliseconds of the server's time; one that takes this long, or this
# long after Ctrl-C, means the server no longer answers.
ANSWER_DEADLINE = 30.0
ANSWER_DEADLINE_AFTER_INTERRUPT = 2.0
