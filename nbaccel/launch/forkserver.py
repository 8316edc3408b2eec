"""The fork server ranks start from: a process that has imported torch once, without the
kernel's threads or CUDA context, from which ranks fork in milliseconds.

In a notebook kernel that has imported torch (and not initialised CUDA) the server is a fork of
the kernel made clean (``rank.zygote``): it has torch at once, so even a launch right after the
import cell finds it nearly ready. Otherwise it is a fresh interpreter that imports torch first.
``NBACCEL_ZYGOTE=0`` always starts the fresh interpreter.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time

from nbaccel.core import libc, mp_internals, openmp
from nbaccel.launch import containment
from nbaccel.rank import zygote
from nbaccel.ui import in_kernel

# Imported once by the fork server; every rank then starts with them loaded. The guard comes
# first (the server's own group, subreaper, kill its tree at exit), the ready signal last.
SERVER_PRELOAD = ("nbaccel.rank.server_guard", "nbaccel.rank.preload")
SERVER_READY = "nbaccel.rank.server_ready"
ENV_READY_FILE = "NBACCEL_SERVER_READY_FILE"
ENV_ZYGOTE = "NBACCEL_ZYGOTE"
# A fork keeps the kernel's memory of that moment alive (copy-on-write): memory the kernel frees
# later would stay taken. A kernel that just imported torch holds ~0.3 GiB of its own.
ZYGOTE_MAX_PRIVATE_BYTES = 1 << 30

_server_lock = threading.Lock()
_server_modules: tuple[str, ...] = ()
_ready_marker: str | None = None  # exists while the server started last is still importing
_server_kind: str | None = None  # "fork of the kernel" or "fresh interpreter", once started


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
    global _server_modules, _ready_marker, _server_kind
    wanted = tuple(dict.fromkeys(SERVER_PRELOAD + tuple(extra_modules) + (SERVER_READY,)))
    # Ctrl-C waits until the server is started (or stopped and restarted): cut in half, the
    # next launch would find multiprocessing's record of it inconsistent.
    with _server_lock, containment.sigint_deferred():
        restart = not set(wanted) <= set(_server_modules)
        running = mp_internals.server_alive(mp_internals.forkserver_pid())
        if restart or not running:
            _server_modules = wanted
        fd, marker = tempfile.mkstemp(prefix="nbaccel-server-warming-")
        os.close(fd)
        env = {ENV_READY_FILE: marker}
        if not running and zygote_unavailable() is None and openmp.release_thread_pools():
            serve = functools.partial(zygote.serve, preload=list(wanted), env=env)
            mp_internals.fork_forkserver(serve, list(wanted))
            started, kind = True, "fork of the kernel"
        else:
            started = mp_internals.start_forkserver(list(wanted), restart=restart, env=env)
            kind = "fresh interpreter"
        if started:
            _discard(_ready_marker)
            _ready_marker = marker
            _server_kind = kind
        else:
            _discard(marker)


def zygote_unavailable() -> str | None:
    """Why the fork server cannot be a fork of this process now, or ``None`` when it can.

    >>> zygote_unavailable()  # a doctest run is no notebook kernel
    'not in a notebook kernel'
    """
    if os.environ.get(ENV_ZYGOTE) == "0":
        return f"{ENV_ZYGOTE}=0"
    if not in_kernel():
        return "not in a notebook kernel"
    if not sys.platform.startswith("linux"):
        return "not on Linux"
    if threading.current_thread() is not threading.main_thread():
        return "not called from the kernel's main thread"
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch is not imported yet (the server imports it itself)"
    for name in ("cuda", "xpu"):
        device = getattr(torch, name, None)
        is_initialized = getattr(device, "is_initialized", None)
        if is_initialized is not None and is_initialized():
            return f"{name.upper()} is initialised in the kernel (a fork would inherit it)"
    if _cuda_driver_loaded():
        return (
            "CUDA's driver is loaded in the kernel (torch.cuda.is_available() loads it): "
            "a fork of the kernel could not use the GPU"
        )
    if getattr(getattr(torch, "version", None), "hip", None):
        return "ROCm builds of torch are not checked with a fork of the kernel"
    if sys.gettrace() is not None or _monitoring_tools():
        return "a debugger or tracer is active in the kernel"
    private = _private_memory()
    if private > ZYGOTE_MAX_PRIVATE_BYTES:
        return (
            f"the kernel holds {private / 2**30:.1f} GiB of its own memory, which a fork of it "
            "would keep alive after the kernel frees it"
        )
    if not isinstance(os.fork, type(os.getpid)):
        return "os.fork is patched (a debugger's child-process support?)"
    if not mp_internals.can_fork_forkserver():
        return "this Python's multiprocessing fork server is not one nbaccel knows"
    return None


def _cuda_driver_loaded() -> bool:
    """Whether libcuda is mapped into this process: any CUDA call, ``is_available()`` and
    ``device_count()`` included, loads and initialises it, and a fork cannot use it after."""
    return any("libcuda.so" in path for path in libc.loaded_libraries())


def _monitoring_tools() -> bool:
    """Whether a debugger or profiler uses ``sys.monitoring`` (Python 3.12+)."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return False
    return any(monitoring.get_tool(tool) is not None for tool in range(6))


def _private_memory() -> int:
    """Resident memory of this process that no other process shares (Linux: rss - shared)."""
    import psutil

    info = psutil.Process().memory_info()
    return info.rss - getattr(info, "shared", 0)


def server_kind() -> str | None:
    """What the fork server started last is: ``"fork of the kernel"``, ``"fresh interpreter"``,
    or ``None`` before one was started."""
    return _server_kind


def wait_until_ready(poll: float = 0.02) -> None:
    """Wait until the fork server started by :func:`ensure_server` has finished importing.

    Returns at once for a server that is ready (or that nbaccel did not start). The wait is
    interruptible: a ``KeyboardInterrupt`` here leaves no rank half-started, because none was
    asked for yet.
    """
    global _ready_marker
    marker = _ready_marker
    while marker is not None and os.path.exists(marker):
        pid = mp_internals.forkserver_pid()
        if pid is None or not mp_internals.server_alive(pid):
            break  # it died importing; starting a rank will start (and wait for) a new one
        time.sleep(poll)
    _discard(marker)
    if _ready_marker == marker:
        _ready_marker = None


def _discard(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def helper_pids() -> set[int]:
    """Long-lived helpers of this process that are not ranks: the fork server and the
    resource tracker multiprocessing starts beside it."""
    pids = {mp_internals.forkserver_pid(), mp_internals.resource_tracker_pid()}
    return {p for p in pids if p is not None}


# A rank start is a few milliseconds of the server's time; one that takes this long, or this
# long after Ctrl-C, means the server no longer answers.
ANSWER_DEADLINE = 30.0
ANSWER_DEADLINE_AFTER_INTERRUPT = 2.0


class AnswerWatchdog:
    """Stop the fork server when it does not answer the rank start in the block in time, so
    the kernel is never stuck in a read from a hung server; ``reason`` then says what happened.

    Example::

        with sigint_deferred() as interrupted, AnswerWatchdog(interrupted) as watchdog:
            process.start()            # returns, or fails once the server was stopped
    """

    def __init__(self, interrupted: list[bool], deadline: float = ANSWER_DEADLINE) -> None:
        self.interrupted, self.deadline = interrupted, deadline
        self.reason: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nbaccel-server-watchdog")

    def __enter__(self) -> AnswerWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        started, interrupted_at = time.monotonic(), None
        while not self._done.wait(0.05):
            now = time.monotonic()
            if self.interrupted and interrupted_at is None:
                interrupted_at = now
            if (
                interrupted_at is not None
                and now - interrupted_at > ANSWER_DEADLINE_AFTER_INTERRUPT
            ):
                waited = f"{ANSWER_DEADLINE_AFTER_INTERRUPT:g} s after Ctrl-C"
            elif now - started > self.deadline:
                waited = f"{self.deadline:g} s"
            else:
                continue
            pid = mp_internals.forkserver_pid()
            if pid is not None:
                self.reason = (
                    f"the fork server (pid {pid}) did not answer a rank start within {waited}, "
                    "so it was stopped (with any %ranks session it had started); the next "
                    "launch starts a fresh one"
                )
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
                return
